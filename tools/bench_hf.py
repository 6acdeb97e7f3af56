"""The baseline a user would otherwise reach for: Hugging Face transformers' NemotronHForCausalLM in
bf16 on one GPU, random weights at a preset's shape, greedy, with the same prompt and lengths as
`nemoh --random PRESET --bench -P P -n N`.
  python3 tools/bench_hf.py [nemotron-h-8b] [P=512] [N=256]
transformers 5.17 has no fused Mamba kernels here (mamba_ssm / causal_conv1d are not installed), so
this is its pure-PyTorch path; it prints one Markdown table row."""
import sys, time
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

PRESETS = {  # the same shapes as nemoh.c's preset table
    "nemotron-h-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          intermediate_size=21504, mamba_num_heads=128, mamba_head_dim=64, n_groups=8,
                          ssm_state_size=128, vocab_size=131072,
                          hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
    "nemotron-nano-9b-v2": dict(hidden_size=4480, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                intermediate_size=15680, mamba_num_heads=128, mamba_head_dim=80, n_groups=8,
                                ssm_state_size=128, vocab_size=131072,
                                hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"),
    "nemotron-3-nano-30b-a3b": dict(hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                                    intermediate_size=1856, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
                                    ssm_state_size=128, vocab_size=131072, n_routed_experts=128,
                                    num_experts_per_tok=6, moe_intermediate_size=1856, n_shared_experts=1,
                                    moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
                                    n_group=1, topk_group=1, norm_topk_prob=True,
                                    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
}
name = sys.argv[1] if len(sys.argv) > 1 else "nemotron-h-8b"
P = int(sys.argv[2]) if len(sys.argv) > 2 else 512
N = int(sys.argv[3]) if len(sys.argv) > 3 else 256
cfg = NemotronHConfig(**PRESETS[name], conv_kernel=4, chunk_size=128, max_position_embeddings=max(8192, P + N),
                      use_mamba_kernels=False, tie_word_embeddings=False, layer_norm_epsilon=1e-5)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: a 30B model in fp32 would not fit
with torch.device("cuda"):
    model = NemotronHForCausalLM(cfg).eval()
prompt = torch.randint(3, cfg.vocab_size, (1, P), device="cuda")


@torch.no_grad()
def run(p, n):
    torch.cuda.synchronize()
    t0 = time.time()
    out = model(input_ids=p, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    t1 = time.time()
    for _ in range(n - 1):
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return t1 - t0, time.time() - t1


run(prompt, 4)  # warm-up, the same prompt (as nemoh --bench does)
pre, dec = run(prompt, N)
print(f"| HF transformers {__import__('transformers').__version__} bf16 (pure-torch Mamba path) | {name} | "
      f"{P / pre:.0f} tok/s prefill ({P} tokens) | {dec * 1e3 / (N - 1):.2f} ms/token decode ({N} tokens) | "
      f"{torch.cuda.max_memory_allocated() / 1e9:.1f} GB peak | {torch.cuda.get_device_name()} |")
