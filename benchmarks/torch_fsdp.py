#!/usr/bin/env python3
"""The multi-GPU PyTorch peer: HF transformers LlamaForCausalLM under PyTorch FSDP2
(the composable `fully_shard`), on the same model, per-GPU micro batch, sequence
length and random tokens as a Loom config.

Run one process per GPU with torchrun, e.g. on a 2-GPU box:

  torchrun --standalone --nproc_per_node=2 benchmarks/torch_fsdp.py configs/bench/llama-1b.toml
  torchrun --standalone --nproc_per_node=8 benchmarks/torch_fsdp.py CONFIG --mode hsdp --shard-group-size 4
  torchrun --standalone --nproc_per_node=2 benchmarks/torch_fsdp.py /tmp/tiny.toml --device cpu --steps 3 --warmup 1
  torchrun --standalone --nproc_per_node=4 benchmarks/torch_fsdp.py configs/bench/llama3-8b-8k.toml \
      --compile --ac selective-op [--float8]     (the node workload: torchtitan's Llama 3 8B recipe)

(Started without torchrun it runs as a world of one.)

What it does, per rank: builds the model in fp32 from [model] of the config (the same
seed on every rank, so every rank holds the same weights before sharding), calls
fully_shard on each LlamaDecoderLayer and then on the root model (the usual FSDP2
recipe) with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32
sharded parameters, gradients and AdamW state, bf16 compute, fp32 gradient
reduce-scatter. SDPA attention; AdamW (fused where this torch allows it, else
foreach) with lr, betas and weight decay from [train], decay on the >=2-D
parameters only; global-norm clipping at 1.0 — all as benchmarks/hf_llama.py does
on one GPU. Each step runs grad_accum micro-batches ([train] grad_accum, or
--grad-accum), each drawing [micro_batch, seq_len + 1] random tokens (the
generator seeded with seed + rank, so rank 0 sees hf_llama.py's tokens), taking
next-token cross-entropy on the fp32 logits over grad_accum and its backward
(FSDP2 reduce-scatters every micro-batch's gradients, as torchtitan runs it);
then clip, AdamW step.

torchtitan's recipe for Llama 3 8B (what --float8 --ac selective-op --compile
runs): --float8 converts every decoder linear with torchao's tensorwise float8
(Float8LinearConfig with enable_fsdp_float8_all_gather: FSDP2 gathers the
weights in float8) and calls precompute_float8_dynamic_scale_for_fsdp after each
optimizer step; --ac wraps each decoder layer in activation checkpointing
(selective-op: torchtitan's per-op selective AC, which saves the outputs of
every other matmul, of attention and of the float8 amax reductions and
recomputes the rest; full: the whole layer); the order is torchtitan's: float8,
AC, compile, fully_shard.

What it measures: the step time of --steps steps after --warmup, each timed with
CUDA events (time.perf_counter with --device cpu) on every rank; a step's time is
the slowest rank's, and the reported figure the median over the timed steps.
tokens_per_s is the whole world's (world * grad_accum * micro_batch * seq_len /
step), tokens_per_s_per_gpu one GPU's; MFU is hf_llama.py's (6N + 12LhS flops per
token over 989 TFLOP/s) on the per-GPU rate, model_tflops the per-GPU model
TFLOP/s as NeMo counts them (causal attention: 6N + 6LhS a token). Peak memory is torch.cuda's
max_memory_allocated / max_memory_reserved from after sharding to the end (the
one-off full-model build before sharding is left out), the largest over ranks.
Rank 0 prints one line `PEER_JSON {...}` in hf_llama.py's keys (mode,
median_step_ms, tokens_per_s, mfu, peak_alloc_gib, peak_reserved_gib, ...) plus
strategy, world, mesh, tokens_per_s_per_gpu, the byte counts of peak memory and
losses (the mean over ranks of every step's loss, warm-up steps first).

Flags:
  CONFIG                       a Loom TOML config: [model] hidden, num_layers, num_heads,
                               (num_kv_heads), ffn_hidden, vocab_size; [train] micro_batch
                               (per GPU), seq_len, (lr, beta1, beta2, weight_decay)
  --steps S                    timed steps (default 20)
  --warmup W                   untimed steps before them (default 5)
  --seed N                     model seed; rank r's tokens use N + r (default 1234)
  --mode fsdp2|hsdp            fsdp2: one flat mesh, every parameter sharded over all
                               ranks (ZeRO-3). hsdp: a 2-D (replicate, shard) mesh,
                               parameters sharded within groups of --shard-group-size
                               ranks and replicated across groups (Loom's hybrid_shard)
  --shard-group-size G         hsdp only: ranks per shard group (default: the ranks of one
                               node, LOCAL_WORLD_SIZE); must divide the world size
  --reshard-after-forward true|false
                               true (default): free the gathered bf16 parameters of a
                               layer after its forward and gather them again in backward;
                               false: keep them from forward to backward (ZeRO-2-like,
                               more memory, one all-gather less per layer)
  --compile                    torch.compile each decoder layer before sharding it
  --grad-accum N               micro-batches per step (default: [train] grad_accum, else 1)
  --float8                     torchao float8 tensorwise with float8 all-gather (above); needs torchao
  --ac none|selective-op|full  activation checkpointing per decoder layer (default none)
  --device cuda|cpu            cuda (default): NCCL, one GPU per rank (LOCAL_RANK), bf16
                               compute. cpu: gloo, fp32 everywhere, wall-clock timing,
                               no MFU or GPU memory — a smoke test for machines with no GPU

Errors in the config (a missing section or key, a value that is not a positive
integer), a shard group size that does not divide the world size, or fewer visible
GPUs than ranks on the node end every rank with one message (from local rank 0) and
exit status 2. A failure while running (out of memory, say) prints a PEER_JSON row
with "error" from rank 0 when rank 0 is the one that failed, and exits 1.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time
import tomllib
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_llama import (adamw_param_groups, causal_flops_per_token, float8_convert, flops_per_token,  # noqa: E402
                      llama_config, model_from_config)

PROG = "torch_fsdp.py"
REQUIRED = {"model": ("hidden", "num_layers", "num_heads", "ffn_hidden", "vocab_size"),
            "train": ("micro_batch", "seq_len")}
OPTIONAL_INTS = {"model": ("num_kv_heads",), "train": ()}


def env_int(name, default):
    return int(os.environ.get(name, default))


def fail(msg):
    """Ends this rank with status 2; local rank 0 alone prints, the others wait for
    torchrun to stop them once rank 0 has gone (or give up after a few seconds)."""
    if env_int("LOCAL_RANK", 0) == 0:
        print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    else:
        time.sleep(10)
    sys.exit(2)


def load_config(path):
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except OSError as e:
        fail(f"config {path}: cannot read it ({e.strerror or e})")
    except tomllib.TOMLDecodeError as e:
        fail(f"config {path}: not valid TOML ({e})")
    for sec, keys in REQUIRED.items():
        if not isinstance(cfg.get(sec), dict):
            fail(f"config {path}: missing section [{sec}] (it needs {', '.join(keys)})")
        for k in keys + OPTIONAL_INTS[sec]:
            if k not in cfg[sec]:
                if k in keys:
                    fail(f"config {path}: missing key '{k}' in [{sec}]")
                continue
            v = cfg[sec][k]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                fail(f"config {path}: [{sec}] {k} = {v!r}; it must be a positive integer")
    c = model_from_config(path)
    if c["hidden"] % c["heads"]:
        fail(f"config {path}: [model] hidden = {c['hidden']} is not a multiple of num_heads = {c['heads']}")
    if c["heads"] % c["kv_heads"]:
        fail(f"config {path}: [model] num_heads = {c['heads']} is not a multiple of num_kv_heads = {c['kv_heads']}")
    return c


def bool_arg(s):
    v = s.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def positive_int(s):
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def nonnegative_int(s):
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {v}")
    return v


def single_process_env():
    """Lets `python3 torch_fsdp.py CONFIG` run as a world of one, without torchrun."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def import_fsdp():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # PyTorch before 2.6 kept FSDP2 here
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def clip_grad_norm(params, max_norm):
    """Global-norm clipping over sharded (DTensor) gradients, the torchtitan way."""
    import torch
    from torch.distributed.tensor import DTensor
    if not hasattr(torch.nn.utils, "get_total_norm"):  # PyTorch before 2.6
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, True)
    return total


def selective_op_ac_context_fn():
    """torchtitan's per-op selective activation checkpointing (its
    ac_mode = "selective", selective_ac_option = "op"): inside a checkpointed
    layer, the outputs of attention, of the float8 amax reductions and of
    every other matmul are saved, everything else is recomputed in the
    backward. A fresh policy (its own matmul count) per checkpointed call."""
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops
    save = {ops.aten.mm.default, ops.aten._scaled_dot_product_efficient_attention.default,
            ops.aten._scaled_dot_product_flash_attention.default, ops.aten.max.default}
    for name in ("_scaled_dot_product_cudnn_attention",):
        if hasattr(ops.aten, name):
            save.add(getattr(ops.aten, name).default)
    if hasattr(ops, "_c10d_functional"):
        save.add(ops._c10d_functional.reduce_scatter_tensor.default)
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        key = f"{mode}_mm_count"
        if func == ops.aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpointed(layer, ac):
    """The decoder layer wrapped for --ac (torchtitan wraps the same way)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    if ac == "full":
        return checkpoint_wrapper(layer, preserve_rng_state=False)
    return checkpoint_wrapper(layer, context_fn=selective_op_ac_context_fn, preserve_rng_state=False)


def run(a, c, rank, world, local_rank, shard):
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    fully_shard, MixedPrecisionPolicy = import_fsdp()
    cuda = a.device == "cuda"
    if cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    if a.mode == "hsdp":
        mesh_shape, names = (world // shard, shard), ("replicate", "shard")
    else:
        mesh_shape, names = (world,), ("shard",)
    mesh = init_device_mesh(dev.type, mesh_shape, mesh_dim_names=names)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda \
        else MixedPrecisionPolicy()

    torch.manual_seed(a.seed)  # the same full weights on every rank; each keeps its shard
    with torch.device(dev):
        model = LlamaForCausalLM(llama_config(c)).to(dtype=torch.float32)
    model.train()
    extra = {}
    if a.float8:
        extra = float8_convert(model, fsdp_float8_all_gather=True)
    decoder = model.model.layers
    for i, layer in enumerate(list(decoder)):
        assert isinstance(layer, LlamaDecoderLayer), type(layer)
        if a.ac != "none":
            layer = checkpointed(layer, a.ac)
            decoder[i] = layer
        if a.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=a.reshard_after_forward)
    layers = list(decoder)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=a.reshard_after_forward)
    params = list(model.parameters())
    kw = dict(lr=c["lr"], betas=(c["beta1"], c["beta2"]), eps=1e-8)
    try:
        opt, opt_kind = torch.optim.AdamW(adamw_param_groups(model, c), fused=True, **kw), "adamw_fused"
    except (RuntimeError, ValueError, TypeError):
        opt, opt_kind = torch.optim.AdamW(adamw_param_groups(model, c), foreach=True, **kw), "adamw_foreach"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator(device=dev).manual_seed(a.seed + rank)
    B, S, V = c["batch"], c["seq"], c["vocab"]
    accum = a.grad_accum if a.grad_accum is not None else c.get("grad_accum", 1)
    precompute = None
    if a.float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as precompute

    def step():
        total = torch.zeros((), device=dev)
        for _ in range(accum):
            ids = torch.randint(0, V, (B, S + 1), device=dev, generator=g)
            inputs, targets = ids[:, :-1], ids[:, 1:]
            logits = model(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, V), targets.reshape(-1)) / accum
            del logits
            loss.backward()
            total += loss.detach()
        clip_grad_norm(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute is not None:
            precompute(model)  # the next step's float8 weight scales, one all-reduce (torchtitan's hook)
        return total

    losses = [step() for _ in range(a.warmup)]
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(a.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step())
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            losses.append(step())
            times.append((time.perf_counter() - t0) * 1e3)

    # A step takes as long as its slowest rank; memory is the largest rank's; losses the ranks' mean.
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mem = torch.tensor([torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev)] if cuda
                       else [0, 0], dtype=torch.float64, device=dev)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    lt = torch.stack(losses).to(torch.float64)
    dist.all_reduce(lt, op=dist.ReduceOp.SUM)
    loss_list = (lt / world).tolist()
    times = t.tolist()

    med = statistics.median(times)
    tok_gpu = accum * B * S / (med * 1e-3)
    strategy = a.mode
    label = (strategy + ("+float8" if a.float8 else "") + ("+compile" if a.compile else "") +
             ("" if a.ac == "none" else f"+ac-{a.ac}") + ("" if a.reshard_after_forward else "+no-reshard"))
    out = dict(peer="torch_fsdp", mode=label, strategy=strategy, world=world, mesh=list(mesh_shape),
               shard_group_size=shard, reshard_after_forward=a.reshard_after_forward, compile=a.compile,
               micro_batch=B, seq_len=S, grad_accum=accum, steps=a.steps, warmup=a.warmup,
               activation_checkpointing=a.ac, float8=a.float8,
               median_step_ms=med, min_step_ms=min(times), max_step_ms=max(times),
               tokens_per_s=tok_gpu * world, tokens_per_s_per_gpu=tok_gpu,
               mfu=flops_per_token(c) * tok_gpu / 989e12 if cuda else None,
               model_tflops=causal_flops_per_token(c) * tok_gpu / 1e12 if cuda else None,
               peak_alloc_bytes=int(mem[0]) if cuda else None, peak_reserved_bytes=int(mem[1]) if cuda else None,
               peak_alloc_gib=float(mem[0]) / 2**30 if cuda else None,
               peak_reserved_gib=float(mem[1]) / 2**30 if cuda else None,
               final_loss=loss_list[-1], losses=loss_list, optimizer=opt_kind,
               precision=("float8 tensorwise GEMMs and all-gathers, " if a.float8 else "") +
               ("bf16 params, fp32 reduce, fp32 master" if cuda else "fp32"), **extra,
               torch=torch.__version__, transformers=transformers.__version__,
               device=torch.cuda.get_device_name(dev) if cuda else "cpu", config=a.config)
    dist.barrier()
    dist.destroy_process_group()
    return out


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a Loom TOML config (model, micro batch and sequence length are read from it)")
    ap.add_argument("--steps", type=positive_int, default=20)
    ap.add_argument("--warmup", type=nonnegative_int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--mode", choices=("fsdp2", "hsdp"), default="fsdp2")
    ap.add_argument("--shard-group-size", type=int, default=None)
    ap.add_argument("--reshard-after-forward", type=bool_arg, default=True, metavar="{true,false}")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--grad-accum", type=positive_int, default=None)
    ap.add_argument("--float8", action="store_true")
    ap.add_argument("--ac", choices=("none", "selective-op", "full"), default="none")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args()

    single_process_env()
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local_rank, local_world = env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", 1)
    c = load_config(a.config)
    if a.mode == "hsdp":
        shard = local_world if a.shard_group_size is None else a.shard_group_size
        if shard < 1:
            fail(f"--shard-group-size {shard}: it must be at least 1")
        if world % shard:
            fail(f"--shard-group-size {shard} does not divide the world size {world} "
                 f"(hsdp needs world size = replicas x shard group size)")
    else:
        if a.shard_group_size is not None:
            fail(f"--shard-group-size {a.shard_group_size} applies only to --mode hsdp "
                 f"(fsdp2 shards over all {world} ranks)")
        shard = world

    if a.float8 and a.device != "cuda":
        fail("--float8 needs --device cuda (torchao's float8 GEMMs run on GPUs)")
    if a.float8:
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            fail(f"--float8 needs torchao ({e}); scripts/gpu_check.sh installs it from a wheel in .whl/")
    import torch
    if a.device == "cuda":
        n = torch.cuda.device_count()
        visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}"
        if n == 0:
            fail(f"no CUDA device is visible ({visible}); use --device cpu for a smoke test")
        if n < local_world:
            fail(f"{local_world} ranks on this node (--nproc_per_node / LOCAL_WORLD_SIZE={local_world}) but only "
                 f"{n} CUDA device(s) visible ({visible}); use at most {n} ranks, or --device cpu for a smoke test")
    try:
        out = run(a, c, rank, world, local_rank, shard)
    except Exception as e:
        print(f"{PROG}: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if rank == 0:
            r = dict(peer="torch_fsdp", mode=a.mode + ("+float8" if a.float8 else ""), strategy=a.mode, world=world,
                     config=a.config, activation_checkpointing=a.ac, error=f"{type(e).__name__}: {str(e)[:200]}")
            print("PEER_JSON " + json.dumps(r), flush=True)
        sys.stdout.flush()
        os._exit(1)  # the other ranks may sit in a collective; torchrun stops them
    if rank == 0:
        print("PEER_JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
