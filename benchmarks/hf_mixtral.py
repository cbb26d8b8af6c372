#!/usr/bin/env python3
"""The PyTorch peer for mixture-of-experts configs (model.ffn = "moe"): HF
transformers MixtralForCausalLM of the same shape, batch, sequence and random
tokens as a Loom bench config. benchmarks/compare.sh runs it for configs whose
model.ffn is "moe" (hf_llama.py for the others).

The experts run through transformers' `grouped_mm` experts implementation
(one grouped GEMM per expert matrix over all experts, torch.nn.functional.
grouped_mm / torch._grouped_mm) where this transformers version has
`experts_implementation`; otherwise its default, and the row says which
(`experts_implementation`). The loss is HF's training objective with
output_router_logits: cross-entropy + router_aux_loss_coef x the load-balancing
loss, as Loom optimises. Router jitter is off on both sides unless the config
sets it.

Modes (--modes, comma-separated), as hf_llama.py:
  pure        params, grads and AdamW state in bf16 (Loom's bf16_pure)
  autocast    fp32 params and AdamW state, bf16 autocast for compute
  pure+compile, autocast+compile   the same under torch.compile
Default: pure,pure+compile. Prints one JSON line per mode (prefixed PEER_JSON)
with the median step time over --steps after --warmup, tokens/s, MFU over the
active parameters (6 N_active + 12 L h S flops per token over 989 TFLOP/s: the
router and top_k experts per layer, as `loom bench` counts them) and peak
memory.
"""
import argparse
import json
import os
import sys
import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_llama import adamw_param_groups, time_steps  # noqa: E402


def model_from_config(path):
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    m, t = cfg["model"], cfg["train"]
    if m.get("ffn", "dense") != "moe":
        sys.exit(f"hf_mixtral.py: {path} has model.ffn = {m.get('ffn', 'dense')!r}, not \"moe\" (use hf_llama.py)")
    return dict(
        hidden=m["hidden"], layers=m["num_layers"], heads=m["num_heads"],
        kv_heads=m.get("num_kv_heads", m["num_heads"]), ffn=m["ffn_hidden"],
        vocab=m["vocab_size"], tied=m.get("tied_embeddings", False),
        rope_theta=m.get("rope_theta", 10000.0), norm_eps=m.get("norm_eps", 1e-5),
        experts=m["num_experts"], top_k=m["top_k"], aux_coef=m.get("router_aux_loss_coef", 0.02),
        jitter=m.get("router_jitter_noise", 0.0),
        batch=t["micro_batch"], seq=t["seq_len"], lr=t.get("lr", 3e-4),
        weight_decay=t.get("weight_decay", 0.1), beta1=t.get("beta1", 0.9), beta2=t.get("beta2", 0.95))


def flops_per_token(c):
    """6 N_active + 12 L h S: attention, the router and top_k experts per layer, the lm head."""
    h, L, S = c["hidden"], c["layers"], c["seq"]
    q = h
    kv = c["kv_heads"] * (h // c["heads"])
    layer = h * q + 2 * h * kv + q * h + c["experts"] * h + c["top_k"] * 3 * h * c["ffn"]
    n = L * layer + c["vocab"] * h
    return 6 * n + 12 * L * h * S


def mixtral_config(c, experts_impl):
    from transformers import MixtralConfig
    kw = dict(
        hidden_size=c["hidden"], num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], intermediate_size=c["ffn"], vocab_size=c["vocab"],
        num_local_experts=c["experts"], num_experts_per_tok=c["top_k"], router_aux_loss_coef=c["aux_coef"],
        router_jitter_noise=c["jitter"], output_router_logits=True,
        max_position_embeddings=max(c["seq"], 2048), rope_theta=c["rope_theta"], rms_norm_eps=c["norm_eps"],
        tie_word_embeddings=c["tied"], attn_implementation="sdpa", use_cache=False, sliding_window=None)
    if experts_impl:
        kw["experts_implementation"] = experts_impl
    return MixtralConfig(**kw)


def build_model(c, dtype, experts_impl):
    """MixtralForCausalLM with the requested experts implementation, or transformers' default where this
    version has no experts_implementation (returns the model and the implementation it runs)."""
    from transformers import MixtralForCausalLM
    if experts_impl:
        try:
            model = MixtralForCausalLM(mixtral_config(c, experts_impl))
            impl = getattr(model.config, "_experts_implementation", None)
            if impl is not None:
                return model.to(device="cuda", dtype=dtype), impl
        except (TypeError, ValueError) as e:
            print(f"hf_mixtral.py: experts_implementation={experts_impl!r} refused ({e}); using the default",
                  file=sys.stderr)
    model = MixtralForCausalLM(mixtral_config(c, None))
    return model.to(device="cuda", dtype=dtype), getattr(model.config, "_experts_implementation", None) or "eager"


def run_mode(c, mode, steps, warmup, seed, experts_impl):
    import torch

    torch.manual_seed(seed)
    torch.cuda.reset_peak_memory_stats()
    pure = mode.startswith("pure")
    compiled = mode.endswith("+compile")
    dtype = torch.bfloat16 if pure else torch.float32
    model, impl = build_model(c, dtype, experts_impl)
    model.train()
    opt = torch.optim.AdamW(adamw_param_groups(model, c), lr=c["lr"], betas=(c["beta1"], c["beta2"]),
                            eps=1e-8, fused=True)
    step_fn_model = torch.compile(model) if compiled else model
    g = torch.Generator(device="cuda").manual_seed(seed)

    def step():
        ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device="cuda", generator=g)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not pure):
            out = step_fn_model(input_ids=inputs, output_router_logits=True)
        lm = torch.nn.functional.cross_entropy(out.logits.float().view(-1, c["vocab"]), targets.reshape(-1))
        loss = lm + c["aux_coef"] * out.aux_loss.float()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return lm

    out = dict(peer="hf_transformers", model="MixtralForCausalLM", experts_implementation=impl, mode=mode,
               **time_steps(c, step, steps, warmup, flops_per_token(c)))
    del model, opt, step_fn_model
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a Loom TOML config with model.ffn = \"moe\" (model and batch are read from it)")
    ap.add_argument("--modes", default="pure,pure+compile")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--experts-implementation", default="grouped_mm",
                    help="transformers' experts_implementation (grouped_mm, batched_mm, eager); '' for the default")
    a = ap.parse_args()
    c = model_from_config(a.config)
    import transformers
    for mode in a.modes.split(","):
        if mode not in ("pure", "autocast", "pure+compile", "autocast+compile"):
            sys.exit(f"hf_mixtral.py: unknown mode {mode!r}")
        try:
            r = run_mode(c, mode, a.steps, a.warmup, a.seed, a.experts_implementation)
        except Exception as e:  # e.g. out of memory: report it as a row, keep going
            import torch
            torch.cuda.empty_cache()
            r = dict(peer="hf_transformers", model="MixtralForCausalLM", mode=mode,
                     error=f"{type(e).__name__}: {str(e)[:200]}")
        r.update(config=a.config, transformers=transformers.__version__)
        print("PEER_JSON " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
