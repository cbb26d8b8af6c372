#!/usr/bin/env python3
"""The PyTorch peer: HF transformers LlamaForCausalLM on the same model, batch,
sequence and random tokens as a Loom bench config.

Modes (--modes, comma-separated):
  pure        params, grads and AdamW state in bf16 (the seeds' single-GPU recipe)
  autocast    fp32 params and AdamW state, bf16 autocast for compute
  pure+compile, autocast+compile   the same under torch.compile
  float8+compile   pure bf16 with every linear but the LM head converted by
              torchao's convert_to_float8_training, tensorwise scaling (the
              float8 path torchtitan uses), under torch.compile; "float8"
              without compile. torchao must be importable (the GPU check
              installs it from a carried wheel, scripts/gpu_check.sh).
  float8-rowwise+compile, float8-rowwise   the same with torchao's "rowwise"
              recipe (per-row scales along the contracted dim, power-of-two
              scales): the peer of examples/plugins/fp8_rowwise.
All use SDPA attention and fused AdamW. Prints one JSON line per mode
(prefixed PEER_JSON) with the median step time over --steps after --warmup,
tokens/s, MFU (docs/ARCHITECTURE.md "MFU": 6N + 12LhS flops per token over 989 TFLOP/s) and peak
memory (torch.cuda.max_memory_allocated / max_memory_reserved).
"""
import argparse
import json
import statistics
import sys
import time
import tomllib


def model_from_config(path):
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    m, t = cfg["model"], cfg["train"]
    return dict(
        hidden=m["hidden"], layers=m["num_layers"], heads=m["num_heads"],
        kv_heads=m.get("num_kv_heads", m["num_heads"]), ffn=m["ffn_hidden"],
        vocab=m["vocab_size"], tied=m.get("tied_embeddings", False),
        rope_theta=m.get("rope_theta", 10000.0), norm_eps=m.get("norm_eps", 1e-5),
        batch=t["micro_batch"], seq=t["seq_len"], grad_accum=t.get("grad_accum", 1), lr=t.get("lr", 3e-4),
        weight_decay=t.get("weight_decay", 0.1), beta1=t.get("beta1", 0.9), beta2=t.get("beta2", 0.95))


def matmul_params(c):
    """N of the MFU formula (docs/ARCHITECTURE.md "MFU"): the matmul weights, LM head included, input embedding excluded."""
    h, L = c["hidden"], c["layers"]
    q = h
    kv = c["kv_heads"] * (h // c["heads"])
    layer = h * q + 2 * h * kv + q * h + 3 * h * c["ffn"]
    return L * layer + c["vocab"] * h


def flops_per_token(c):
    """What MFU counts (docs/ARCHITECTURE.md "MFU"): 6N + 12LhS, attention as if it were not causal."""
    return 6 * matmul_params(c) + 12 * c["layers"] * c["hidden"] * c["seq"]


def causal_flops_per_token(c):
    """NeMo / Megatron's model TFLOP/s count: causal attention, 6N + 6LhS."""
    return 6 * matmul_params(c) + 6 * c["layers"] * c["hidden"] * c["seq"]


def llama_config(c):
    """The HF LlamaConfig of a model_from_config dict (SDPA attention, no KV cache)."""
    from transformers import LlamaConfig
    return LlamaConfig(
        hidden_size=c["hidden"], num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], intermediate_size=c["ffn"], vocab_size=c["vocab"],
        max_position_embeddings=max(c["seq"], 2048), rope_theta=c["rope_theta"], rms_norm_eps=c["norm_eps"],
        tie_word_embeddings=c["tied"], attn_implementation="sdpa", use_cache=False)


def adamw_param_groups(model, c):
    """AdamW groups: weight decay on the >=2-D parameters (matrices, embeddings), none on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": c["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]


def time_steps(c, step, steps, warmup, flops):
    """Calls step() `warmup` times, then times `steps` calls with CUDA events:
    the measured part of a PEER_JSON row (median, min and max step ms,
    tokens/s, MFU at `flops` per token over 989 TFLOP/s, peak memory, the
    last step's loss). step() returns the loss."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    loss = None
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    med = statistics.median(times)
    tok_s = c["batch"] * c["seq"] / (med * 1e-3)
    return dict(median_step_ms=med, min_step_ms=min(times), max_step_ms=max(times), tokens_per_s=tok_s,
                mfu=flops * tok_s / 989e12, peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30, final_loss=float(loss.detach()),
                torch=torch.__version__, device=torch.cuda.get_device_name())


def float8_convert(model, fsdp_float8_all_gather=False, recipe="tensorwise"):
    """torchao float8 training, tensorwise (or `recipe`) scaling, on every decoder linear; the
    LM head stays in bf16 (as torchtitan and Loom's FP8 recipes keep it). With
    fsdp_float8_all_gather (torchtitan's recipe under FSDP2), FSDP2 gathers the
    weights as float8 (call torchao's precompute_float8_dynamic_scale_for_fsdp
    after every optimizer step)."""
    import dataclasses

    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = []

    def keep(mod, fqn):
        ok = fqn != "lm_head" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
        if ok:
            converted.append(fqn)
        return ok

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if not converted:
        raise RuntimeError("torchao converted no linear to float8")
    return dict(torchao=torchao.__version__, float8_recipe=recipe, float8_linears=len(converted),
                float8_all_gather=fsdp_float8_all_gather)


def run_mode(c, mode, steps, warmup, seed):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    torch.cuda.reset_peak_memory_stats()
    float8 = mode.startswith("float8")
    pure = mode.startswith("pure") or float8
    compiled = mode.endswith("+compile")
    conf = llama_config(c)
    dtype = torch.bfloat16 if pure else torch.float32
    model = LlamaForCausalLM(conf).to(device="cuda", dtype=dtype)
    model.train()
    extra = {}
    if float8:
        extra = float8_convert(model, recipe="rowwise" if mode.startswith("float8-rowwise") else "tensorwise")
    opt = torch.optim.AdamW(adamw_param_groups(model, c), lr=c["lr"], betas=(c["beta1"], c["beta2"]),
                            eps=1e-8, fused=True)
    step_fn_model = torch.compile(model) if compiled else model
    g = torch.Generator(device="cuda").manual_seed(seed)

    def step():
        ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device="cuda", generator=g)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not pure):
            logits = step_fn_model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, c["vocab"]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    out = dict(peer="hf_transformers", mode=mode, **time_steps(c, step, steps, warmup, flops_per_token(c)), **extra)
    del model, opt, step_fn_model
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a Loom TOML config (model and batch are read from it)")
    ap.add_argument("--modes", default="pure,autocast,pure+compile,autocast+compile")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    c = model_from_config(a.config)
    import transformers
    for mode in a.modes.split(","):
        if mode not in ("pure", "autocast", "pure+compile", "autocast+compile", "float8", "float8+compile",
                        "float8-rowwise", "float8-rowwise+compile"):
            sys.exit(f"hf_llama.py: unknown mode {mode!r}")
        try:
            r = run_mode(c, mode, a.steps, a.warmup, a.seed)
        except Exception as e:  # e.g. out of memory: report it as a row, keep going
            import torch
            torch.cuda.empty_cache()
            r = dict(peer="hf_transformers", mode=mode, error=f"{type(e).__name__}: {str(e)[:200]}")
        r.update(config=a.config, transformers=transformers.__version__)
        print("PEER_JSON " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
