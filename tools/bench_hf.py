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
}
name = sys.argv[1] if len(sys.argv) > 1 else "nemotron-h-8b"
P = int(sys.argv[2]) if len(sys.argv) > 2 else 512
N = int(sys.argv[3]) if len(sys.argv) > 3 else 256
cfg = NemotronHConfig(**PRESETS[name], conv_kernel=4, chunk_size=128, max_position_embeddings=8192,
                      use_mamba_kernels=False, tie_word_embeddings=False, layer_norm_epsilon=1e-5)
torch.manual_seed(0)
with torch.device("cuda"):
    model = NemotronHForCausalLM(cfg).to(torch.bfloat16).eval()
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
