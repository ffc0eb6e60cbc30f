"""A float copy of a model with only the values' rotation (SpinQuant's R2: each head's v_proj rows
by Hᵀ and o_proj columns by H, H the normalized Hadamard matrix of the head size), the part of
`--rotate` that Gemma 2 and 3's post-norms do not forbid; then quantize the copy like any model
and evaluate it against the original float model (the function is the same to fp32 error, which
this script prints).

    python benchmarks/values_rotation.py gemma3-270m OUT
    OMP_NUM_THREADS=1 quantkit gptq -m OUT --scheme w4a16-asym --group-size 64 --calib news \\
        --samples 64 --seq-len 512 --no-range-search -o OUT-q
    OMP_NUM_THREADS=1 quantkit eval OUT-q --ppl wiki --limit 32 --dtype float32 --baseline gemma3-270m

Measured (gemma3-270m w4a16-asym g64, 2026-12-07): worse than without the rotation
(docs/benchmarks.md "The values' rotation alone on gemma3-270m").
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from quantkit.calibration.hadamard import hadamard
from quantkit.calibration.rotate import per_head
from quantkit.models.loading import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a built-in name, a hub id or a folder (one model.safetensors)")
    parser.add_argument("out", type=Path)
    a = parser.parse_args()
    src = resolve_model(a.model)
    shutil.copytree(src, a.out, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    h, how = hadamard(d, torch.Generator().manual_seed(0))
    tensors = load_file(src / "model.safetensors")
    for k, w in tensors.items():
        if k.endswith("v_proj.weight"):  # each KV head's rows: Hᵀ·W_v, as `--rotate` writes them
            tensors[k] = per_head(w.double().T, h).T.contiguous().to(w.dtype)
        elif k.endswith("o_proj.weight"):  # each head's columns: W_o·H
            tensors[k] = per_head(w.double(), h).to(w.dtype)
    save_file(tensors, a.out / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, after = (AutoModelForCausalLM.from_pretrained(p).eval()(ids).logits for p in (src, a.out))
    moved = (before - after).abs().max()
    print(f"head size {d} ({how}); logits moved by at most {moved:.2e} of {before.abs().max():.1f}")


if __name__ == "__main__":
    main()
