"""Writes tests/fixtures/<name>/: tiny random Nemotron-H checkpoints with Hugging Face reference logits.

Runs on the GPU machine (transformers 5.17 has NemotronHForCausalLM natively; the pure-torch path is
used, on the CPU, in float32). For each fixture:
  config.json, *.safetensors (+ index)  the checkpoint, in NVIDIA's layout or transformers' own
  ref.json                              prompt, greedy continuation, tolerance, component checks
  ref_logits.bin                        float32 [rows, vocab]: HF logits at every position of
                                        prompt + continuation[:-1] (what nemoh --dump-logits writes)
Weights are drawn at a trained-like scale and every component is checked to move the logits.
transformers' pure-torch Mamba path clamps dt at time_step_min; production kernels do not, so the
reference is made with the clamp removed, with some dt_bias pushed low so that a clamping engine fails.
"""
import json, math, os, shutil, sys
import torch
from safetensors.torch import save_file
from transformers import NemotronHConfig, NemotronHForCausalLM
from nemotron_h import nvidia_config, set_clamp

torch.set_num_threads(os.cpu_count() or 4)
OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"

FIXTURES = [
    # NVIDIA layout, F32, sharded in two files with an index; n_groups 4, head size 12, GQA 8/2
    dict(name="tiny-f32", store="f32", layout="nvidia", shards=2, vocab=1000, hidden=64,
         pattern="-M*-M*M-*M", heads=8, kv=2, head_dim=16, mlp=160, m_heads=8, m_hdim=12, groups=4,
         state=16, prompt=37, gen=24, seed=1),
    # NVIDIA layout, BF16 matrices with F32 vectors, one file; n_groups 2, head size 10, MQA 4/1
    dict(name="tiny-bf16", store="bf16", layout="nvidia", shards=1, vocab=1200, hidden=80,
         pattern="-M-M*MM*-M", heads=4, kv=1, head_dim=20, mlp=96, m_heads=6, m_hdim=10, groups=2,
         state=8, prompt=29, gen=20, seed=2),
    # transformers' own save_pretrained layout (model.* names, layers_block_type), F16; one group
    dict(name="tiny-hf-f16", store="f16", layout="hf", shards=1, vocab=1024, hidden=48,
         pattern="M-*M*-", heads=6, kv=3, head_dim=8, mlp=64, m_heads=4, m_hdim=6, groups=1,
         state=8, prompt=21, gen=16, seed=3),
]
TOL = {"f32": 1e-4, "bf16": 1e-4, "f16": 1e-4}  # nemoh computes in fp32 on the stored weights, as HF does here


def hf_kwargs(f):
    return dict(
        vocab_size=f["vocab"], hidden_size=f["hidden"], hybrid_override_pattern=f["pattern"],
        num_attention_heads=f["heads"], num_key_value_heads=f["kv"], head_dim=f["head_dim"],
        intermediate_size=f["mlp"], mamba_num_heads=f["m_heads"], mamba_head_dim=f["m_hdim"],
        n_groups=f["groups"], ssm_state_size=f["state"], conv_kernel=4, chunk_size=16,
        layer_norm_epsilon=1e-5, max_position_embeddings=256, use_mamba_kernels=False,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        time_step_min=0.001, time_step_max=0.1)


def init_weights(model, f, g):
    """Trained-like scale: linear std fan_in^-0.5, norms near 1, A in [-16,-1], dt log-uniform."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                dt = torch.exp(math.log(1e-3) + torch.rand(p.shape, generator=g) * math.log(100))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
                p[::3] = -12.0  # dt ~ 6e-6, far under time_step_min: a clamping engine fails here
            elif name.endswith(".D"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "conv1d.weight" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "conv1d.bias" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embeddings" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                raise SystemExit(f"unexpected parameter {name}")


@torch.no_grad()
def full_logits(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def greedy(model, prompt, n):
    """Greedy decoding by full forwards over the growing sequence (no cache involved)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(full_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


@torch.no_grad()
def cached_logits(model, prompt, cont):
    """HF's cached path (prefill, then one step per token), teacher-forced with cont: recorded, for
    information, against the full-forward reference."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    rows = [out.logits[0, -1].float()]
    for t in cont[:-1]:
        out = model(input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def component_checks(model, f, seq, ref):
    """Max |logit change| when one component is removed or perturbed: each must be far above the tolerance."""
    checks = {}
    def delta(fn):
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            fn(dict(model.named_parameters()))
        d = float((full_logits(model, seq) - ref).abs().max())
        model.load_state_dict(saved)
        return d
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    for l, k in enumerate(f["pattern"]):
        out = {"M": "out_proj", "*": "o_proj", "-": "down_proj"}[k]
        checks[f"layer {l} ({kinds[k]}) output"] = delta(lambda P, l=l, out=out: P[f"model.layers.{l}.mixer.{out}.weight"].zero_())
    m = f["pattern"].index("M")
    for part, fn in [("conv1d.bias", lambda t: t.zero_()), ("conv1d.weight", lambda t: t.mul_(0.5)),
                     ("D", lambda t: t.zero_()), ("dt_bias", lambda t: t.add_(1.0)), ("A_log", lambda t: t.add_(1.0)),
                     ("norm.weight", lambda t: t.fill_(1.0))]:
        checks[f"layer {m} mamba {part}"] = delta(lambda P, part=part, fn=fn: fn(P[f"model.layers.{m}.mixer.{part}"]))
    checks["norm_f"] = delta(lambda P: P["model.norm_f.weight"].fill_(1.0))
    set_clamp(model, True)
    checks["dt clamped at time_step_min (must differ)"] = float((full_logits(model, seq) - ref).abs().max())
    set_clamp(model, False)
    return checks


def stored(p, store):
    if store == "f32":
        return p.float()
    if store == "bf16":
        return p.bfloat16() if p.ndim >= 2 else p.float()  # matrices BF16, small vectors F32
    return p.half()


def make(f):
    g = torch.Generator().manual_seed(f["seed"])
    for attempt in range(20):
        model = NemotronHForCausalLM(NemotronHConfig(**hf_kwargs(f))).float().eval()
        init_weights(model, f, g)
        # round to the stored dtype, so the fp32 reference sees exactly the weights nemoh reads
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(stored(p, f["store"]).float())
        set_clamp(model, False)
        prompt = torch.randint(3, f["vocab"], (f["prompt"],), generator=g).tolist()
        cont = greedy(model, prompt, f["gen"])
        seq = prompt + cont[:-1]
        ref = full_logits(model, seq)
        paths = float((ref[len(prompt) - 1:] - cached_logits(model, prompt, cont)).abs().max())
        top2 = ref[len(prompt) - 1:].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        checks = component_checks(model, f, seq, ref)
        weak = [k for k, v in checks.items() if v < (10 if "clamp" in k else 100) * TOL[f["store"]]]
        print(f"{f['name']}: attempt {attempt}: HF cached path differs by {paths:.2e}, margin {margin:.2e}, weak checks {weak}")
        if margin > 2e-3 and 2 not in cont and not weak:
            break
    else:
        raise SystemExit(f"{f['name']}: no usable draw")
    for k, v in checks.items():
        print(f"  {f['name']}: {k}: max |d logits| = {v:.3g}")

    d = os.path.join(OUT, f["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    if f["layout"] == "hf":
        half = NemotronHForCausalLM(NemotronHConfig(**hf_kwargs(f))).half()
        half.load_state_dict({k: v.half() for k, v in model.state_dict().items()})
        half.save_pretrained(d)
    else:
        write_nvidia(model, f, d)
    with open(os.path.join(d, "ref.json"), "w") as fh:
        json.dump({"prompt": prompt, "greedy": cont, "rows": len(seq), "vocab": f["vocab"],
                   "tolerance": TOL[f["store"]], "min_margin": margin, "hf_cached_path_max_diff": paths,
                   "component_checks": checks,
                   "made_by": "tools/make_fixtures.py with transformers " + __import__("transformers").__version__ +
                              ", torch " + torch.__version__ + ", float32 on the CPU, dt clamp removed"}, fh, indent=1)
    ref.numpy().astype("<f4").tofile(os.path.join(d, "ref_logits.bin"))
    for fn, ids in (("prompt.txt", prompt), ("greedy.txt", cont)):  # plain copies for test.sh
        with open(os.path.join(d, fn), "w") as fh:
            fh.write(" ".join(map(str, ids)) + "\n")
    print(f"{f['name']}: {len(prompt)} prompt + {len(cont)} greedy tokens, margin {margin:.3g}")


def write_nvidia(model, f, d):
    """NVIDIA's published layout: backbone.* names, hybrid_override_pattern, attention_head_dim."""
    tensors = {("backbone." + k[len("model."):] if k.startswith("model.") else k): stored(v, f["store"]).contiguous()
               for k, v in model.state_dict().items()}
    names = sorted(tensors)
    if f["shards"] == 1:
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    else:
        half = len(names) // 2
        parts = [names[:half], names[half:]]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": {}}
        for i, part in enumerate(parts):
            fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            save_file({k: tensors[k] for k in part}, os.path.join(d, fn), metadata={"format": "pt"})
            index["weight_map"].update({k: fn for k in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2)
    cfg = nvidia_config(hf_kwargs(f), {"f32": "float32", "bf16": "bfloat16"}[f["store"]])
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)  # Python writes the bare token Infinity, as NVIDIA's files have it


if __name__ == "__main__":
    for f in FIXTURES:
        make(f)
