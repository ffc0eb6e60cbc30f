"""The formats' byte counts (`formats/stored.py`) are the sizes of the tensors they write."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.calibration.method import QParams
from quantkit.formats.stored import compress, linear_bytes, tensor_bytes
from quantkit.primitives import compute_qparams
from quantkit.scheme import preset

CASES = [
    ("w4a16", "pack-quantized", {}),
    ("w4a16-asym", "pack-quantized", {}),
    ("w4a16", "pack-quantized", {"actorder": "group"}),
    ("w8a16", "pack-quantized", {}),
    ("fp8-dynamic", "float-quantized", {}),
    ("fp8", "float-quantized", {}),
    ("w8a8", "int-quantized", {}),
]


@pytest.mark.parametrize("name, fmt, change", CASES, ids=[f"{n}{'-' + str(c) if c else ''}" for n, _, c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_bytes_are_the_compressed_tensors(name, fmt, change, dtype):
    scheme = preset(name)
    assert scheme.format == fmt
    args = dataclasses.replace(scheme.weights, **change)
    if args.strategy == "group":
        args = dataclasses.replace(args, group_size=32)
    w = torch.randn(48, 96).to(dtype)
    scale, zero = compute_qparams(w, args, dtype if fmt != "float-quantized" else torch.float32)
    g_idx = torch.arange(96, dtype=torch.int32) // 32 if args.actorder == "group" else None
    static = scheme.input_activations is not None and not scheme.input_activations.dynamic
    p = QParams(scale, zero, g_idx, torch.tensor([0.5]) if static else None)
    written = {k: t.numel() * t.element_size() for k, t in compress(fmt, w, args, p).items()}
    assert tensor_bytes(fmt, 48, 96, args, dtype.itemsize, static) == written
    assert linear_bytes(fmt, 48, 96, args, dtype.itemsize, static) == sum(written.values())
    assert linear_bytes(fmt, 48, 96, None, dtype.itemsize) == 48 * 96 * dtype.itemsize
