"""What tools/make_fixtures.py and tools/train_default.py share: the dt clamp switch of transformers'
NemotronH, and the config.json of NVIDIA's published layout (Nemotron 3 MoE keys included) for a
NemotronHConfig's arguments."""


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
    } | moe_config(kw)


MOE_KEYS = ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
            "n_shared_experts", "moe_latent_size", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
            "num_nextn_predict_layers", "mtp_hybrid_override_pattern"]


def moe_config(kw):
    """The mixture-of-experts keys of NVIDIA's Nemotron 3 config.json, for a model with MoE layers."""
    return {k: kw[k] for k in MOE_KEYS if k in kw} if "n_routed_experts" in kw else {}
