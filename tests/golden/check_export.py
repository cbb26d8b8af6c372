#!/usr/bin/env python3
"""Checks that a directory written by loom::hf::save_hf_llama loads in HF transformers.

Loads <export_dir> with AutoModelForCausalLM.from_pretrained (LlamaForCausalLM, or
MixtralForCausalLM for a mixture of experts) (fp32, eager attention,
CPU), runs the golden batch (input_ids from <golden_dir>/reference.safetensors)
and prints the relative logits error against the golden logits:
    rel = ||logits - ref||_2 / ||ref||_2     and     max|logits - ref| / max|ref|
Exit status 1 if the relative error exceeds --tol (default 1e-5, the fp32
tolerance; use about 1e-2 for a bf16 export).

    python3 tests/golden/check_export.py build/golden_export/mha tests/golden/mha
    python3 tests/golden/check_export.py build/golden_export/mixtral tests/golden/mixtral
(build/golden_export/<model> is written by test_hf's Golden.ExportRoundTripIsExact and
MixtralHf.ImportExportRoundTripIsByteEqual.)
"""
import argparse
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_dir")
    ap.add_argument("golden_dir", help="tests/golden/<model> (holds reference.safetensors)")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()

    torch.set_num_threads(1)
    ref = load_file(f"{args.golden_dir}/reference.safetensors")
    model = AutoModelForCausalLM.from_pretrained(args.export_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"].long()).logits.float()
    want = ref["logits"]
    if logits.shape != want.shape:
        print(f"FAIL: logits shape {tuple(logits.shape)} != reference {tuple(want.shape)}")
        return 1
    rel = ((logits - want).norm() / want.norm()).item()
    rel_max = ((logits - want).abs().max() / want.abs().max()).item()
    print(f"{args.export_dir}: relative logits error {rel:.3e} (norm), {rel_max:.3e} (max), tolerance {args.tol:.0e}")
    return 0 if rel <= args.tol and rel_max <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
