#!/usr/bin/env python3
"""Whole-model reference from HF transformers' MixtralForCausalLM for Loom's MoE tests.

A tiny Mixtral (hidden 64, 4 heads / 2 kv heads, ffn 48, 4 experts, top-2, 2 layers,
vocab 257, router_aux_loss_coef 0.02, no jitter) is built in fp32 on the CPU with a fixed
seed, and run on one batch with output_router_logits=True:

    loss = cross_entropy(logits, targets) + router_aux_loss_coef * aux

where aux is transformers' load_balancing_loss_func over both layers' router logits
(outputs.aux_loss). Every parameter's gradient of that loss is recorded.

Written under tests/golden/mixtral/:
  hf/config.json, hf/model.safetensors   the model in HF's checkpoint names (per-expert
                                          block_sparse_moe.experts.E.w1/w2/w3), fp32;
                                          the script checks that from_pretrained reloads
                                          it to the same logits
  reference.safetensors
    input_ids I32 [2, 17], targets I32 [2, 17]   seq[:, :17] and seq[:, 1:] of a random seq [2, 18]
    logits [2, 17, 257]
    lm_loss [1]     mean cross-entropy over the 34 positions
    aux_loss [1]    outputs.aux_loss (unweighted)
    loss [1]        lm_loss + 0.02 * aux_loss
    grad.<name>     gradient of loss for every parameter (HF checkpoint names and shapes)
  reference.json    config, versions, values, tokens per expert, the closest top-k margin

Run from the repository root:  python3 tests/golden/make_mixtral_model_golden.py
fp32, CPU, one thread, deterministic: a rerun with the same versions reproduces the files.
"""
import json
import os
import sys

import safetensors
import torch
import transformers
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "mixtral")

CONFIG = dict(hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=257,
              max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e6, hidden_act="silu",
              router_aux_loss_coef=0.02, router_jitter_noise=0.0, output_router_logits=True,
              tie_word_embeddings=False, sliding_window=None)
SEED = 9090
BATCH, SEQ = 2, 17
INIT_STD = 0.05    # every matrix but the routers
ROUTER_STD = 0.5   # routers: far from uniform, so no top-k choice is near a tie


def moe_block(layer):
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def canonical_state(model, E, f):
    """name -> tensor (weights or their .grad via `pick`) in HF checkpoint names, per-expert experts."""
    def collect(pick):
        out = {}
        for name, p in model.named_parameters():
            if ".experts." in name and (name.endswith("gate_up_proj") or name.endswith("down_proj")):
                continue
            if ".mlp.gate." in name:
                name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[name] = pick(p)
        for l, layer in enumerate(model.model.layers):
            ex = moe_block(layer).experts
            pre = f"model.layers.{l}.block_sparse_moe.experts"
            if hasattr(ex, "gate_up_proj"):  # transformers 5: stacked [E, 2f, h] = [w1; w3], [E, h, f] = w2
                gu, dn = pick(ex.gate_up_proj), pick(ex.down_proj)
                for e in range(E):
                    out[f"{pre}.{e}.w1.weight"] = gu[e, :f]
                    out[f"{pre}.{e}.w2.weight"] = dn[e]
                    out[f"{pre}.{e}.w3.weight"] = gu[e, f:]
            else:
                for e in range(E):
                    for n in ("w1", "w2", "w3"):
                        out[f"{pre}.{e}.{n}.weight"] = pick(getattr(ex[e], n).weight)
        # module_list names (transformers 4) come out of named_parameters already
        return {n: v.detach().float().contiguous().clone() for n, v in out.items()
                if not (n.endswith("gate_up_proj") or n.endswith("down_proj"))}
    return collect


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    cfg = MixtralConfig(**CONFIG)
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": CONFIG["rope_theta"]}
    cfg._attn_implementation = "eager"
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    model = MixtralForCausalLM(cfg).float()
    model.train()  # as in training (jitter is 0); no dropout in Mixtral at these settings
    E, k, f = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".gate.weight"):
                p.normal_(0.0, ROUTER_STD)
            else:
                p.normal_(0.0, INIT_STD)

    g = torch.Generator().manual_seed(SEED + 1)
    seq = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    input_ids, targets = seq[:, :SEQ], seq[:, 1:]
    out = model(input_ids=input_ids, output_router_logits=True)
    logits = out.logits
    lm_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    aux = out.aux_loss
    loss = lm_loss + cfg.router_aux_loss_coef * aux
    model.zero_grad(set_to_none=True)
    loss.backward()

    collect = canonical_state(model, E, f)
    weights = collect(lambda p: p)
    grads = collect(lambda p: p.grad)

    # Routing facts for the docs and the tolerance argument.
    router_logits = torch.cat([r.reshape(-1, E) for r in out.router_logits], dim=0).detach()
    probs = torch.softmax(router_logits, dim=-1)
    srt = torch.sort(probs, dim=-1, descending=True).values
    margin = (srt[:, k - 1] - srt[:, k]).min().item()
    counts = torch.bincount(torch.topk(probs, k, dim=-1).indices.reshape(-1), minlength=E).tolist()

    hf_dir = os.path.join(OUT, "hf")
    os.makedirs(hf_dir, exist_ok=True)
    save_file(weights, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    conf.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "dtype": "float32",
                 "torch_dtype": "float32", "rope_theta": CONFIG["rope_theta"]})
    conf.pop("_attn_implementation", None)
    conf.pop("_experts_implementation", None)
    with open(os.path.join(hf_dir, "config.json"), "w") as fh:
        json.dump(conf, fh, indent=2, sort_keys=True)
        fh.write("\n")

    # The folder must be what transformers itself loads: same logits.
    back = MixtralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float()
    with torch.no_grad():
        again = back(input_ids=input_ids).logits
    reload_err = (again - logits.detach()).abs().max().item()
    assert reload_err == 0.0, f"from_pretrained of {hf_dir} changes the logits by {reload_err}"

    t = {"input_ids": input_ids.to(torch.int32).contiguous(), "targets": targets.to(torch.int32).contiguous(),
         "logits": logits.detach().contiguous(), "lm_loss": lm_loss.detach().reshape(1),
         "aux_loss": aux.detach().reshape(1), "loss": loss.detach().reshape(1)}
    for n, v in grads.items():
        t["grad." + n] = v
    save_file(t, os.path.join(OUT, "reference.safetensors"))

    ref = {
        "generator": "tests/golden/make_mixtral_model_golden.py",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__},
        "seed": SEED,
        "config": dict(CONFIG, attn_implementation="eager", dtype="float32", device="cpu"),
        "init": f"matrices ~ normal(0, {INIT_STD}), routers ~ normal(0, {ROUTER_STD}), norm gains 1 + 0.1 normal",
        "loss": "cross_entropy(logits, targets) + router_aux_loss_coef * outputs.aux_loss",
        "values": {"loss": loss.item(), "lm_loss": lm_loss.item(), "aux_loss": aux.item(),
                   "tokens_per_expert_both_layers": counts, "min_topk_margin": margin,
                   "from_pretrained_max_logit_change": reload_err},
        "shapes": {n: list(v.shape) for n, v in t.items()},
    }
    with open(os.path.join(OUT, "reference.json"), "w") as fh:
        json.dump(ref, fh, indent=2)
        fh.write("\n")
    print(f"loss {loss.item():.6f} lm {lm_loss.item():.6f} aux {aux.item():.6f} tokens/expert {counts} "
          f"min top-k margin {margin:.3g}; {len(grads)} gradients")


if __name__ == "__main__":
    main()
