#!/usr/bin/env python3
"""Reference data from HF transformers' Mixtral sparse MoE block for Loom's MoE tests.

A tiny MixtralForCausalLM (hidden 48, ffn 88, 4 experts, top-2, 2 layers, GQA 6/2 heads,
vocab 300) is built with a fixed seed; layer 0's sparse MoE block (`block_sparse_moe`,
`mlp` in transformers 5) is run in fp32 on random hidden states [2, 33, 48], and the
loss
    loss = sum(output * projection) + router_aux_loss_coef * aux
is differentiated, where `projection` is a fixed random tensor of the output's shape
and aux is transformers' load_balancing_loss_func over this block's router logits.

Written under tests/golden/mixtral_moe/:
  reference.safetensors   (tensor names below, canonical HF checkpoint names for weights)
    hidden_states [2, 33, h]     the block's input
    gate.weight [E, h]           the router
    experts.E.w1.weight [f, h]   gate projection of expert E (HF checkpoint names; transformers 5
    experts.E.w2.weight [h, f]   keeps the experts stacked as experts.gate_up_proj [E, 2f, h] =
    experts.E.w3.weight [f, h]   [w1; w3] per expert and experts.down_proj [E, h, f] = w2, and
                                 converts at load time: this file holds the per-expert form)
    router_logits [N, E]         N = 66 tokens
    router_probs [N, E]          softmax(router_logits) in fp32
    selected_experts I32 [N, k]  torch.topk of the probs (descending)
    routing_weights [N, k]       the k probs renormalised to sum to 1
    output [2, 33, h]            the block's output
    aux_loss [1]                 load_balancing_loss_func((router_logits,), E, k)
    projection [2, 33, h], loss [1]
    grad.hidden_states, grad.gate.weight, grad.experts.E.w{1,2,3}.weight
    layer1.gate.weight, layer1.router_logits   layer 1's router on the same hidden states
    aux_loss_two_layers [1]      load_balancing_loss_func over both layers' logits
    aux_grad.hidden_states, aux_grad.gate.weight   gradients of aux alone (coefficient 1)
  reference.json           shapes, versions, hyper-parameters, torch.topk's choices on ties

Run from the repository root:  python3 tests/golden/make_mixtral_golden.py
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
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "mixtral_moe")

CONFIG = dict(hidden_size=48, intermediate_size=88, num_local_experts=4, num_experts_per_tok=2,
              num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, vocab_size=300,
              max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e6, hidden_act="silu",
              router_aux_loss_coef=0.02, router_jitter_noise=0.0, output_router_logits=True,
              tie_word_embeddings=False)
SEED = 4242
BATCH, SEQ = 2, 33
INIT_STD = 0.3  # large enough that the routing is far from uniform (the top-k is not a near tie)


def moe_block(layer):
    # transformers 4 names it block_sparse_moe, transformers 5 mlp.
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def expert_weights(block, E, f):
    """Per-expert (w1, w2, w3) views in HF checkpoint layout, whichever way transformers stores them."""
    ex = block.experts
    if hasattr(ex, "gate_up_proj"):  # transformers 5: stacked [E, 2f, h] (gate rows first) and [E, h, f]
        assert tuple(ex.gate_up_proj.shape[:2]) == (E, 2 * f), ex.gate_up_proj.shape
        return [(ex.gate_up_proj[e, :f], ex.down_proj[e], ex.gate_up_proj[e, f:]) for e in range(E)], "stacked"
    return [(ex[e].w1.weight, ex[e].w2.weight, ex[e].w3.weight) for e in range(E)], "module_list"


def expert_grads(block, E, f):
    ex = block.experts
    if hasattr(ex, "gate_up_proj"):
        g, d = ex.gate_up_proj.grad, ex.down_proj.grad
        return [(g[e, :f], d[e], g[e, f:]) for e in range(E)]
    return [(ex[e].w1.weight.grad, ex[e].w2.weight.grad, ex[e].w3.weight.grad) for e in range(E)]


def router_of(block):
    gate = block.gate
    return gate.weight


def run_block(block, x):
    """(output, router_logits): transformers 4 returns both; 5 returns the output and
    exposes the logits as the gate's first output, caught here with a hook."""
    caught = []
    handle = block.gate.register_forward_hook(lambda m, i, o: caught.append(o[0] if isinstance(o, tuple) else o))
    try:
        out = block(x)
    finally:
        handle.remove()
    if isinstance(out, tuple):
        out, logits = out[0], out[1]
    else:
        logits = caught[0]
    return out, logits.reshape(-1, logits.shape[-1])


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    cfg = MixtralConfig(**CONFIG)
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": CONFIG["rope_theta"]}
    cfg._attn_implementation = "eager"
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"  # the reference loop over experts, not grouped_mm
    model = MixtralForCausalLM(cfg).float()
    model.train()  # jitter would apply only in training; it is 0 here
    E, k, h, f = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, INIT_STD) if p.dim() >= 2 else p.fill_(1.0)

    block0, block1 = moe_block(model.model.layers[0]), moe_block(model.model.layers[1])
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(BATCH, SEQ, h, generator=g).requires_grad_(True)
    proj = torch.randn(BATCH, SEQ, h, generator=g)

    out, logits = run_block(block0, x.clone())  # clone: HF's jitter would scale its input in place
    aux = load_balancing_loss_func((logits,), E, k)
    loss = (out * proj).sum() + cfg.router_aux_loss_coef * aux
    # The aux loss's own gradients: inside `loss` they are small beside the
    # projection's, so they get their own check.
    aux_gx, aux_gw = torch.autograd.grad(aux, [x, router_of(block0)], retain_graph=True)
    model.zero_grad(set_to_none=True)
    loss.backward()

    probs = torch.softmax(logits.detach(), dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    # The second layer's router alone, on the same input: the aux loss over two layers.
    with torch.no_grad():
        _, logits1 = run_block(block1, x.detach().clone())
        aux2 = load_balancing_loss_func((logits.detach(), logits1), E, k)
    # torch.topk on equal values: which indices it returns. On the CPU this is an
    # artifact of its selection algorithm (e.g. [0.1, 0.3, 0.3, 0.3], k=2 -> [2, 3]),
    # not lowest index first, so Loom cannot promise HF's choice on exact ties and
    # takes the lower index; the cases are recorded for the tests and the docs.
    tie_cases = [([0.1, 0.3, 0.3, 0.3], 2), ([0.25, 0.25, 0.25, 0.25], 2), ([0.3, 0.3, 0.3, 0.1], 2),
                 ([0.125] * 8, 2), ([0.2, 0.2, 0.1, 0.5], 2)]
    ties = [{"probs": p_, "k": k_, "torch_indices": torch.topk(torch.tensor(p_), k_).indices.tolist()}
            for p_, k_ in tie_cases]

    ws, layout = expert_weights(block0, E, f)
    gs = expert_grads(block0, E, f)
    t = {
        "hidden_states": x.detach(),
        "gate.weight": router_of(block0).detach(),
        "router_logits": logits.detach(),
        "router_probs": probs,
        "selected_experts": top_i.to(torch.int32),
        "routing_weights": top_w,
        "output": out.detach(),
        "aux_loss": aux.detach().reshape(1),
        "projection": proj,
        "loss": loss.detach().reshape(1),
        "grad.hidden_states": x.grad,
        "grad.gate.weight": router_of(block0).grad,
        "layer1.gate.weight": router_of(block1).detach(),
        "layer1.router_logits": logits1,
        "aux_loss_two_layers": aux2.reshape(1),
        "aux_grad.hidden_states": aux_gx,
        "aux_grad.gate.weight": aux_gw,
    }
    for e in range(E):
        for name, w, gr in zip(("w1", "w2", "w3"), ws[e], gs[e]):
            t[f"experts.{e}.{name}.weight"] = w.detach()
            t[f"grad.experts.{e}.{name}.weight"] = gr
    t = {n: v.detach().float().contiguous().clone() if v.is_floating_point() else v.contiguous().clone()
         for n, v in t.items()}
    # The selected experts must reproduce the block's own routing (HF's router computes them too).
    canonical = {f"experts.{e}.{n}.weight": list(t[f"experts.{e}.{n}.weight"].shape)
                 for e in range(E) for n in ("w1", "w2", "w3")}
    # One metadata key: safetensors writes several in a random order, and the
    # file should reproduce byte for byte.
    meta = {"mixtral_moe": json.dumps({
        "canonical_expert_names": canonical, "expert_layout_in_transformers": layout,
        "stacked_form": "experts.gate_up_proj [E, 2f, h] = [w1; w3] per expert, experts.down_proj [E, h, f] = w2"},
        sort_keys=True)}
    os.makedirs(OUT, exist_ok=True)
    save_file(t, os.path.join(OUT, "reference.safetensors"), metadata=meta)

    counts = torch.bincount(top_i.reshape(-1), minlength=E).tolist()
    margin = (torch.sort(probs, dim=-1, descending=True).values[:, k - 1]
              - torch.sort(probs, dim=-1, descending=True).values[:, k]).min().item()
    ref = {
        "generator": "tests/golden/make_mixtral_golden.py",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__},
        "seed": SEED,
        "config": dict(CONFIG, attn_implementation="eager", dtype="float32", device="cpu"),
        "init": f"every matrix ~ normal(0, {INIT_STD}), norm gains 1",
        "block": "model.model.layers[0] sparse MoE block (block_sparse_moe / mlp), train mode",
        "expert_layout_in_transformers": layout,
        "canonical_expert_names": canonical,
        "batch": {"batch": BATCH, "seq": SEQ, "hidden_states": "randn(2, 33, h)", "projection": "randn(2, 33, h)"},
        "loss": "sum(output * projection) + router_aux_loss_coef * load_balancing_loss_func((router_logits,), E, k)",
        "values": {"loss": loss.item(), "aux_loss": aux.item(), "aux_loss_two_layers": aux2.item(),
                   "tokens_per_expert": counts, "min_topk_margin": margin},
        "topk_ties": {"note": "torch.topk's choice among equal values on the CPU (not lowest index first); "
                               "the golden's routing has no ties (min_topk_margin)", "cases": ties},
        "shapes": {n: list(v.shape) for n, v in t.items()},
    }
    with open(os.path.join(OUT, "reference.json"), "w") as fh:
        json.dump(ref, fh, indent=2)
        fh.write("\n")
    print(f"loss {loss.item():.6f} aux {aux.item():.6f} aux(2 layers) {aux2.item():.6f} "
          f"tokens/expert {counts} min top-k margin {margin:.3g} ({layout})")
    for c in ties:
        print(f"torch.topk ties: {c['probs']} k={c['k']} -> {c['torch_indices']}")


if __name__ == "__main__":
    main()
