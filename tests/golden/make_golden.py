#!/usr/bin/env python3
"""Reference data from HF transformers' LlamaForCausalLM for Loom's golden tests.

For each tiny model ("mha": tied embeddings, 6 kv heads; "gqa": untied, 2 kv heads)
this writes, under tests/golden/<model>/:
  hf/                        the model, save_pretrained (config.json + model.safetensors)
  reference.safetensors      input_ids, targets (int32 [2, 33]); logits [2, 33, 300];
                             loss [1]; grad.<hf name> for every parameter;
                             adamw_losses [5]; adamw_grad_norms [5]
  reference.json             hyper-parameters, versions, shapes

Run from the repository root:  python3 tests/golden/make_golden.py
Everything is fp32 on the CPU with eager attention, single-threaded and
deterministic, so a rerun with the same torch/transformers reproduces the files.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers
import safetensors
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))

COMMON = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, intermediate_size=160,
              vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
              hidden_act="silu", attention_bias=False, mlp_bias=False)
MODELS = {
    "mha": dict(num_key_value_heads=6, tie_word_embeddings=True, seed=1234),
    "gqa": dict(num_key_value_heads=2, tie_word_embeddings=False, seed=5678),
}
BATCH, SEQ = 2, 33
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ADAMW_STEPS = 5
CLIP = 1.0
INIT_STD = 0.02


def make_config(tied, kv_heads):
    kw = dict(COMMON, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    cfg = LlamaConfig(**kw)
    # transformers >= 5 keeps rope_theta inside rope_parameters; set both spellings
    # so the value is right whichever version reads it.
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": COMMON["rope_theta"]}
    cfg._attn_implementation = "eager"
    return cfg


def loss_of(model, input_ids, targets):
    logits = model(input_ids=input_ids).logits
    # Explicit mean cross-entropy over all B*S positions: the targets are already
    # the next tokens, so HF's internal label shift must not be applied.
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="mean")
    return logits, loss


def build(name, spec):
    out_dir = os.path.join(HERE, name)
    hf_dir = os.path.join(out_dir, "hf")
    os.makedirs(hf_dir, exist_ok=True)
    torch.manual_seed(spec["seed"])
    cfg = make_config(spec["tie_word_embeddings"], spec["num_key_value_heads"])
    model = LlamaForCausalLM(cfg).float()
    model.config._attn_implementation = "eager"
    # Matrices ~ N(0, 0.02); norm gains 1 + 0.1 N(0, 1) so that norm gradients
    # are exercised (gains of exactly 1 would hide a missing gain in the backward).
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir, safe_serialization=True)

    g = torch.Generator().manual_seed(spec["seed"] + 1)
    seq = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    input_ids, targets = seq[:, :SEQ].contiguous(), seq[:, 1:].contiguous()

    model.train()  # dropout is 0; train() only matters for bookkeeping
    model.zero_grad(set_to_none=True)
    logits, loss = loss_of(model, input_ids, targets)
    loss.backward()
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach().float().contiguous(),
        "loss": loss.detach().reshape(1).float(),
    }
    for pname, p in params.items():
        tensors["grad." + pname] = p.grad.detach().float().contiguous().clone()

    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])
    losses, norms = [], []
    for _ in range(ADAMW_STEPS):
        opt.zero_grad(set_to_none=True)
        _, l = loss_of(model, input_ids, targets)
        l.backward()
        # clip_grad_norm_ returns the total norm before clipping.
        n = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=CLIP)
        losses.append(l.item())
        norms.append(n.item())
        opt.step()
    tensors["adamw_losses"] = torch.tensor(losses, dtype=torch.float32)
    tensors["adamw_grad_norms"] = torch.tensor(norms, dtype=torch.float32)
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"), metadata={"format": "pt"})

    ref = {
        "model": name,
        "generator": "tests/golden/make_golden.py",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__},
        "seed": spec["seed"],
        "config": dict(COMMON, num_key_value_heads=spec["num_key_value_heads"],
                       tie_word_embeddings=spec["tie_word_embeddings"], attn_implementation="eager",
                       dtype="float32", device="cpu"),
        "init": {"matrices": f"normal(0, {INIT_STD})", "norm_weights": "1 + 0.1 * randn"},
        "batch": {"batch": BATCH, "seq": SEQ,
                  "construction": "seq = randint(0, vocab, [2, 34]); input_ids = seq[:, :33]; targets = seq[:, 1:]"},
        "loss": "mean cross-entropy over all 2*33 positions, computed from logits (no HF label shift)",
        "adamw": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                  "weight_decay": ADAMW["weight_decay"], "weight_decay_applies_to": "2-D weights only",
                  "clip_grad_norm": CLIP, "steps": ADAMW_STEPS,
                  "recorded": "loss and pre-clip global grad norm before each step, same batch every step"},
        "values": {"loss": loss.item(), "adamw_losses": losses, "adamw_grad_norms": norms},
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref, f, indent=2)
        f.write("\n")
    print(f"{name}: loss {loss.item():.6f}, adamw losses {[round(x, 6) for x in losses]}")


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for name, spec in MODELS.items():
        build(name, spec)


if __name__ == "__main__":
    main()
