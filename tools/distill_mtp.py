"""Fine-tunes the default model's MTP block (weights/, mtp.*) by distillation from the model itself, on
the CPU (torch >= 1.13 with bf16 matrix products, numpy; no transformers), and rewrites its oracle logits.

  cc -std=c11 -O3 -march=native -ffp-contract=fast -fopenmp -o build/mtp_data tools/mtp_data.c -lm -lpthread
  build/mtp_data weights data/brown.json held text   data/mtp/held_text.bin
  build/mtp_data weights data/brown.json held greedy:16:48  data/mtp/held_greedy.bin
  build/mtp_data weights data/brown.json train text  data/mtp/train_text.bin
  build/mtp_data weights data/brown.json train greedy:16:1920 data/mtp/train_greedy.bin
  python3 tools/distill_mtp.py weights tests/fixtures/default-ref data/mtp SECONDS

tools/train_default.py --mtp trained the block on the corpus's own next tokens. A draft is accepted
when it equals the model's choice, so this trains it toward the model's distribution instead: at MTP
position t, depth d (0, 1: the block applied to its own output, as drafting does) the loss is the
cross-entropy of the block's logits against softmax(lm_head(h_{t+d+1})), the model's prediction of the
same token x_{t+d+2}. Its hidden states h come from nemoh's CPU engine (tools/mtp_data.c): the
training documents' text (teacher-forced windows) and the model's greedy continuations of their
prompts, 4 and 12 windows of each batch (greedy text is what a greedy drafting step is verified against).
AdamW from the stored block, bf16 autocast, batches of 16 windows x 510 positions, for the time
budget; kept: the weights of the best held-out agreement on greedy text (mean over the depths). A run
starts from the stored block: the previous run's log moves under "previous" in train_log.json.

Then, before anything is written, the oracle: a float64 torch forward of the whole model and the MTP
block written out here from the notes' formulas must reproduce ref_logits.bin (transformers' float32
logits) and the previous block's mtp_logits.bin within 1e-4 (made by transformers' oracle for the
first block; after a run of this script, by this oracle: run it from the first block, `git show
28fb754:weights/model.safetensors` and that commit's mtp_logits.bin, for the check to mean something);
it then computes the new block's mtp_logits.bin. Writes weights/model.safetensors (the mtp.* bytes in place, header and
base tensors unchanged), tests/fixtures/default-ref/mtp_logits.bin and ref.json's mtp entry, and
train_log.json's "mtp_distill" section."""
import json, math, os, struct, sys, time
import numpy as np
import torch
import torch.nn.functional as F

if len(sys.argv) != 5:
    raise SystemExit("usage: distill_mtp.py WEIGHTS REF_DIR DATA_DIR SECONDS")
wdir, ref_dir, data_dir, budget = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
torch.manual_seed(0)
torch.set_num_threads(os.cpu_count())
BATCH, GREEDY, DEPTHS, LR, DRAFT_VOCAB = 16, 12, 2, 3e-4, 1024   # GREEDY: windows of a batch from train_greedy;
# DRAFT_VOCAB: the CPU's default --mtp-vocab

cfg = json.load(open(os.path.join(wdir, "config.json")))
H, V, EPS = cfg["hidden_size"], cfg["vocab_size"], cfg["layer_norm_epsilon"]
NH, NKV, HD = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["attention_head_dim"]
MH, MD, G, N, K = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"], cfg["conv_kernel"]
PATTERN, MTP_PATTERN = cfg["hybrid_override_pattern"], cfg["mtp_hybrid_override_pattern"]


# ---- safetensors, read by hand (every tensor bf16) ----
st_path = os.path.join(wdir, "model.safetensors")
with open(st_path, "rb") as fh:
    raw = bytearray(fh.read())
hlen = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + hlen])
TENS = {}
for name, v in header.items():
    if name == "__metadata__":
        continue
    if v["dtype"] != "BF16":
        raise SystemExit(f"{st_path}: {name} is {v['dtype']}, not BF16")
    a, b = v["data_offsets"]
    TENS[name] = torch.frombuffer(raw[8 + hlen + a:8 + hlen + b], dtype=torch.bfloat16).view(v["shape"]).clone()
EMB, HEAD = TENS["backbone.embeddings.weight"].float(), TENS["lm_head.weight"].float()


# ---- the model's pieces, for any dtype: float64 for the oracle, bf16 autocast for training ----
def rms(x, w):
    """x * rsqrt(mean(x^2) + eps) * w, in float32 at least"""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def causal(T, dtype):
    return torch.full((T, T), float("-inf"), dtype=dtype).triu(1)


def attention(x, get, pre):
    """causal GQA, no positional encoding, softmax in float32 at least; x [B, T, H]"""
    B, T, _ = x.shape
    q = F.linear(x, get(pre + "q_proj.weight")).view(B, T, NH, HD).transpose(1, 2)
    k = F.linear(x, get(pre + "k_proj.weight")).view(B, T, NKV, HD).transpose(1, 2).repeat_interleave(NH // NKV, 1)
    v = F.linear(x, get(pre + "v_proj.weight")).view(B, T, NKV, HD).transpose(1, 2).repeat_interleave(NH // NKV, 1)
    s = torch.matmul(q, k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) / math.sqrt(HD)
    a = (s + causal(T, s.dtype)).softmax(-1).to(v.dtype)
    return F.linear(torch.matmul(a, v).transpose(1, 2).reshape(B, T, NH * HD), get(pre + "o_proj.weight"))


def mlp(x, get, pre):
    """down(relu(up(x))^2)"""
    return F.linear(F.relu(F.linear(x, get(pre + "up_proj.weight"))).square(), get(pre + "down_proj.weight"))


def mamba(x, get, pre):
    """Mamba2 over one sequence x [T, H], token by token (float64: the oracle only)"""
    T, di = x.shape[0], MH * MD
    z, xbc, dt = F.linear(x, get(pre + "in_proj.weight")).split([di, di + 2 * G * N, MH], -1)
    w = get(pre + "conv1d.weight")[:, 0, :]                      # [channels, K], causal depthwise
    pad = torch.cat([torch.zeros(K - 1, xbc.shape[1], dtype=x.dtype), xbc])
    xbc = F.silu(sum(w[:, j] * pad[j:j + T] for j in range(K)) + get(pre + "conv1d.bias"))
    xs, Bm, Cm = xbc.split([di, G * N, G * N], -1)
    dt = F.softplus(dt + get(pre + "dt_bias"))                   # no clamp
    A = -torch.exp(get(pre + "A_log"))
    grp = torch.arange(MH) // (MH // G)                           # head h reads group h / (heads per group)
    S, ys = torch.zeros(MH, MD, N, dtype=x.dtype), []
    for t in range(T):
        xt = xs[t].view(MH, MD)
        # S = exp(dt A) S + dt x (x) B;  y = S.C + D x
        S = torch.exp(dt[t] * A)[:, None, None] * S + dt[t][:, None, None] * xt[:, :, None] * Bm[t].view(G, N)[grp][:, None, :]
        ys.append((S @ Cm[t].view(G, N)[grp][:, :, None])[..., 0] + get(pre + "D")[:, None] * xt)
    y = (torch.stack(ys).reshape(T, di) * F.silu(z)).view(T, G, di // G)
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS)).reshape(T, di) * get(pre + "norm.weight")
    return F.linear(y, get(pre + "out_proj.weight"))


def base_hidden(ids):
    """float64 [T, H]: the model's output after norm_f over ids"""
    get = lambda n: TENS[n].double()
    h = get("backbone.embeddings.weight")[ids]
    for l, c in enumerate(PATTERN):
        pre = f"backbone.layers.{l}."
        x = rms(h, get(pre + "norm.weight"))
        mix = {"M": lambda: mamba(x, get, pre + "mixer."), "*": lambda: attention(x[None], get, pre + "mixer.")[0],
               "-": lambda: mlp(x, get, pre + "mixer.")}
        h = h + mix[c]()
    return rms(h, get("backbone.norm_f.weight"))


class MTP(torch.nn.Module):
    """g_t = final_layernorm(sublayers(eh_proj([enorm(E[x_{t+1}]) ; hnorm(h_t)]))), NVIDIA's mtp.* names"""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.ParameterDict({k[4:].replace(".", "__"): torch.nn.Parameter(v.float())
                                         for k, v in TENS.items() if k.startswith("mtp.")})

    def get(self, name):
        return self.p[name.replace(".", "__")]

    def forward(self, emb, hid):
        u = F.linear(torch.cat([rms(emb, self.get("layers.0.enorm.weight")), rms(hid, self.get("layers.0.hnorm.weight"))], -1),
                     self.get("layers.0.eh_proj.weight")).to(torch.promote_types(emb.dtype, torch.float32))
        for i, c in enumerate(MTP_PATTERN):
            x = rms(u, self.get(f"layers.{i}.norm.weight"))
            u = u + (attention if c == "*" else mlp)(x, self.get, f"layers.{i}.mixer.")
        return rms(u, self.get(f"layers.{len(MTP_PATTERN) - 1}.final_layernorm.weight"))


# ---- the oracle must reproduce transformers' references before it is trusted ----
ref = json.load(open(os.path.join(ref_dir, "ref.json")))
ids = ref["ids"]
s = ids + [ref["mtp_next"]]
def read_f32(path, rows):
    return torch.from_numpy(np.fromfile(path, dtype="<f4").reshape(rows, V)).double()


with torch.no_grad():
    h64 = base_hidden(torch.tensor(s[:-1]))
    d_base = float((F.linear(h64, HEAD.double()) - read_f32(os.path.join(ref_dir, "ref_logits.bin"), len(ids))).abs().max())
    if int(torch.argmax(F.linear(h64[-1], HEAD.double()))) != ref["mtp_next"]:
        raise SystemExit("the float64 oracle's argmax after the reference ids is not ref.json's mtp_next")
    def oracle(mtp):
        m = MTP().double()
        m.load_state_dict({k: v.double() for k, v in mtp.state_dict().items()})
        return F.linear(m(EMB.double()[torch.tensor(s[1:])][None], h64[None])[0], HEAD.double())
    d_prev = float((oracle(MTP()) - read_f32(os.path.join(ref_dir, "mtp_logits.bin"), len(ids))).abs().max())
print(f"float64 oracle: base logits within {d_base:.3g} of ref_logits.bin, the stored block's MTP logits within "
      f"{d_prev:.3g} of mtp_logits.bin", flush=True)
if d_base > 1e-4 or d_prev > 1e-4:
    raise SystemExit("the float64 oracle does not reproduce transformers' references within 1e-4")


# ---- data: windows of ids and bf16 hidden states from tools/mtp_data.c ----
def load(name):
    path = os.path.join(data_dir, name)
    nw, W, h = np.fromfile(path, dtype="<i4", count=3)
    if h != H:
        raise SystemExit(f"{path}: hidden {h}, the model's is {H}")
    rec = np.fromfile(path, dtype=np.dtype([("ids", "<i4", (W,)), ("h", "<i2", (W, H))]), offset=12)
    if len(rec) != nw:
        raise SystemExit(f"{path}: {len(rec)} windows, the header says {nw}")
    return torch.from_numpy(rec["ids"].astype(np.int64)), torch.from_numpy(rec["h"].copy()).view(torch.bfloat16)


sets = {n: load(n + ".bin") for n in ("train_text", "train_greedy", "held_text", "held_greedy")}
W = sets["held_text"][0].shape[1]
S = W - DEPTHS   # MTP positions a window trains: depth d at t reads x_{t+d+1} and is taken against h_{t+d+1}
with torch.no_grad():
    d_h = float((sets["held_text"][1][0, :64].double() - base_hidden(sets["held_text"][0][0, :64])).abs().max())
print(f"data: {', '.join(f'{n} {len(v[0])} windows' for n, v in sets.items())}; nemoh's h over held_text's first 64 "
      f"tokens within {d_h:.3g} of the oracle's (bf16 storage)", flush=True)
if d_h > 0.05:
    raise SystemExit("the data's hidden states are not the model's")


def run_depths(mtp, x, h):
    """logits of each depth [B, S, V] and the model's own logits for the same tokens (the targets)"""
    out, tgt, hid = [], [], h[:, :S]
    for d in range(DEPTHS):
        hid = mtp(EMB[x[:, d + 1:d + 1 + S]], hid)
        out.append(F.linear(hid, HEAD).float())
        with torch.no_grad():
            tgt.append(F.linear(h[:, d + 1:d + 1 + S], HEAD).float())
    return out, tgt


@torch.no_grad()
def evaluate(mtp, name, every=1):
    """per depth: mean cross-entropy against the model's distribution, top-1 agreement with its argmax
    (a greedy draft accepted), and the same among the first DRAFT_VOCAB ids (the CPU's drafts)"""
    xs, hs = sets[name]
    ce, agree, agree_v, n = [0.0] * DEPTHS, [0] * DEPTHS, [0] * DEPTHS, 0
    for i in range(0, len(xs), BATCH * every):
        x, h = xs[i:i + BATCH * every:every], hs[i:i + BATCH * every:every]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, tgt = run_depths(mtp, x, h)
        for d in range(DEPTHS):
            ce[d] += float(-(tgt[d].softmax(-1) * out[d].log_softmax(-1)).sum())
            top = tgt[d].argmax(-1)
            agree[d] += int((out[d].argmax(-1) == top).sum())
            agree_v[d] += int((out[d][..., :DRAFT_VOCAB].argmax(-1) == top).sum())
        n += x.shape[0] * S
    return {"loss": [round(v / n, 4) for v in ce], "top1_agreement": [round(v / n, 4) for v in agree],
            f"top1_agreement_first_{DRAFT_VOCAB}_ids": [round(v / n, 4) for v in agree_v]}


# ---- training ----
mtp = MTP().train()
start = {n: evaluate(mtp, n) for n in ("held_text", "held_greedy")}
print(f"stored block, held-out: {start}", flush=True)
score = lambda e: sum(e["held_greedy"]["top1_agreement"]) / DEPTHS   # what a greedy drafting step gets accepted
best, best_state, best_step = score(start), {k: v.detach().clone() for k, v in mtp.state_dict().items()}, 0
decay = [p for p in mtp.parameters() if p.ndim >= 2]
other = [p for p in mtp.parameters() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                        lr=LR, betas=(0.9, 0.95))
log, t0, step, total, warm = [], time.time(), 0, None, 20
while True:
    if total is None and step == 10:   # size the run to the time budget (evaluations included)
        total = max(50, int(budget / ((time.time() - t0) / 10) * 0.85))
        print(f"{(time.time() - t0) / 10:.2f} s/step -> {total} steps", flush=True)
    T = total or 10 ** 9
    if step >= T:
        break
    lr = LR * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / T))))
    for g in opt.param_groups:
        g["lr"] = lr
    pick = [torch.randint(0, len(sets[n][0]), (k,)) for n, k in (("train_text", BATCH - GREEDY), ("train_greedy", GREEDY))]
    x = torch.cat([sets["train_text"][0][pick[0]], sets["train_greedy"][0][pick[1]]])
    h = torch.cat([sets["train_text"][1][pick[0]], sets["train_greedy"][1][pick[1]]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, tgt = run_depths(mtp, x, h)
    losses = [-(tg.softmax(-1) * o.log_softmax(-1)).sum(-1).mean() for o, tg in zip(out, tgt)]
    opt.zero_grad(set_to_none=True)
    (sum(losses) / DEPTHS).backward()
    torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
    opt.step()
    step += 1
    if step % 50 == 0 or step == T:
        mtp.eval()
        ev = {n: evaluate(mtp, n, 1 if step == T else 3) for n in ("held_text", "held_greedy")}
        mtp.train()
        log.append({"step": step, "seconds": round(time.time() - t0, 1), "train_loss": [round(float(v), 4) for v in losses]} | ev)
        print(log[-1], flush=True)
        if score(ev) > best:
            best, best_step = score(ev), step
            best_state = {k: v.detach().clone() for k, v in mtp.state_dict().items()}
seconds = time.time() - t0
cpu_name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?") + f", {os.cpu_count()} cores"

# ---- store: bf16 weights of the best step; the oracle's logits on exactly those ----
mtp.load_state_dict(best_state)
with torch.no_grad():
    for p in mtp.parameters():
        p.copy_(p.bfloat16().float())
    final = {n: evaluate(mtp, n) for n in ("held_text", "held_greedy")}
    mref = oracle(mtp)
print(f"kept step {best_step} (bf16), held-out: {final}", flush=True)
for k, v in header.items():
    if k.startswith("mtp."):
        a, b = v["data_offsets"]
        new = mtp.get(k[4:]).detach().bfloat16().contiguous().view(torch.int16).numpy().tobytes()
        if len(new) != b - a:
            raise SystemExit(f"{k}: {len(new)} bytes, the file holds {b - a}")
        raw[8 + hlen + a:8 + hlen + b] = new
with open(st_path, "wb") as fh:
    fh.write(raw)
mref.float().numpy().astype("<f4").tofile(os.path.join(ref_dir, "mtp_logits.bin"))
top2 = mref.topk(2, -1).values
base_next = F.linear(h64, HEAD.double()).argmax(-1)   # the model's choice for s[p + 2], at p + 1
ref["mtp"] |= {
    "min_margin": float((top2[:, 0] - top2[:, 1]).min()),
    "top1_agreement_with_base_next": float((mref[:-1].argmax(-1) == base_next[1:]).double().mean()),
    "self_checks": {"oracle_base_logits_vs_ref_logits_max_diff": d_base, "oracle_previous_block_vs_its_mtp_logits_max_diff": d_prev},
    "made_by": f"tools/distill_mtp.py with torch {torch.__version__}: a float64 forward written from the formulas, "
               "checked against transformers' ref_logits.bin and the previous block's mtp_logits.bin (self_checks)",
}
ref["mtp"].pop("component_checks", None)
with open(os.path.join(ref_dir, "ref.json"), "w") as fh:
    json.dump(ref, fh, indent=1)
log_path = os.path.join(wdir, "train_log.json")
train_log = json.load(open(log_path))
previous = train_log.get("mtp_distill")
train_log["mtp_distill"] = {
    "from": "the block of the previous mtp_distill run" if previous else "the block of the mtp section",
    "data": {n: len(v[0]) for n, v in sets.items()} | {"window": W, "greedy_prompt": 16},
    "loss": "mean over depths 1 and 2 of the cross-entropy against softmax(lm_head(h_{t+d+1})), the model's own distribution",
    "optimizer": f"AdamW lr {LR} (warm-up {warm} steps, cosine to 10%), betas 0.9/0.95, weight decay 0.1 on matrices, clip 1.0, bf16 autocast",
    "batch": BATCH, "greedy_windows_a_batch": GREEDY, "positions_per_window": S, "steps": step, "best_step": best_step, "seconds": round(seconds, 1),
    "machine": cpu_name, "held_out_before": start, "held_out_after_bf16": final, "log": log,
} | ({"previous": previous} if previous else {})
with open(log_path, "w") as fh:
    json.dump(train_log, fh, indent=1)
print(f"{st_path}: mtp.* rewritten; {ref_dir}: mtp_logits.bin, ref.json; {log_path}: mtp_distill", flush=True)
