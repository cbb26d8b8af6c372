#!/usr/bin/env python3
"""PyTorch's fused causal attention at one shape, forward and backward, each
backend alone: the peer for the attention rows of `loom bench --breakdown`
(attention.forward / attention.backward, summed over the layers of a step).

  python3 benchmarks/attention_peer.py [--seq 8192] [--heads 32] [--kv-heads 8] [--head-dim 128] [--batch 1]

Q, K and V are bf16 in the [batch, seq, heads, head_dim] layout that Loom's
fused QKV GEMM writes (strided views of one packed buffer), so the backends
see the strides Loom's cuDNN graph sees. Times are CUDA-event medians of
--iters calls after --warmup, forward alone and backward alone (the backward
from a retained graph), with the model TFLOP/s of a causal pass (half of the
full 4 * b * s^2 * h * d for the forward, 2.5 times that for the backward).
Each backend is timed twice: alone, and after a bf16 GEMM of a Llama-3-8B
gate/up projection (8192 x 28672 x 4096) before every call, as inside a
training step, where the GPU runs at the clocks its GEMMs leave it.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup, iters, before=None):
    """Median ms of fn over `iters` calls. With `before`, each call follows that
    (untimed) work on the stream, with no host sync in between: the GPU's
    clocks and caches as a training step leaves them, not as an idle loop does."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        a.record()
        fn()
        b.record()
        events.append((a, b))
        if before is None:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    b, s, h, kv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    torch.manual_seed(0)
    # One packed [b, s, (h + 2 kv) d] buffer, as the fused QKV GEMM writes it.
    qkv = torch.randn(b, s, (h + 2 * kv) * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    # SDPA takes [b, heads, s, d]: transposed views of the packed rows.
    q = q.view(b, s, h, d).transpose(1, 2).detach().requires_grad_()
    k = k.view(b, s, kv, d).transpose(1, 2).detach().requires_grad_()
    v = v.view(b, s, kv, d).transpose(1, 2).detach().requires_grad_()
    fwd_flops = 4.0 * b * s * s * h * d / 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"b {b} s {s} heads {h}/{kv} d {d}, causal, bf16")
    # K and V repeated to every query head: for a backend without grouped
    # heads (the same FLOPs; more memory traffic than a native GQA kernel).
    kx = k.detach().repeat_interleave(h // kv, dim=1).requires_grad_()
    vx = v.detach().repeat_interleave(h // kv, dim=1).requires_grad_()
    cases = [("cudnn", SDPBackend.CUDNN_ATTENTION, k, v, True), ("flash", SDPBackend.FLASH_ATTENTION, k, v, True),
             ("cudnn, K/V repeated", SDPBackend.CUDNN_ATTENTION, kx, vx, False),
             ("flash, K/V repeated", SDPBackend.FLASH_ATTENTION, kx, vx, False)]
    x = torch.randn(b * s, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)

    def gemm():
        torch.matmul(x, w.t())

    for name, backend, kk, vv, gqa in cases:
        for company, before in (("alone", None), ("after a GEMM", gemm)):
            try:
                with sdpa_kernel([backend]):
                    def fwd():
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                    f_ms = timed(fwd, a.warmup, a.iters, before)
                    o = fwd()
                    do = torch.randn_like(o)

                    def bwd():
                        torch.autograd.grad(o, (q, kk, vv), do, retain_graph=True)
                    b_ms = timed(bwd, a.warmup, a.iters, before)
            except RuntimeError as e:
                print(f"{name}: not available here ({str(e).splitlines()[0]})")
                break
            row = {"backend": name, "company": company, "forward_ms": f_ms, "backward_ms": b_ms,
                   "forward_tflops": fwd_flops / f_ms / 1e9, "backward_tflops": 2.5 * fwd_flops / b_ms / 1e9}
            print(f"{name:20s} {company:12s} forward {f_ms:.3f} ms ({row['forward_tflops']:.0f} TFLOP/s)  "
                  f"backward {b_ms:.3f} ms ({row['backward_tflops']:.0f} TFLOP/s)")
            print("ATTN_JSON " + json.dumps(row))


if __name__ == "__main__":
    main()
