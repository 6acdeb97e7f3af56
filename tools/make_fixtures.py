"""Writes tests/fixtures/<name>/: tiny random Nemotron-H checkpoints with Hugging Face reference logits.

Runs on the GPU machine (transformers 5.17 has NemotronHForCausalLM natively, mixture-of-experts and
latent MoE layers included; the pure-torch path is used, on the CPU, in float32).

    python3 tools/make_fixtures.py [OUT [NAME ...]]    OUT defaults to tests/fixtures; NAME: fixture
                                                       names or globs (tiny-moe*), default all
For each fixture:
  config.json, *.safetensors (+ index)  the checkpoint: NVIDIA's layout (backbone.*, one tensor per
                                        expert, mtp.* extras), transformers' save_pretrained, or the
                                        module's own state_dict (model.*, experts stacked [E, out, in])
  ref.json                              prompt, greedy continuation, tolerance, component checks
  ref_logits.bin                        float32 [rows, vocab]: HF logits at every position of
                                        prompt + continuation[:-1] (what nemoh --dump-logits writes)
  mtp_logits.bin                        MTP fixtures (tiny-mtp-*) only: float32 [rows, vocab], the same rows;
                                        row p = the MTP block's logits at p, from h_p (the main model's
                                        output after norm_f at p) and token s[p+1], s = prompt + continuation
Weights are drawn at a trained-like scale and every component is checked to move the logits.
MTP fixtures carry a multi-token-prediction block (num_nextn_predict_layers 1; its pattern as
mtp_hybrid_override_pattern "*E", or as the list mtp_layers_block_type ["attention", "mlp"]) under mtp.*
in NVIDIA's layout. transformers has no MTP forward: the oracle (tools/nemotron_h.py) runs transformers'
NemotronH for h, then e = enorm(E[s[p+1]]), u = eh_proj([e ; hnorm(h_p)]), the sublayers as transformers'
NemotronHBlocks with the mtp.layers.{i} weights (attention causal over the MTP positions, no positional
encoding), logits = lm_head(final_layernorm(u)) (the main lm_head, no norm_f). ref.json "mtp" records its
self-checks (the files read back; a float64 plain-torch MTP on the written tensors; causality; h is what
feeds lm_head) and component checks (enorm, hnorm, both eh_proj halves, each sublayer's parts,
final_layernorm each move the MTP logits); its tolerance is "cpu_tolerance".
transformers' pure-torch Mamba path clamps dt at time_step_min; production kernels do not, so the
reference is made with the clamp removed, with some dt_bias pushed low so that a clamping engine fails.
MoE fixtures also avoid near-ties in the router (an engine's rounding must not flip an expert choice)
and record the router's smallest choice margin (over 4e-3 in tiny-mtp-latent-f32, main and MTP routers,
whose router weights are redrawn until it is).

Quantized fixtures (tiny-q-*; python3 tools/make_fixtures.py tests/fixtures 'tiny-q-*'): NVIDIA layout with
chosen matrices in NVIDIA ModelOpt's on-disk form, every other matrix BF16 (vectors F32). FP8 per tensor:
P.weight F8_E4M3 [out, in], P.weight_scale F32 [], P.input_scale F32 []. NVFP4: P.weight U8 [out, in/2]
(element 2j in the low nibble), P.weight_scale F8_E4M3 [out, in/16], P.weight_scale_2 F32 [], and
P.input_scale F32 [] unless W4A16_NVFP4. An FP8 KV cache adds mixer.k_proj.k_scale / v_proj.v_scale.
input_scale, k_scale and v_scale are calibrated by hooks on one forward of the fixture's sequence.
hf_quant_config.json and/or config.json's quantization_config describe them (exclude list, or
MIXED_PRECISION's quantized_layers). The reference runs on the dequantized weights (what a W8A16 / W4A16
engine computes); the directory also holds
  dequant.safetensors                   F32 [out, in] under each quantized weight's name: the dequantized
                                        matrix the reference used, for a bit-exact check of a loader
and ref.json "quantized": {weight name: "FP8" | "NVFP4"}. The written files are read back, dequantized
from their bytes and run again ("reread_max_diff", 0 expected): transformers cannot load ModelOpt files.
"""
import fnmatch, inspect, json, math, os, shutil, sys
import torch
from safetensors import safe_open
from safetensors.torch import save_file
import transformers
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.models.nemotron_h import modeling_nemotron_h as mh
from nemotron_h import (nvidia_config, set_clamp, eager_experts, MTP, MTP_LIST_NAME, gate_inputs, load_mtp,
                        mtp_component_checks, mtp_expected_names, mtp_logits, mtp_nvidia_tensors, mtp_self_checks,
                        router_gap)

torch.set_num_threads(os.cpu_count() or 4)
OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
ONLY = sys.argv[2:]

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
    # Nemotron 3 mixture of experts. Every size divides by 4 where tensor parallelism splits it (--tp 2, 4).
    # NVIDIA layout, BF16, two files: an MoE first layer, 12 experts top-3 chosen in 1 of 2 groups, a shared
    # expert, norm_topk_prob, scaling 2.5; one tensor per expert; mtp.* tensors an engine must skip
    dict(name="tiny-moe-bf16", store="bf16", layout="nvidia", shards=2, vocab=400, hidden=48,
         pattern="E-M*EME", heads=4, kv=2, head_dim=12, mlp=64, m_heads=8, m_hdim=8, groups=4, state=8,
         experts=12, top_k=3, n_group=2, topk_group=1, moe=20, shared=36, latent=None, norm_topk=True,
         scale=2.5, mtp=True, prompt=31, gen=20, seed=11),
    # transformers' save_pretrained, F16: 10 experts top-4, no grouping, weights not normalised, scaling 1.5
    dict(name="tiny-moe-hf-f16", store="f16", layout="hf", shards=1, vocab=320, hidden=40,
         pattern="ME*E-E", heads=4, kv=1, head_dim=10, mlp=48, m_heads=4, m_hdim=10, groups=4, state=8,
         experts=10, top_k=4, n_group=1, topk_group=1, moe=12, shared=24, latent=None, norm_topk=False,
         scale=1.5, prompt=23, gen=16, seed=12),
    # latent MoE (as Nemotron 3 Super), F32, the module's own stacked layout under model.*: experts work on
    # a 24-wide latent; 16 experts top-5 chosen in 2 of 4 groups, scaling 5.0
    dict(name="tiny-moe-latent-f32", store="f32", layout="stacked", shards=1, vocab=256, hidden=64,
         pattern="MEM*E-E", heads=8, kv=2, head_dim=8, mlp=32, m_heads=8, m_hdim=8, groups=4, state=8,
         experts=16, top_k=5, n_group=4, topk_group=2, moe=16, shared=28, latent=24, norm_topk=True,
         scale=5.0, prompt=27, gen=18, seed=13),
    # ModelOpt-quantized, NVIDIA layout, BF16 elsewhere. quant: algo (quant_algo), kv ("FP8": k/v scales), files
    # ("hf": hf_quant_config.json, "config": config.json's quantization_config, "both"), rules (module fnmatch
    # pattern -> format, first match wins, none = BF16), exclude (fnmatch patterns; default: every unquantized
    # projection, lm_head and conv1d by exact name). Every quantized K divides by 16, a row-parallel one's by 32
    # (--tp 2 keeps 16-element blocks whole).
    # Nemotron-3-Nano-like NVFP4 (W4A4: input_scale), hf_quant_config.json only: experts and shared experts,
    # Mamba layers 0 and 5 NVFP4; Mamba layer 2 (feeding attention), attention, lm_head, conv1d BF16, excluded
    dict(name="tiny-q-nvfp4-moe", store="bf16", layout="nvidia", shards=1, vocab=256, hidden=48,
         pattern="MEM*EME", heads=4, kv=2, head_dim=16, mlp=64, m_heads=8, m_hdim=8, groups=2, state=16,
         experts=8, top_k=2, n_group=1, topk_group=1, moe=32, shared=32, latent=None, norm_topk=True,
         scale=2.5, prompt=29, gen=18, seed=21,
         quant=dict(algo="NVFP4", kv="FP8", files="hf", rules=[("*.mixer.experts.*", "NVFP4"),
                    ("*.mixer.shared_experts.*", "NVFP4"), ("backbone.layers.[05].mixer.*_proj", "NVFP4")])),
    # Nemotron-3-Super-like MIXED_PRECISION in config.json only (ignore: []): routed experts NVFP4, shared
    # experts FP8, Mamba layer 0 in/out_proj and layer 2 out_proj FP8 (layer 5 BF16), layer 1's fc1_latent_proj
    # FP8, o_proj FP8; two files: every matrix in the first, every scale and vector in the second
    dict(name="tiny-q-mixed-latent", store="bf16", layout="nvidia", shards=2, vocab=256, hidden=64,
         pattern="MEM*EME", heads=8, kv=2, head_dim=8, mlp=32, m_heads=8, m_hdim=8, groups=4, state=8,
         experts=12, top_k=3, n_group=4, topk_group=2, moe=32, shared=32, latent=32, norm_topk=True,
         scale=5.0, prompt=16, gen=10, seed=22,
         quant=dict(algo="MIXED_PRECISION", kv="FP8", files="config", exclude=[], rules=[
                    ("*.mixer.experts.*", "NVFP4"), ("*.mixer.shared_experts.*", "FP8"),
                    ("backbone.layers.0.mixer.*_proj", "FP8"), ("backbone.layers.2.mixer.out_proj", "FP8"),
                    ("backbone.layers.1.mixer.fc1_latent_proj", "FP8"), ("*.mixer.o_proj", "FP8")])),
    # Nemotron-H-like dense FP8 (W8A8 files), both config forms: every Mamba, attention and MLP projection FP8
    dict(name="tiny-q-fp8", store="bf16", layout="nvidia", shards=1, vocab=320, hidden=64,
         pattern="M-M*-M-", heads=4, kv=2, head_dim=16, mlp=96, m_heads=8, m_hdim=8, groups=2, state=16,
         prompt=31, gen=20, seed=23,
         quant=dict(algo="FP8", kv="FP8", files="both", exclude=["lm_head", "backbone.layers.*.mixer.conv1d"],
                    rules=[("*.mixer.*_proj", "FP8")])),
    # dense W4A16_NVFP4 (no input_scale, no KV scales): every projection, lm_head and the embedding table NVFP4
    dict(name="tiny-q-w4a16", store="bf16", layout="nvidia", shards=1, vocab=256, hidden=64,
         pattern="M-M*-M", heads=4, kv=2, head_dim=16, mlp=64, m_heads=8, m_hdim=8, groups=2, state=8,
         prompt=27, gen=18, seed=24,
         quant=dict(algo="W4A16_NVFP4", kv=None, files="hf", exclude=["*.conv1d"], rules=[
                    ("*_proj", "NVFP4"), ("lm_head", "NVFP4"), ("backbone.embeddings", "NVFP4")])),
    # multi-token prediction (MTP; mtp_logits.bin is the block's oracle). NVIDIA layout, F32, Nemotron-3-Super-like:
    # latent MoE (16 experts top-4, no groups, a 32-wide latent, scaling 5.0), main layers M, *, E and -; one MTP
    # block, mtp_hybrid_override_pattern "*E": an attention sublayer, then a latent-MoE sublayer (fc1/fc2_latent_proj,
    # one tensor per expert, as the main 'E' layers). Every router, main and MTP, keeps its choices 4e-3 apart
    # over the positions used (rmargin), so bf16 GPU products cannot flip an expert
    dict(name="tiny-mtp-latent-f32", store="f32", layout="nvidia", shards=1, vocab=256, hidden=64,
         pattern="MEM*E-", heads=8, kv=4, head_dim=8, mlp=32, m_heads=8, m_hdim=8, groups=4, state=8,
         experts=16, top_k=4, n_group=1, topk_group=1, moe=16, shared=32, latent=32, norm_topk=True,
         scale=5.0, mtp_ref="*E", rmargin=4e-3, prompt=23, gen=16, seed=31),
    # dense MTP, NVIDIA layout, F32: main layers M, * and -; the MTP block given in the list form
    # mtp_layers_block_type ["attention", "mlp"] (no mtp_hybrid_override_pattern key); vocab 1200, so that the chat
    # fixtures' tokenizer fits it (test.sh chats with it)
    dict(name="tiny-mtp-f32", store="f32", layout="nvidia", shards=1, vocab=1200, hidden=48,
         pattern="M*-M-M-", heads=8, kv=4, head_dim=8, mlp=64, m_heads=8, m_hdim=8, groups=4, state=16,
         mtp_ref="*-", mtp_list=True, prompt=27, gen=18, seed=32),
]
TOL = {"f32": 1e-4, "bf16": 1e-4, "f16": 1e-4}  # nemoh computes in fp32 on the stored weights, as HF does here


def hf_kwargs(f):
    moe = dict(n_routed_experts=f["experts"], num_experts_per_tok=f["top_k"], n_group=f["n_group"],
               topk_group=f["topk_group"], moe_intermediate_size=f["moe"], n_shared_experts=1,
               moe_shared_expert_intermediate_size=f["shared"], moe_latent_size=f["latent"],
               norm_topk_prob=f["norm_topk"], routed_scaling_factor=f["scale"]) if "experts" in f else {}
    return moe | dict(
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
            elif p.ndim == 2 or ".experts." in name:  # routed experts: [E, out, in], fan_in the last dim
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                raise SystemExit(f"unexpected parameter {name}")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # positive, so sigmoid + bias > 0 everywhere and an implementation that fills the
                # unchosen groups with 0 instead of -inf chooses the same; large enough to change choices
                b.copy_(0.3 * torch.rand(b.shape, generator=g))


def moe_mixers(model):
    return [layer.mixer for layer in model.model.layers if isinstance(layer.mixer, mh.NemotronHMoE)]


def check_moe_support():
    """Stops unless this transformers builds NemotronH MoE and latent-MoE layers; prints their routing code."""
    f = next(f for f in FIXTURES if f.get("latent"))
    model = NemotronHForCausalLM(NemotronHConfig(**hf_kwargs(f)))
    mixers = moe_mixers(model) if hasattr(mh, "NemotronHMoE") else []
    lat = mixers and isinstance(mixers[0].fc1_latent_proj, torch.nn.Linear) and mixers[0].fc1_latent_proj.out_features == f["latent"]
    if len(mixers) != f["pattern"].count("E") or not lat:
        raise SystemExit(f"transformers {transformers.__version__}: NemotronHForCausalLM does not implement "
                         f"{'latent ' if mixers else ''}mixture-of-experts layers (NemotronHMoE with fc1_latent_proj); stop")
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    m = f["pattern"].index("E")
    want = [f"model.layers.{m}.mixer.{k}" for k in ("gate.weight", "gate.e_score_correction_bias", "experts.up_proj",
            "experts.down_proj", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
            "fc1_latent_proj.weight", "fc2_latent_proj.weight")]
    if any(w not in names for w in want):
        raise SystemExit(f"unexpected MoE parameter names: want {want}, have {sorted(n for n in names if f'layers.{m}.' in n)}")
    print(f"transformers {transformers.__version__} implements MoE and latent MoE: "
          f"{type(mixers[0]).__name__}, router {type(mixers[0].gate).__name__}, experts {type(mixers[0].experts).__name__}")
    for cls in {type(mixers[0]), type(mixers[0].gate), *type(mixers[0].gate).__mro__[1:-2]}:
        try:
            print(f"---- {cls.__name__} ({inspect.getsourcefile(cls)})\n{inspect.getsource(cls)}")
        except (OSError, TypeError) as e:
            print(f"---- {cls.__name__}: no source ({e})")


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


@torch.no_grad()
def router_margin(model, f, seq):
    """Smallest gap, over every MoE layer and position, between the last chosen and the first unchosen
    candidate of each choice the router makes (groups, then experts): sigmoid(x W^T) + bias, as
    transformers chooses; an engine's rounding flips a choice only when it errs by more than this."""
    caps = []
    hooks = [mx.gate.register_forward_pre_hook(lambda mod, a: caps.append((mod, a[0].reshape(-1, a[0].shape[-1]).float())))
             for mx in moe_mixers(model)]
    full_logits(model, seq)
    for h in hooks:
        h.remove()
    return min([router_gap(gate.weight, gate.e_score_correction_bias, x, f["n_group"], f["topk_group"], f["top_k"])
                for gate, x in caps], default=math.inf)


@torch.no_grad()
def widen_routers(gates, run, f, g, want, tries=5000):
    """Redraws each router (weight and e_score_correction_bias, at init_weights' scale) in forward order until
    its choice margin over the rows run() feeds it is over want: a router's input depends only on what runs
    before it, so each stays widened once the next is drawn. Returns how many draws it took."""
    draws = 0
    for gate in gates:
        x = gate_inputs(gate, run)
        for _ in range(tries):
            if router_gap(gate.weight, gate.e_score_correction_bias, x, f["n_group"], f["topk_group"], f["top_k"]) > want:
                break
            gate.weight.copy_(stored(torch.randn(gate.weight.shape, generator=g) / math.sqrt(gate.weight.shape[-1]), f["store"]).float())
            b = gate.e_score_correction_bias
            b.copy_(stored(0.3 * torch.rand(b.shape, generator=g), f["store"]).float())
            draws += 1
        else:
            raise SystemExit(f"{f['name']}: no router draw in {tries} keeps a choice margin over {want}")
    return draws


def make_mtp(model, f, g, s):
    """The fixture's MTP block, drawn at a trained-like scale (init_weights) for the main model as drawn: its
    routers widened to f["rmargin"] over the positions of s, redrawn until every component moves its logits.
    Returns (mtp, oracle logits [len(s) - 1, vocab], component checks, router margin)."""
    kw, tol = hf_kwargs(f), TOL[f["store"]]
    for attempt in range(30):
        mtp = MTP(kw, f["mtp_ref"]).float().eval()
        init_weights(mtp, f, g)
        with torch.no_grad():
            for p in list(mtp.parameters()) + list(mtp.buffers()):
                p.copy_(stored(p, f["store"]).float())
        gates = [b.mixer.gate for b in mtp.layers if isinstance(b.mixer, mh.NemotronHMoE)]
        widen_routers(gates, lambda: mtp_logits(model, mtp, s), f, g, f.get("rmargin", 4e-3))
        rm = min([router_gap(gt.weight, gt.e_score_correction_bias, gate_inputs(gt, lambda: mtp_logits(model, mtp, s)),
                             f["n_group"], f["topk_group"], f["top_k"]) for gt in gates], default=math.inf)
        ref = mtp_logits(model, mtp, s)
        checks = mtp_component_checks(model, mtp, s, ref)
        weak = [k for k, v in checks.items() if v < 100 * tol]
        print(f"{f['name']}: MTP {f['mtp_ref']!r} attempt {attempt}: router margin {rm:.2e}, weak checks {weak}")
        if not weak:
            return mtp, ref, checks, rm
    raise SystemExit(f"{f['name']}: no usable MTP draw")


def component_checks(model, f, seq, ref):
    """Max |logit change| when one component is removed or perturbed: each must be far above the tolerance."""
    checks = {}
    def delta(fn):
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            fn(dict(model.named_parameters()) | dict(model.named_buffers()))
        d = float((full_logits(model, seq) - ref).abs().max())
        model.load_state_dict(saved)
        return d
    def delta_attr(attr, fn):
        """The MoE layers run with one routing setting changed (on the config, the MoE modules and their
        routers: wherever this transformers reads it)."""
        objs = [model.config] + [o for mx in moe_mixers(model) for o in (mx, mx.gate)]
        saved = [(o, getattr(o, attr)) for o in objs if hasattr(o, attr)]
        if not saved:
            raise SystemExit(f"no MoE module or router has the attribute {attr}")
        for o, v in saved:
            setattr(o, attr, fn(v))
        d = float((full_logits(model, seq) - ref).abs().max())
        for o, v in saved:
            setattr(o, attr, v)
        return d
    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    for l, k in enumerate(f["pattern"]):
        outs = {"M": ["out_proj.weight"], "*": ["o_proj.weight"], "-": ["down_proj.weight"],
                "E": ["experts.down_proj", "shared_experts.down_proj.weight"]}[k]
        checks[f"layer {l} ({kinds[k]}) output"] = delta(lambda P, l=l, outs=outs: [P[f"model.layers.{l}.mixer.{o}"].zero_() for o in outs])
    if "E" in f["pattern"]:
        e = f["pattern"].index("E")
        parts = [("gate.weight", lambda t: t.mul_(0.5)), ("gate.e_score_correction_bias", lambda t: t.zero_()),
                 ("experts.up_proj", lambda t: t[:, :, : t.shape[2] // 2].zero_()), ("experts.down_proj", lambda t: t.zero_()),
                 ("shared_experts.up_proj.weight", lambda t: t.mul_(0.5)), ("shared_experts.down_proj.weight", lambda t: t.zero_())]
        if f["latent"]:
            parts += [("fc1_latent_proj.weight", lambda t: t.mul_(0.5)), ("fc2_latent_proj.weight", lambda t: t.mul_(0.5))]
        for part, fn in parts:
            checks[f"layer {e} moe {part}"] = delta(lambda P, part=part, fn=fn: fn(P[f"model.layers.{e}.mixer.{part}"]))
        checks["moe norm_topk_prob flipped"] = delta_attr("norm_topk_prob", lambda v: not v)
        checks["moe routed_scaling_factor doubled"] = delta_attr("routed_scaling_factor", lambda v: 2 * v)
        if f["n_group"] > 1:
            checks["moe topk_group = n_group (no group rule)"] = delta_attr("topk_group", lambda v: f["n_group"])
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


# ---- ModelOpt quantization (ports of its FP8 amax/448 rule and NVFP4QTensor; see the docstring) ----
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
E2M1 = torch.cat([E2M1, -E2M1])  # by 4-bit code: bit 3 the sign (code 8 = -0.0)
E2M1_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # midpoints between magnitudes 0..6


def quantize_fp8(W):
    """FP8 per tensor: {weight F8_E4M3 [out, in], weight_scale F32 []}."""
    s = W.abs().max() / 448
    return {"weight": (W / s).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale": s}


def quantize_nvfp4(W):
    """NVFP4, blocks of 16 along in: {weight U8 [out, in/2] (element 2j low nibble), weight_scale F8_E4M3
    [out, in/16], weight_scale_2 F32 []}. Codes round to the nearest E2M1 value, ties to the even code."""
    N, K = W.shape
    s2 = W.abs().max() / (6 * 448)
    blocks = W.view(N, K // 16, 16)
    amax = blocks.abs().amax(-1)
    bs = (amax / (6 * s2)).clamp(2 ** -9, 448).masked_fill(amax == 0, 1.0).to(torch.float8_e4m3fn)
    x = blocks / (bs.float() * s2)[..., None]
    a = x.abs()
    mag = torch.searchsorted(E2M1_TIES, a) + torch.isin(a, E2M1_TIES[1::2])  # a tie at an odd bound goes up
    q = (mag.clamp(max=7) + 8 * (x < 0)).to(torch.uint8).view(N, K)
    return {"weight": (q[:, 1::2] << 4) | q[:, 0::2], "weight_scale": bs, "weight_scale_2": s2}


def dequant(t):
    """The fp32 matrix [out, in] of a module's stored tensors, in ModelOpt's order: FP8 weight * weight_scale;
    NVFP4 e2m1(code) * (f32(weight_scale) * weight_scale_2), each product one fp32 rounding."""
    w = t["weight"]
    if w.dtype == torch.float8_e4m3fn:
        return w.float() * t["weight_scale"]
    codes = torch.stack([w & 15, w >> 4], -1).view(len(w), -1).long()
    s = t["weight_scale"].float() * t["weight_scale_2"]
    return (E2M1[codes].view(len(w), -1, 16) * s[..., None]).view(len(w), -1)


def nvidia_name(k):
    return "backbone." + k[len("model."):] if k.startswith("model.") else k


def modules(model):
    """Every matrix by its NVIDIA module name (backbone.layers.3.mixer.in_proj; a routed expert's
    backbone.layers.1.mixer.experts.5.up_proj): (parameter, expert index or None). conv1d (3-D) included."""
    out = {}
    for k, p in model.named_parameters():
        k = nvidia_name(k)
        if ".mixer.experts." in k:  # stacked [E, out, in]
            base, proj = k.rsplit(".", 1)
            out.update({f"{base}.{e}.{proj}": (p, e) for e in range(len(p))})
        elif k.endswith(".weight") and p.ndim >= 2:
            out[k[:-len(".weight")]] = (p, None)
    return out


def quant_format(f, m):
    """The one place that decides module m's format in fixture f: "FP8", "NVFP4" or None (BF16)."""
    return next((fmt for pat, fmt in f["quant"]["rules"] if fnmatch.fnmatchcase(m, pat)), None)


@torch.no_grad()
def quantize_model(model, f):
    """Quantizes every module quant_format chooses and puts the dequantized matrix in its place, so the model
    computes the reference on what an engine dequantizes. Returns {module: (format, stored tensors, dequant)}."""
    out = {}
    for m, (p, e) in modules(model).items():
        fmt = quant_format(f, m)
        if not fmt:
            continue
        W = p if e is None else p[e]
        row = m.endswith(("out_proj", "o_proj", "down_proj", "fc2_latent_proj"))  # split along in by --tp
        if W.ndim != 2 or W.shape[1] % (32 if row else 16):
            raise SystemExit(f"{f['name']}: {m} {list(W.shape)} cannot be quantized in 16-element blocks")
        t = (quantize_fp8 if fmt == "FP8" else quantize_nvfp4)(W.float().contiguous())
        deq = dequant(t)
        W.copy_(deq)
        out[m] = (fmt, t, deq)
    return out


@torch.no_grad()
def calibrate(model, f, seq, quant):
    """Activation scales by hooks on one forward of seq: each quantized module's input_scale (amax of its input
    / 448 for FP8, / (6*448) for NVFP4; a routed expert sees the tokens routed to it, one that saw none the
    largest of its layer's experts, as ModelOpt does) unless W4A16, and for an FP8 KV cache each attention
    layer's k_scale / v_scale (amax of the k_proj / v_proj output / 448). Returns {tensor name: F32 []}."""
    amax, hooks = {}, []
    def keep(name, t):
        if t.numel():
            amax[name] = max(amax.get(name, 0.0), float(t.abs().max()))
    def experts_hook(base):
        def hook(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            act = getattr(mod, "act_fn", lambda t: torch.relu(t) ** 2)
            for e in range(mod.up_proj.shape[0]):
                xe = x[(idx == e).any(-1)]
                keep(f"{base}.{e}.up_proj", xe)
                keep(f"{base}.{e}.down_proj", act(torch.nn.functional.linear(xe, mod.up_proj[e])))
        return hook
    kv = f["quant"]["kv"] == "FP8"
    for name, mod in model.named_modules():
        m = nvidia_name(name)
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda mod, a, m=m: keep(m, a[0])))
        if m.endswith(".mixer.experts"):
            hooks.append(mod.register_forward_pre_hook(experts_hook(m), with_kwargs=True))
        if kv and m.endswith((".k_proj", ".v_proj")):
            hooks.append(mod.register_forward_hook(lambda mod, a, out, m=m: keep(f"{m}.{m[-6]}_scale", out)))
    full_logits(model, seq)
    for h in hooks:
        h.remove()
    scales = {k: torch.tensor(v / 448, dtype=torch.float32) for k, v in amax.items() if k.endswith(("k_scale", "v_scale"))}
    if f["quant"]["algo"] != "W4A16_NVFP4":
        for m, (fmt, _, _) in quant.items():
            if m == "backbone.embeddings":
                continue  # a table look-up has no input to scale
            if m not in amax and ".mixer.experts." in m:
                base, _, proj = m.rsplit(".", 2)
                amax[m] = max(v for k, v in amax.items() if k.startswith(base + ".") and k.endswith("." + proj))
            if m not in amax:
                raise SystemExit(f"{f['name']}: no forward hook saw the input of {m}")
            scales[f"{m}.input_scale"] = torch.tensor(amax[m] / (448 if fmt == "FP8" else 6 * 448), dtype=torch.float32)
    return scales


def quant_configs(model, f, quant):
    """ModelOpt's two descriptions of the quantization: hf_quant_config.json, and config.json's
    quantization_config. The exclude list is checked against what is quantized (not for MIXED_PRECISION,
    where a module absent from quantized_layers is unquantized); like NVIDIA's it omits routers and embeddings."""
    q, mods = f["quant"], modules(model)
    mixed = q["algo"] == "MIXED_PRECISION"
    quiet = lambda m: m.endswith(".mixer.gate") or m == "backbone.embeddings"
    exclude = q.get("exclude", [m for m in mods if m not in quant and not quiet(m)])
    for m in mods if not mixed else []:
        hit = any(fnmatch.fnmatchcase(m, p) for p in exclude)
        if (hit and m in quant) or (not hit and m not in quant and not quiet(m)):
            raise SystemExit(f"{f['name']}: exclude list {exclude} disagrees with {m}: {quant.get(m, ['BF16'])[0]}")
    layers = {m: {"quant_algo": fmt} | ({"group_size": 16} if fmt == "NVFP4" else {}) for m, (fmt, _, _) in quant.items()}
    producer = {"name": "modelopt", "version": "0.29.0"}
    hf = {"quant_algo": q["algo"], "kv_cache_quant_algo": q["kv"]} | ({"group_size": 16} if "NVFP4" in q["algo"] else {})
    hf |= {"exclude_modules": exclude} | ({"quantized_layers": layers} if mixed else {})
    cfg = {"quant_method": "modelopt", "quant_algo": q["algo"], "ignore": exclude}
    cfg |= ({"kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}} if q["kv"] == "FP8" else {})
    cfg |= ({"quantized_layers": layers} if mixed else {}) | {"producer": producer}
    return {"producer": producer, "quantization": hf}, cfg


@torch.no_grad()
def reread_diff(d, f, seq, ref):
    """Reads the written checkpoint back as an engine would (the index's files or model.safetensors; each
    matrix's format from its dtype), dequantizes it from the bytes (bit for bit what dequant.safetensors
    holds), loads it into a fresh model and returns max |logits - reference| (transformers itself cannot
    load ModelOpt files)."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    T, sd, experts = {}, {}, {}
    for fn in files:
        with safe_open(os.path.join(d, fn), "pt") as fh:
            T.update({k: fh.get_tensor(k) for k in fh.keys()})
    with safe_open(os.path.join(d, "dequant.safetensors"), "pt") as fh:
        want = {k: fh.get_tensor(k) for k in fh.keys()}
    fmts = {torch.uint8: "NVFP4", torch.float8_e4m3fn: "FP8"}
    for k, v in T.items():
        if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")):
            continue
        if v.dtype in fmts:
            m = k[:-len(".weight")]
            v = dequant({s: T[f"{m}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2") if f"{m}.{s}" in T})
            if fmts[T[k].dtype] != quant_format(f, m) or k not in want or not torch.equal(v.view(torch.int32), want[k].view(torch.int32)):
                raise SystemExit(f"{f['name']}: {k} read back is not the {quant_format(f, m)} matrix of dequant.safetensors")
            want.pop(k)
        k = "model." + k[len("backbone."):] if k.startswith("backbone.") else k
        if ".mixer.experts." in k:  # model.layers.L.mixer.experts.E.up_proj.weight: stack the experts again
            base, e, proj, _ = k.rsplit(".", 3)
            experts.setdefault(f"{base}.{proj}", {})[int(e)] = v.float()
        else:
            sd[k] = v.float()
    if want:
        raise SystemExit(f"{f['name']}: quantized tensors missing from the checkpoint: {sorted(want)}")
    sd |= {k: torch.stack([v[e] for e in range(len(v))]) for k, v in experts.items()}
    m = eager_experts(NemotronHForCausalLM(NemotronHConfig(**hf_kwargs(f))).float().eval())
    m.load_state_dict(sd)
    set_clamp(m, False)
    return float((full_logits(m, seq) - ref).abs().max())


def make(f):
    g = torch.Generator().manual_seed(f["seed"])
    for attempt in range(60 if "quant" in f else 30):
        model = eager_experts(NemotronHForCausalLM(NemotronHConfig(**hf_kwargs(f))).float().eval())
        init_weights(model, f, g)
        # round to the stored dtype, so the fp32 reference sees exactly the weights nemoh reads
        with torch.no_grad():
            for p in list(model.parameters()) + list(model.buffers()):
                p.copy_(stored(p, f["store"]).float())
        quant = quantize_model(model, f) if "quant" in f else {}  # the model then holds the dequantized matrices
        set_clamp(model, False)
        prompt = torch.randint(3, f["vocab"], (f["prompt"],), generator=g).tolist()
        cont = greedy(model, prompt, f["gen"])
        if f.get("rmargin") and "E" in f["pattern"]:
            # widen the routers over the positions used; a redraw can change the continuation, so again
            for _ in range(8):
                widen_routers([mx.gate for mx in moe_mixers(model)], lambda: full_logits(model, prompt + cont[:-1]),
                              f, g, f["rmargin"])
                new = greedy(model, prompt, f["gen"])
                if new == cont:
                    break
                cont = new
        seq = prompt + cont[:-1]
        ref = full_logits(model, seq)
        paths = float((ref[len(prompt) - 1:] - cached_logits(model, prompt, cont)).abs().max())
        top2 = ref[len(prompt) - 1:].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        checks = component_checks(model, f, seq, ref)
        weak = [k for k, v in checks.items() if v < (10 if "clamp" in k else 100) * TOL[f["store"]]]
        rmargin = router_margin(model, f, seq) if "E" in f["pattern"] else math.inf
        print(f"{f['name']}: attempt {attempt}: HF cached path differs by {paths:.2e}, margin {margin:.2e}, "
              f"router margin {rmargin:.2e}, weak checks {weak}")
        # a quantized model's prompt runs on the GPU with bf16 operands: its router choices need more room
        # (margins of 1.5e-4 and 1.5e-3 each flipped one there, moving logits by 1.86 and 0.88)
        if margin > 2e-3 and rmargin > f.get("rmargin", 4e-3 if quant else 2e-5) and 2 not in cont and not weak:
            break
    else:
        raise SystemExit(f"{f['name']}: no usable draw")
    for k, v in checks.items():
        print(f"  {f['name']}: {k}: max |d logits| = {v:.3g}")
    scales = calibrate(model, f, seq, quant) if quant else {}
    if f.get("mtp_ref"):  # s = prompt + cont; row p from h_p and s[p + 1]: len(seq) rows, as ref_logits.bin
        mtp, mref, mchecks, mrmargin = make_mtp(model, f, g, prompt + cont)
        for k, v in mchecks.items():
            print(f"  {f['name']}: {k}: max |d MTP logits| = {v:.3g}")

    d = os.path.join(OUT, f["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    if f["layout"] == "hf":
        half = NemotronHForCausalLM(NemotronHConfig(**hf_kwargs(f))).half()
        half.load_state_dict({k: v.half() for k, v in model.state_dict().items()})
        half.save_pretrained(d)
    elif f["layout"] == "stacked":
        save_file({k: stored(v, f["store"]).contiguous() for k, v in model.state_dict().items()},
                  os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        NemotronHConfig(**hf_kwargs(f)).save_pretrained(d)  # transformers' config.json (layers_block_type)
    else:
        write_nvidia(model, f, d, g, quant, scales, mtp_nvidia_tensors(mtp) if f.get("mtp_ref") else None)
    extra = {}
    if "E" in f["pattern"] and not quant:
        extra = {"router_min_margin": rmargin, "experts_on_disk": experts_on_disk(d),
                 "hf_from_pretrained_max_diff": reload_diff(d, seq, ref)}
        print(f"{f['name']}: experts stored {extra['experts_on_disk']}, transformers' from_pretrained of it "
              f"reproduces the reference logits within {extra['hf_from_pretrained_max_diff']}")
    elif f.get("mtp_ref"):
        extra = {"hf_from_pretrained_max_diff": reload_diff(d, seq, ref)}
    elif quant:
        extra = ({"router_min_margin": rmargin, "experts_on_disk": experts_on_disk(d)} if "E" in f["pattern"] else {}) | {
            "quant_algo": f["quant"]["algo"], "quantized": {m + ".weight": fmt for m, (fmt, _, _) in quant.items()},
            "reread_max_diff": reread_diff(d, f, seq, ref)}
        print(f"{f['name']}: {len(quant)} matrices quantized ({', '.join(sorted({v[0] for v in quant.values()}))}); "
              f"the files read back and dequantized reproduce the reference logits within {extra['reread_max_diff']}")
        if extra["reread_max_diff"] > 0.1 * TOL[f["store"]]:
            raise SystemExit(f"{f['name']}: the written files do not hold what the reference ran")
    if f.get("mtp_ref"):
        extra["mtp"] = mtp_entry(model, mtp, f, d, prompt + cont, mref, mchecks, mrmargin)
        mref.numpy().astype("<f4").tofile(os.path.join(d, "mtp_logits.bin"))
    with open(os.path.join(d, "ref.json"), "w") as fh:
        json.dump({"prompt": prompt, "greedy": cont, "rows": len(seq), "vocab": f["vocab"],
                   "tolerance": TOL[f["store"]], "min_margin": margin, "hf_cached_path_max_diff": paths,
                   "component_checks": checks, **extra,
                   "made_by": "tools/make_fixtures.py with transformers " + __import__("transformers").__version__ +
                              ", torch " + torch.__version__ + ", float32 on the CPU, dt clamp removed" +
                              (", on the dequantized weights" if quant else "")}, fh, indent=1)
    ref.numpy().astype("<f4").tofile(os.path.join(d, "ref_logits.bin"))
    for fn, ids in (("prompt.txt", prompt), ("greedy.txt", cont)):  # plain copies for test.sh
        with open(os.path.join(d, fn), "w") as fh:
            fh.write(" ".join(map(str, ids)) + "\n")
    size = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
    print(f"{f['name']}: {len(prompt)} prompt + {len(cont)} greedy tokens, margin {margin:.3g}, {size} bytes")
    if ("E" in f["pattern"] or quant or f.get("mtp_ref")) and size > 3 << 19:
        raise SystemExit(f"{f['name']}: {size} bytes, over the 1.5 MiB a fixture may take")


def read_checkpoint(d):
    """Every tensor of the checkpoint written in d (the index's files, or model.safetensors), as stored."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    T = {}
    for fn in files:
        with safe_open(os.path.join(d, fn), "pt") as fh:
            T.update({k: fh.get_tensor(k) for k in fh.keys()})
    return T


def mtp_entry(model, mtp, f, d, s, mref, mchecks, mrmargin):
    """ref.json's "mtp": the oracle's self-checks, run on the files as written (the MTP block loaded back from
    them must give mtp_logits.bin exactly; a float64 plain-torch MTP on their tensors must agree), and the
    component checks. "cpu_tolerance", not "tolerance": test.sh reads the first "tolerance" of ref.json."""
    T, kw, tol = read_checkpoint(d), hf_kwargs(f), TOL[f["store"]]
    cfg = json.load(open(os.path.join(d, "config.json")))
    key = "mtp_layers_block_type" if f.get("mtp_list") else "mtp_hybrid_override_pattern"
    if cfg.get("num_nextn_predict_layers") != 1 or key not in cfg:
        raise SystemExit(f"{f['name']}: config.json lacks num_nextn_predict_layers / {key}")
    back = load_mtp(kw, f["mtp_ref"], T)
    checks = {"files_reread_max_diff": float((mtp_logits(model, back, s) - mref).abs().max())}
    print(f"  MTP oracle: files_reread_max_diff = {checks['files_reread_max_diff']:.3g}")
    if checks["files_reread_max_diff"] != 0:
        raise SystemExit(f"{f['name']}: the MTP block read back from the files does not give the oracle's logits")
    checks |= mtp_self_checks(model, mtp, s, mref, T, kw, tol)
    top2 = mref.topk(2, dim=-1).values
    return {"pattern": f["mtp_ref"], "config_key": key, "config_value": cfg[key], "rows": len(s) - 1,
            "file": "mtp_logits.bin", "cpu_tolerance": tol,
            "row": "p = 0..rows-1: lm_head(MTP(E[s[p+1]], h_p)), h_p the main model's output after norm_f at p, "
                   "s = prompt + greedy",
            "min_margin": float((top2[:, 0] - top2[:, 1]).min()),
            **({"router_min_margin": mrmargin} if "E" in f["mtp_ref"] else {}),
            "self_checks": checks, "component_checks": mchecks}


def experts_on_disk(d):
    """How the written checkpoint stores routed experts: "per-expert" tensors or "stacked" [E, out, in]."""
    names = []
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors") and fn != "dequant.safetensors":
            with safe_open(os.path.join(d, fn), "pt") as fh:
                names += [n for n in fh.keys() if ".mixer.experts." in n and not n.startswith("mtp.")]
    return "stacked" if any(n.endswith("experts.up_proj") for n in names) else "per-expert" if names else "none"


def reload_diff(d, seq, ref):
    """transformers' own from_pretrained of the written directory, against the reference logits: the
    checkpoint holds what the reference ran (None, with a warning, if transformers cannot load it)."""
    try:
        m = NemotronHForCausalLM.from_pretrained(d, dtype=torch.float32, use_mamba_kernels=False).eval()
        set_clamp(eager_experts(m), False)
        return float((full_logits(m, seq) - ref).abs().max())
    except Exception as e:  # recorded, not fatal: nemoh's reference is the in-memory model above
        print(f"WARNING: from_pretrained({d}) failed: {type(e).__name__}: {e}")
        return None


def mtp_tensors(f, g):
    """Multi-token-prediction head tensors as Nemotron 3 checkpoints carry them (an attention layer and an
    MoE layer under mtp.*), random: an engine must load past them."""
    H, E, I, q, kv = f["hidden"], f["experts"], f["moe"], f["heads"] * f["head_dim"], f["kv"] * f["head_dim"]
    shapes = {"mtp.layers.0.enorm.weight": [H], "mtp.layers.0.hnorm.weight": [H], "mtp.layers.0.eh_proj.weight": [H, 2 * H],
              "mtp.layers.0.norm.weight": [H], "mtp.layers.0.mixer.q_proj.weight": [q, H],
              "mtp.layers.0.mixer.k_proj.weight": [kv, H], "mtp.layers.0.mixer.v_proj.weight": [kv, H],
              "mtp.layers.0.mixer.o_proj.weight": [H, q], "mtp.layers.1.norm.weight": [H],
              "mtp.layers.1.mixer.gate.weight": [E, H], "mtp.layers.1.mixer.gate.e_score_correction_bias": [E],
              "mtp.layers.1.mixer.shared_experts.up_proj.weight": [f["shared"], H],
              "mtp.layers.1.mixer.shared_experts.down_proj.weight": [H, f["shared"]],
              "mtp.layers.1.final_layernorm.weight": [H]}
    for e in range(E):
        shapes[f"mtp.layers.1.mixer.experts.{e}.up_proj.weight"] = [I, H]
        shapes[f"mtp.layers.1.mixer.experts.{e}.down_proj.weight"] = [H, I]
    return {k: stored(torch.randn(s, generator=g) / math.sqrt(s[-1]), f["store"]).contiguous() for k, s in shapes.items()}


def write_nvidia(model, f, d, g, quant=None, scales=None, mtp_t=None):
    """NVIDIA's published layout: backbone.* names, hybrid_override_pattern, attention_head_dim; routed
    experts one tensor per expert (backbone.layers.L.mixer.experts.E.up_proj.weight), mtp.* extras (random
    ones an engine must skip, or mtp_t: the MTP block of an MTP fixture, under its config keys).
    Quantized fixtures: ModelOpt's tensors in place of each quantized weight, the calibrated scales, the
    config files, and dequant.safetensors."""
    tensors = {}
    for k, v in model.state_dict().items():
        k = nvidia_name(k)
        if ".mixer.experts." in k:  # stacked [E, out, in] in the module: one [out, in] tensor per expert
            base, proj = k.rsplit(".", 1)
            tensors.update({f"{base}.{e}.{proj}.weight": stored(v[e], f["store"]).contiguous() for e in range(len(v))})
        else:
            tensors[k] = stored(v, f["store"]).contiguous()
    mtp = {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"} if f.get("mtp") else {}
    if mtp:
        tensors.update(mtp_tensors(f, g))
    if mtp_t is not None:
        if sorted(mtp_t) != mtp_expected_names(hf_kwargs(f), f["mtp_ref"]):
            raise SystemExit(f"{f['name']}: MTP tensor names {sorted(mtp_t)} are not NVIDIA's layout")
        tensors.update({k: stored(v, f["store"]).contiguous() for k, v in mtp_t.items()})
        mtp = {"num_nextn_predict_layers": 1} | ({"mtp_layers_block_type": [MTP_LIST_NAME[c] for c in f["mtp_ref"]]}
                                                 if f.get("mtp_list") else {"mtp_hybrid_override_pattern": f["mtp_ref"]})
    for m, (fmt, t, _) in (quant or {}).items():
        tensors.update({f"{m}.{k}": v.contiguous() for k, v in t.items()})  # m.weight replaced
    tensors.update(scales or {})
    names = sorted(tensors)
    if f["shards"] == 1:
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    else:
        half = len(names) // 2
        parts = [names[:half], names[half:]]
        if quant:  # every matrix in the first file; its scales, and every vector, in the second
            parts = [[k for k in names if k.endswith(".weight") and tensors[k].ndim >= 2]]
            parts.append([k for k in names if k not in set(parts[0])])
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": {}}
        for i, part in enumerate(parts):
            fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            save_file({k: tensors[k] for k in part}, os.path.join(d, fn), metadata={"format": "pt"})
            index["weight_map"].update({k: fn for k in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2)
    cfg = nvidia_config(hf_kwargs(f) | mtp, {"f32": "float32", "bf16": "bfloat16"}[f["store"]])
    if quant:
        hf_quant, cfg_quant = quant_configs(model, f, quant)
        if f["quant"]["files"] in ("hf", "both"):
            with open(os.path.join(d, "hf_quant_config.json"), "w") as fh:
                json.dump(hf_quant, fh, indent=2)
        if f["quant"]["files"] in ("config", "both"):
            cfg["quantization_config"] = cfg_quant
        save_file({m + ".weight": deq.contiguous() for m, (_, _, deq) in quant.items()},
                  os.path.join(d, "dequant.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)  # Python writes the bare token Infinity, as NVIDIA's files have it


if __name__ == "__main__":
    chosen = [f for f in FIXTURES if not ONLY or any(fnmatch.fnmatch(f["name"], p) for p in ONLY)]
    if not chosen:
        raise SystemExit(f"no fixture matches {ONLY}; names: {[f['name'] for f in FIXTURES]}")
    if any("experts" in f for f in chosen):
        check_moe_support()
    for f in chosen:
        make(f)
