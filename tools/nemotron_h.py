"""What tools/make_fixtures.py and tools/train_default.py share: the dt clamp switch of transformers'
NemotronH, the config.json of NVIDIA's published layout (Nemotron 3 MoE and MTP keys included) for a
NemotronHConfig's arguments, and the multi-token-prediction (MTP) reference: the block built from
transformers' NemotronHBlocks, its tensors in NVIDIA's layout, the oracle logits and their checks."""
import math, re
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.models.nemotron_h import modeling_nemotron_h as mh


def set_clamp(model, on):
    """Where transformers keeps the dt clamp has moved between versions (the mixer's time_step_min or
    time_step_limit, or the config's): set every one of them. make_fixtures' component checks prove it
    took effect."""
    lo = 0.001 if on else 0.0  # softplus > 0, so a clamp at 0 is the identity
    for obj in [model.config] + [m for m in model.modules() if hasattr(m, "A_log")]:
        obj.time_step_min = lo
        obj.time_step_limit = (lo, float("inf"))
        if hasattr(obj, "config"):
            obj.config.time_step_min = lo
            obj.config.time_step_limit = (lo, float("inf"))


def nvidia_config(kw, dtype):
    """config.json as NVIDIA publishes it (hybrid_override_pattern, attention_head_dim, the bare token
    Infinity in time_step_limit) for NemotronHConfig(**kw), weights stored as dtype ("bfloat16", ...)."""
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": kw["vocab_size"], "hidden_size": kw["hidden_size"],
        "num_hidden_layers": len(kw["hybrid_override_pattern"]), "hybrid_override_pattern": kw["hybrid_override_pattern"],
        "num_attention_heads": kw["num_attention_heads"], "num_key_value_heads": kw["num_key_value_heads"],
        "attention_head_dim": kw["head_dim"], "intermediate_size": kw["intermediate_size"], "mlp_hidden_act": "relu2",
        "mamba_num_heads": kw["mamba_num_heads"], "mamba_head_dim": kw["mamba_head_dim"], "n_groups": kw["n_groups"],
        "ssm_state_size": kw["ssm_state_size"], "conv_kernel": kw["conv_kernel"], "chunk_size": kw["chunk_size"],
        "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False, "mlp_bias": False,
        "attention_bias": False, "rms_norm_eps": kw["layer_norm_epsilon"], "layer_norm_epsilon": kw["layer_norm_epsilon"],
        "max_position_embeddings": kw["max_position_embeddings"], "time_step_min": kw["time_step_min"],
        "time_step_max": kw["time_step_max"], "time_step_limit": [0.0, float("inf")],
        "bos_token_id": kw["bos_token_id"], "eos_token_id": kw["eos_token_id"], "pad_token_id": kw["pad_token_id"],
        "tie_word_embeddings": kw["tie_word_embeddings"], "residual_in_fp32": False, "torch_dtype": dtype,
    } | moe_config(kw) | mtp_config(kw)


MOE_KEYS = ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
            "n_shared_experts", "moe_latent_size", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
            "num_nextn_predict_layers", "mtp_hybrid_override_pattern"]


def moe_config(kw):
    """The mixture-of-experts keys of NVIDIA's Nemotron 3 config.json, for a model with MoE layers."""
    return {k: kw[k] for k in MOE_KEYS if k in kw} if "n_routed_experts" in kw else {}


# ---- multi-token prediction (MTP): the reference both scripts use (shared/notes/mtp.md, sections 2, 3.2 and 6) ----
#
# transformers has no MTP forward (it drops mtp.* on load). The reference here builds one out of transformers'
# own modules: the sublayers are NemotronHBlocks (pre-norm RMSNorm, mixer, residual add) of a NemotronH model
# whose layer pattern is the MTP pattern, so the attention, MLP and (latent) MoE math is transformers', loaded
# with the mtp.layers.{i} weights; enorm, hnorm and final_layernorm are transformers' NemotronHRMSNorm and
# eh_proj a bias-free Linear. mtp_plain_logits is a second, independent float64 implementation from the
# checkpoint's own tensors; the two must agree (mtp_self_checks).

MTP_KEYS = ["num_nextn_predict_layers", "mtp_hybrid_override_pattern", "mtp_layers_block_type"]
MTP_LETTER = {"attention": "*", "full_attention": "*", "mamba": "M", "linear_attention": "M", "moe": "E", "mlp": "-"}
MTP_LIST_NAME = {"*": "attention", "M": "mamba", "E": "moe", "-": "mlp"}  # the list form as NVIDIA's configs spell it


def mtp_config(kw):
    """The MTP keys of config.json (num_nextn_predict_layers and one of the two pattern spellings), if kw has them."""
    return {k: kw[k] for k in MTP_KEYS if k in kw}


def mtp_pattern(cfg):
    """The MTP block's sublayer pattern ("*E") of a config.json dict, from either spelling; None without MTP."""
    n = cfg.get("num_nextn_predict_layers") or 0
    if n == 0:
        return None
    if n != 1:
        raise SystemExit(f"num_nextn_predict_layers {n}: the reference handles one MTP block")
    if "mtp_hybrid_override_pattern" in cfg:
        pattern = cfg["mtp_hybrid_override_pattern"]
    elif "mtp_layers_block_type" in cfg:
        pattern = "".join(MTP_LETTER[t] for t in cfg["mtp_layers_block_type"])
    else:
        raise SystemExit("num_nextn_predict_layers is 1 but config.json names no MTP pattern")
    if not pattern or any(c not in "*-EM" for c in pattern):
        raise SystemExit(f"MTP pattern {pattern!r}: letters must be M * - E")
    return pattern


def eager_experts(model):
    """The loop over experts is transformers' reference; other backends differ only in rounding."""
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except Exception as e:  # older or newer API: the default backend computes the same sums
            print(f"note: set_experts_implementation('eager'): {type(e).__name__}: {e}")
    return model


def eager_attention(model):
    """transformers' eager attention (softmax(q k^T * scale + mask) v): the MTP blocks get an additive float
    mask from causal_mask, which only the eager path takes in every dtype (sdpa wants a bool mask under autocast)."""
    try:
        model.set_attn_implementation("eager")
    except Exception as e:
        print(f"note: set_attn_implementation('eager'): {type(e).__name__}: {e}; setting the config's")
        model.config._attn_implementation = "eager"
    if getattr(model.config, "_attn_implementation", None) != "eager":
        raise SystemExit(f"cannot switch the MTP blocks to eager attention (have {model.config._attn_implementation!r})")
    return model


def causal_mask(T, device, diagonal_only=False):
    """Additive attention mask [1, 1, T, T]: 0 where query i may see key j (j <= i; only j == i if
    diagonal_only), -inf elsewhere. The MTP attention has no positional encoding: the mask is all it gets."""
    i = torch.arange(T, device=device)
    keep = (i[None, :] == i[:, None]) if diagonal_only else (i[None, :] <= i[:, None])
    return torch.zeros(T, T, device=device).masked_fill(~keep, float("-inf"))[None, None]


class MTP(torch.nn.Module):
    """One MTP block (DeepSeek-V3 style, as Nemotron 3 ships it) for the main model of NemotronHConfig(**kw):
        g_t = final_layernorm(sublayers(eh_proj([enorm(E[x_{t+1}]) ; hnorm(h_t)])))
    the sublayers the NemotronHBlocks of `pattern` (their attention causal over the MTP positions, no positional
    encoding); logits_t = lm_head(g_t) with the main model's lm_head (no norm_f). Parameter names:
    enorm.weight, hnorm.weight, eh_proj.weight, layers.{i}.<NemotronHBlock's own>, final_layernorm.weight."""

    def __init__(self, kw, pattern):
        super().__init__()
        if not pattern or any(c not in "*-EM" for c in pattern):
            raise SystemExit(f"MTP pattern {pattern!r}: letters must be M * - E")
        base = {k: v for k, v in kw.items() if k not in MTP_KEYS and k != "hybrid_override_pattern"}
        # a NemotronH model whose layers are the MTP pattern: transformers builds each block from its config
        # (layers_block_type[layer_idx]) and sets the attention / experts backends on that config
        carrier = NemotronHForCausalLM(NemotronHConfig(**base, hybrid_override_pattern=pattern))
        eager_attention(eager_experts(carrier))
        self.pattern, self.config = pattern, carrier.config
        self.layers = carrier.model.layers
        kinds = {"*": mh.NemotronHAttention, "-": mh.NemotronHMLP, "E": mh.NemotronHMoE, "M": mh.NemotronHMamba2Mixer}
        got = [type(b.mixer).__name__ for b in self.layers]
        if len(self.layers) != len(pattern) or not all(isinstance(b.mixer, kinds[c]) for b, c in zip(self.layers, pattern)):
            raise SystemExit(f"MTP pattern {pattern!r}: transformers built the blocks {got}")
        for b in self.layers:  # the backend each attention module reads is its config's
            if isinstance(b.mixer, mh.NemotronHAttention) and getattr(b.mixer.config, "_attn_implementation", None) != "eager":
                raise SystemExit("the MTP attention modules did not take eager attention")
        H, eps = kw["hidden_size"], kw["layer_norm_epsilon"]
        self.enorm = mh.NemotronHRMSNorm(H, eps=eps)
        self.hnorm = mh.NemotronHRMSNorm(H, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.final_layernorm = mh.NemotronHRMSNorm(H, eps=eps)

    def forward(self, emb, hidden, mask=None):
        """emb [B, T, H]: the embeddings of x_{t+1}; hidden [B, T, H]: h_t. Returns g [B, T, H]."""
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))  # [embed ; hidden]
        if mask is None:
            mask = causal_mask(u.shape[1], u.device)
        for block in self.layers:
            attn = isinstance(block.mixer, mh.NemotronHAttention)
            u = block(u, attention_mask=mask if attn else None)
        return self.final_layernorm(u)


def mtp_expected_names(kw, pattern):
    """Every mtp.* tensor name of NVIDIA's layout for this pattern (HF flat naming, one tensor per expert;
    a latent MoE sublayer carries fc1/fc2_latent_proj as the main 'E' layers do)."""
    last = len(pattern) - 1
    names = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
             f"mtp.layers.{last}.final_layernorm.weight"]
    for i, c in enumerate(pattern):
        p = f"mtp.layers.{i}."
        names.append(p + "norm.weight")
        if c == "*":
            names += [p + f"mixer.{m}_proj.weight" for m in "qkvo"]
        elif c == "-":
            names += [p + "mixer.up_proj.weight", p + "mixer.down_proj.weight"]
        elif c == "E":
            names += [p + "mixer.gate.weight", p + "mixer.gate.e_score_correction_bias",
                      p + "mixer.shared_experts.up_proj.weight", p + "mixer.shared_experts.down_proj.weight"]
            names += [p + f"mixer.experts.{e}.{m}_proj.weight" for e in range(kw["n_routed_experts"]) for m in ("up", "down")]
            if kw.get("moe_latent_size"):
                names += [p + "mixer.fc1_latent_proj.weight", p + "mixer.fc2_latent_proj.weight"]
        else:
            names += [p + f"mixer.{k}" for k in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D",
                                                   "dt_bias", "norm.weight", "out_proj.weight")]
    return sorted(names)


def mtp_nvidia_tensors(mtp):
    """The block's tensors under NVIDIA's names (mtp.layers.{i}.*; routed experts one [out, in] tensor each)."""
    last, out = len(mtp.pattern) - 1, {}
    for k, v in mtp.state_dict().items():
        if k in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            out[f"mtp.layers.0.{k}"] = v
        elif k == "final_layernorm.weight":
            out[f"mtp.layers.{last}.{k}"] = v
        elif ".mixer.experts." in k:  # layers.i.mixer.experts.up_proj [E, out, in]
            base, proj = k.rsplit(".", 1)
            out.update({f"mtp.{base}.{e}.{proj}.weight": v[e] for e in range(len(v))})
        elif k.startswith("layers."):
            out[f"mtp.{k}"] = v
        else:
            raise SystemExit(f"MTP: unexpected state_dict entry {k}")
    return out


def mtp_state_from_nvidia(T, pattern):
    """mtp.* tensors of NVIDIA's layout -> the MTP module's state_dict (experts stacked [E, out, in] as
    transformers' NemotronHExperts stores them). Refuses names outside the layout."""
    last, sd, experts = len(pattern) - 1, {}, {}
    for k, v in T.items():
        m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", k)
        if not m or int(m[1]) > last:
            raise SystemExit(f"MTP tensor {k}: not mtp.layers.0..{last}.*")
        i, rest = int(m[1]), m[2]
        if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
            if i != (last if rest == "final_layernorm.weight" else 0):
                raise SystemExit(f"MTP tensor {k}: {rest} belongs to layer {last if rest == 'final_layernorm.weight' else 0}")
            sd[rest] = v
        elif (e := re.fullmatch(r"mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight", rest)):
            experts.setdefault(f"layers.{i}.mixer.experts.{e[2]}", {})[int(e[1])] = v
        else:
            sd[f"layers.{i}.{rest}"] = v
    for k, per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise SystemExit(f"MTP experts {k}: indices {sorted(per)}")
        sd[k] = torch.stack([per[e] for e in range(len(per))])
    return sd


def load_mtp(kw, pattern, T):
    """A float32 MTP module holding exactly the checkpoint's mtp.* tensors (strict: none missing, none extra)."""
    names = sorted(k for k in T if k.startswith("mtp."))
    if names != mtp_expected_names(kw, pattern):
        want = set(mtp_expected_names(kw, pattern))
        raise SystemExit(f"mtp.* tensors differ from NVIDIA's layout for {pattern!r}: missing {sorted(want - set(names))}, "
                         f"extra {sorted(set(names) - want)}")
    mtp = MTP(kw, pattern).float().eval()
    mtp.load_state_dict({k: v.float() for k, v in mtp_state_from_nvidia({k: T[k] for k in names}, pattern).items()})
    return mtp


def main_hidden(model, ids, pre_norm_f=False):
    """The main model's hidden states [1, T, H] for ids: the output after norm_f (what feeds lm_head), or
    norm_f's input."""
    seen = []
    hook = model.model.norm_f.register_forward_hook(lambda mod, a, out: seen.append(a[0])) if pre_norm_f else None
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state
    if hook:
        hook.remove()
        h = seen[0]
    return h


@torch.no_grad()
def mtp_logits(model, mtp, s, mask=None, pre_norm_f=False):
    """The oracle: float [len(s) - 1, vocab]; row p = lm_head(MTP(E[s[p+1]], h_p)), h_p the main model's
    post-norm_f hidden state at p over s[:p+1] (one causal forward over s[:-1]). mask and pre_norm_f are
    for the component checks only."""
    dev = model.lm_head.weight.device
    h = main_hidden(model, torch.tensor([s[:-1]], device=dev), pre_norm_f)
    e = model.model.embeddings(torch.tensor([s[1:]], device=dev))
    return model.lm_head(mtp(e, h, mask)).float()[0]


def router_gap(weight, bias, x, n_group, topk_group, top_k):
    """Smallest gap, over the rows of x, between the last chosen and the first unchosen candidate of each
    choice the router makes (groups, then experts): sigmoid(x W^T) + bias, as transformers chooses."""
    c = torch.sigmoid(x.float() @ weight.float().T) + bias.float()
    margin = math.inf
    if n_group > 1:
        gs = c.view(len(c), n_group, -1).topk(2, dim=-1).values.sum(-1)
        top = gs.sort(-1, descending=True).values
        margin = min(margin, float((top[:, topk_group - 1] - top[:, topk_group]).min()))
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
        c = c.masked_fill(~keep.repeat_interleave(c.shape[1] // n_group, dim=1), -math.inf)
    top = c.sort(-1, descending=True).values
    gap = top[:, top_k - 1] - top[:, top_k]
    return min(margin, float(gap[torch.isfinite(gap)].min()) if torch.isfinite(gap).any() else math.inf)


def gate_inputs(gate, run):
    """The rows router `gate` sees while run() runs: float [rows, H]."""
    caps = []
    hook = gate.register_forward_pre_hook(lambda mod, a: caps.append(a[0].reshape(-1, a[0].shape[-1]).float()))
    try:
        run()
    finally:
        hook.remove()
    if not caps:
        raise SystemExit("a router saw no input")
    return torch.cat(caps)


def mtp_plain_logits(T, kw, pattern, next_tokens, h):
    """An independent float64 MTP in plain torch, from a checkpoint's tensors of NVIDIA's layout (mtp.*,
    backbone.embeddings.weight, lm_head.weight): rows p = lm_head(g_p) for tokens next_tokens[p] = s[p+1] and
    hidden h [rows, H]. Attention: GQA (q head j reads kv head j // (heads / kv heads)), causal, no positional
    encoding, scale head_dim^-0.5; MLP and experts relu(x)^2; MoE: sigmoid router + e_score_correction_bias
    for the choice (groups by the sum of their top two), weights sigmoid scores (normalised if norm_topk_prob)
    times routed_scaling_factor, latent projections around the routed experts, plus the shared expert."""
    W = lambda k: T[k].double()
    eps, H = kw["layer_norm_epsilon"], kw["hidden_size"]
    rms = lambda x, k: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * W(k)
    relu2 = lambda x: torch.relu(x) ** 2
    e = W("backbone.embeddings.weight")[torch.tensor(next_tokens)]
    u = torch.cat([rms(e, "mtp.layers.0.enorm.weight"), rms(h.double(), "mtp.layers.0.hnorm.weight")], -1) @ W("mtp.layers.0.eh_proj.weight").T
    N = len(u)
    for i, c in enumerate(pattern):
        p = f"mtp.layers.{i}.mixer."
        x = rms(u, f"mtp.layers.{i}.norm.weight")
        if c == "*":
            nh, nkv, hd = kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"]
            q = (x @ W(p + "q_proj.weight").T).view(N, nh, hd)
            k = (x @ W(p + "k_proj.weight").T).view(N, nkv, hd).repeat_interleave(nh // nkv, dim=1)
            v = (x @ W(p + "v_proj.weight").T).view(N, nkv, hd).repeat_interleave(nh // nkv, dim=1)
            sc = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)
            sc = sc.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
            y = torch.einsum("hij,jhd->ihd", torch.softmax(sc, -1), v).reshape(N, nh * hd) @ W(p + "o_proj.weight").T
        elif c == "-":
            y = relu2(x @ W(p + "up_proj.weight").T) @ W(p + "down_proj.weight").T
        elif c == "E":
            E, k, G, TG = kw["n_routed_experts"], kw["num_experts_per_tok"], kw["n_group"], kw["topk_group"]
            s = torch.sigmoid(x @ W(p + "gate.weight").T)
            choice = s + W(p + "gate.e_score_correction_bias")
            if G > 1:
                gs = choice.view(N, G, -1).topk(2, dim=-1).values.sum(-1)
                keep = torch.zeros(N, G, dtype=torch.bool).scatter_(1, gs.topk(TG, dim=-1).indices, True)
                choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), -math.inf)
            idx = choice.topk(k, dim=-1).indices
            w = s.gather(1, idx)
            if kw["norm_topk_prob"]:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * kw["routed_scaling_factor"]
            lat = bool(kw.get("moe_latent_size"))
            xl = x @ W(p + "fc1_latent_proj.weight").T if lat else x
            r = torch.zeros_like(xl)
            for n in range(N):
                for j in range(k):
                    ex = f"{p}experts.{int(idx[n, j])}."
                    r[n] += w[n, j] * (relu2(xl[n] @ W(ex + "up_proj.weight").T) @ W(ex + "down_proj.weight").T)
            y = (r @ W(p + "fc2_latent_proj.weight").T if lat else r)
            y = y + relu2(x @ W(p + "shared_experts.up_proj.weight").T) @ W(p + "shared_experts.down_proj.weight").T
        else:
            raise SystemExit("the plain MTP reference has no Mamba sublayer")
        u = u + y
    return rms(u, f"mtp.layers.{len(pattern) - 1}.final_layernorm.weight") @ W("lm_head.weight").T


@torch.no_grad()
def mtp_self_checks(model, mtp, s, ref, T, kw, tol):
    """The oracle checked against itself and against a second implementation; stops on a failure.
      hidden_feeds_lm_head_max_diff  lm_head(h) against the model's own logits: h is what feeds lm_head
                                     (post-norm_f)
      causal_prefix_max_diff         the MTP run on positions 0..q-1 only, against the first q rows: its
                                     attention sees no later position
      plain_float64_max_diff         mtp_plain_logits on the checkpoint tensors T against ref"""
    dev = model.lm_head.weight.device
    ids = torch.tensor([s[:-1]], device=dev)
    h = main_hidden(model, ids)
    e = model.model.embeddings(torch.tensor([s[1:]], device=dev))
    out = {"hidden_feeds_lm_head_max_diff": float((model.lm_head(h).float() - model(input_ids=ids, use_cache=False).logits.float()).abs().max())}
    N, worst = len(s) - 1, 0.0
    for q in sorted({1, 2, N // 3, N // 2, N - 1} - {0}):
        worst = max(worst, float((model.lm_head(mtp(e[:, :q], h[:, :q])).float()[0] - ref[:q]).abs().max()))
    out["causal_prefix_max_diff"] = worst
    plain = mtp_plain_logits(T, kw, mtp.pattern, s[1:], h[0].cpu())
    out["plain_float64_max_diff"] = float((plain - ref.cpu().double()).abs().max())
    limits = {"hidden_feeds_lm_head_max_diff": 0.01 * tol, "causal_prefix_max_diff": 0.1 * tol, "plain_float64_max_diff": 0.5 * tol}
    for k, v in out.items():
        print(f"  MTP oracle: {k} = {v:.3g}")
        if not v <= limits[k]:
            raise SystemExit(f"MTP oracle self-check {k} = {v:.3g}, over {limits[k]:.3g}")
    return out


def mtp_component_checks(model, mtp, s, ref):
    """Max |MTP logit change| when one part of the block is removed or perturbed (each must move the logits
    far more than the tolerance), and two checks of the inputs: h taken before norm_f, and the attention
    shown only its own position."""
    P = dict(mtp.named_parameters()) | dict(mtp.named_buffers())
    H, checks = P["enorm.weight"].shape[0], {}

    def delta(fn=None, **kw):
        saved = {k: v.clone() for k, v in mtp.state_dict().items()}
        with torch.no_grad():
            if fn:
                fn(P)
        d = float((mtp_logits(model, mtp, s, **kw) - ref).abs().max())
        mtp.load_state_dict(saved)
        return d

    def delta_attr(mixer, attr, fn):
        objs = [mtp.config, mixer, mixer.gate]
        saved = [(o, getattr(o, attr)) for o in objs if hasattr(o, attr)]
        if not saved:
            raise SystemExit(f"no MTP MoE module or router has the attribute {attr}")
        for o, v in saved:
            setattr(o, attr, fn(v))
        d = float((mtp_logits(model, mtp, s) - ref).abs().max())
        for o, v in saved:
            setattr(o, attr, v)
        return d

    checks["mtp enorm"] = delta(lambda P: P["enorm.weight"].fill_(1.0))
    checks["mtp hnorm"] = delta(lambda P: P["hnorm.weight"].fill_(1.0))
    checks["mtp eh_proj embedding half (columns 0..H-1)"] = delta(lambda P: P["eh_proj.weight"][:, :H].zero_())
    checks["mtp eh_proj hidden half (columns H..2H-1)"] = delta(lambda P: P["eh_proj.weight"][:, H:].zero_())
    parts = {"*": [("o_proj.weight", "zero"), ("k_proj.weight", "half"), ("v_proj.weight", "half"), ("q_proj.weight", "half")],
             "-": [("down_proj.weight", "zero"), ("up_proj.weight", "half")],
             "E": [("gate.weight", "half"), ("gate.e_score_correction_bias", "zero"), ("experts.up_proj", "cols"),
                   ("experts.down_proj", "zero"), ("shared_experts.up_proj.weight", "half"),
                   ("shared_experts.down_proj.weight", "zero")],
             "M": [("out_proj.weight", "zero")]}
    ops = {"zero": lambda t: t.zero_(), "half": lambda t: t.mul_(0.5), "cols": lambda t: t[..., : t.shape[-1] // 2].zero_()}
    kinds = {"*": "attention", "-": "mlp", "E": "moe", "M": "mamba"}
    for i, c in enumerate(mtp.pattern):
        checks[f"mtp layer {i} ({kinds[c]}) norm"] = delta(lambda P, i=i: P[f"layers.{i}.norm.weight"].fill_(1.0))
        todo = list(parts[c])
        if c == "E" and f"layers.{i}.mixer.fc1_latent_proj.weight" in P:
            todo += [("fc1_latent_proj.weight", "half"), ("fc2_latent_proj.weight", "half")]
        for part, op in todo:
            checks[f"mtp layer {i} ({kinds[c]}) {part} {op}"] = delta(lambda P, k=f"layers.{i}.mixer.{part}", op=op: ops[op](P[k]))
        if c == "E":
            mx = mtp.layers[i].mixer
            checks[f"mtp layer {i} moe norm_topk_prob flipped"] = delta_attr(mx, "norm_topk_prob", lambda v: not v)
            checks[f"mtp layer {i} moe routed_scaling_factor doubled"] = delta_attr(mx, "routed_scaling_factor", lambda v: 2 * v)
        if c == "*":
            n = len(s) - 1
            checks[f"mtp layer {i} attention sees only its own position (must differ)"] = delta(
                mask=causal_mask(n, model.lm_head.weight.device, diagonal_only=True))
    checks["mtp final_layernorm"] = delta(lambda P: P["final_layernorm.weight"].fill_(1.0))
    checks["mtp hidden taken before norm_f (must differ)"] = delta(pre_norm_f=True)
    return checks
