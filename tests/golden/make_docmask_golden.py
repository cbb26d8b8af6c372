#!/usr/bin/env python3
"""Reference data from HF transformers for Loom's document masking (packed documents).

The "gqa" model of make_golden.py (tests/golden/gqa/hf: LlamaForCausalLM, hidden 96,
3 layers, 6/2 heads, vocab 300) runs a batch of 2 rows x 33 tokens that pack several
documents each, with Megatron-LM's three switches on (Loom's train.reset_attention_mask,
reset_position_ids and eod_mask_loss):

  - a token attends only to the tokens of its own document at or before it;
  - positions restart at 0 where a document begins (and at every row's first token:
    a document that began in an earlier row continues as a sequence of its own);
  - no loss on a document's last token (its target is the next document's first).

It is computed twice, in two independent ways, which must agree:
  1. each document span fed alone to the model, from position 0 (the definition);
  2. the packed rows with position_ids and a 4-D block-diagonal causal mask.
The logits and every gradient are written from (1); (2) is checked against them.

Writes tests/golden/docmask/:
  reference.safetensors   input_ids, targets (I32 [2, 33]); starts (I32 [2, 34]: 1 where
                          the token at that position of the row begins a document, the
                          last column for the token after the row, a target only);
                          logits [2, 33, 300]; token_losses [2, 33] (0 where the target
                          carries no loss); loss [1] (the mean over the tokens that carry
                          loss); grad.<hf name> of loss for every parameter
  reference.json          the documents, versions, shapes, values and the agreement of (1) and (2)

Run from the repository root:  python3 tests/golden/make_docmask_golden.py
fp32 on the CPU, eager attention, one thread, deterministic: a rerun with the same torch
and transformers reproduces the files.
"""
import json
import os
import sys

import safetensors
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "gqa", "hf")
OUT = os.path.join(HERE, "docmask")
BATCH, SEQ, SEED = 2, 33, 3303
# Where documents begin, per row, as positions 0..SEQ (SEQ: the token after the row,
# whose flag says whether the row's last target begins a document). Row 0: documents of
# 5, 1, 9, 14 and 4 tokens, the last ending exactly at the row's end (its last target is
# masked). Row 1: a document that began in an earlier row (no flag at 0: it is a span of
# its own all the same), two of one token, then 6 and 13 tokens running on into the next
# row (its last target counts).
STARTS = [[0, 5, 6, 15, 29, 33], [12, 13, 14, 20]]


def spans_of(row_starts):
    """The [begin, end) spans of a row: its first token always begins one."""
    begins = sorted({0} | {p for p in row_starts if 0 < p < SEQ})
    return list(zip(begins, begins[1:] + [SEQ]))


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = LlamaForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32, attn_implementation="eager")
    model.config._attn_implementation = "eager"
    model.train()  # dropout is 0
    vocab = model.config.vocab_size

    g = torch.Generator().manual_seed(SEED)
    seq = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    input_ids, targets = seq[:, :SEQ].contiguous(), seq[:, 1:].contiguous()
    starts = torch.zeros(BATCH, SEQ + 1, dtype=torch.int32)
    for b, row in enumerate(STARTS):
        for p in row:
            starts[b, p] = 1
    carries = starts[:, 1:] == 0  # the target at p begins no document: it carries loss
    count = int(carries.sum())

    # 1. Each span alone, from position 0: logits, per-token losses, gradients.
    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    logits = torch.zeros(BATCH, SEQ, vocab)
    token_losses = torch.zeros(BATCH, SEQ)
    total = 0.0
    for b in range(BATCH):
        for s, e in spans_of(STARTS[b]):
            out = model(input_ids=input_ids[b:b + 1, s:e]).logits[0]
            ce = F.cross_entropy(out, targets[b, s:e], reduction="none") * carries[b, s:e]
            (ce.sum() / count).backward()  # gradients accumulate: the mean over every span's tokens
            logits[b, s:e] = out.detach()
            token_losses[b, s:e] = ce.detach()
            total += float(ce.detach().double().sum())
    loss = torch.tensor([total / count], dtype=torch.float32)
    grads = {n: p.grad.detach().clone() for n, p in params.items()}

    # 2. The packed rows: positions that restart per span, a block-diagonal causal mask.
    position_ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    allowed = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    for b in range(BATCH):
        for s, e in spans_of(STARTS[b]):
            position_ids[b, s:e] = torch.arange(e - s)
            allowed[b, 0, s:e, s:e] = torch.tril(torch.ones(e - s, e - s, dtype=torch.bool))
    additive = torch.zeros(BATCH, 1, SEQ, SEQ).masked_fill(~allowed, torch.finfo(torch.float32).min)
    model.zero_grad(set_to_none=True)
    packed = model(input_ids=input_ids, position_ids=position_ids, attention_mask=additive).logits
    ce = F.cross_entropy(packed.reshape(-1, vocab), targets.reshape(-1), reduction="none").reshape(BATCH, SEQ)
    (ce * carries).sum().div(count).backward()

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    agreement = {"logits": rel(packed.detach(), logits),
                 "grads_worst": max(rel(p.grad, grads[n]) for n, p in params.items())}
    # Both are fp32 with other summation orders (rows of other lengths): ~1e-7.
    assert agreement["logits"] < 1e-5 and agreement["grads_worst"] < 1e-5, agreement

    tensors = {"input_ids": input_ids.to(torch.int32), "targets": targets.to(torch.int32), "starts": starts,
               "logits": logits.contiguous(), "token_losses": token_losses.contiguous(), "loss": loss}
    for n, t in grads.items():
        tensors["grad." + n] = t.float().contiguous()
    os.makedirs(OUT, exist_ok=True)
    save_file(tensors, os.path.join(OUT, "reference.safetensors"), metadata={"format": "pt"})
    ref = {
        "generator": "tests/golden/make_docmask_golden.py",
        "model": "tests/golden/gqa/hf (make_golden.py)",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__},
        "batch": {"batch": BATCH, "seq": SEQ, "seed": SEED,
                  "construction": "seq = randint(0, vocab, [2, 34]); input_ids = seq[:, :33]; targets = seq[:, 1:]"},
        "document_starts": STARTS,
        "spans": [spans_of(r) for r in STARTS],
        "switches": ["reset_attention_mask", "reset_position_ids", "eod_mask_loss"],
        "loss": f"mean cross-entropy over the {count} targets that begin no document",
        "values": {"loss": loss.item(), "tokens_with_loss": count},
        "packed_vs_separate": agreement,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
    }
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, indent=2)
        f.write("\n")
    print(f"docmask: loss {loss.item():.6f} over {count} tokens; packed vs separate: {agreement}")


if __name__ == "__main__":
    main()
