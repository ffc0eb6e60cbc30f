"""FP4-weight GEMM (y = x · dequant(W)ᵀ from NVFP4 or MXFP4 weights, W4A16): its candidates,
fastest first, the twin last (`quantkit.kernels.choice`). A problem gives:

- `dtype`: the activations' (float16, bfloat16 or float32), and `device`;
- `packed`: uint8 [N, K/2], the checkpoint's `weight_packed` as stored (column 2j in the low
  nibble of byte j, 2j + 1 in the high one; each nibble an E2M1 code, sign in bit 3);
- `scales`: [N, K/group] as stored, float8_e4m3fn for NVFP4, uint8 E8M0 exponents
  (2^(e - 127)) for MXFP4;
- `global_scale`: float32 [1], NVFP4's `weight_global_scale` (w = e2m1 · scale / global_scale,
  as compressed-tensors dequantizes); None for MXFP4 (w = e2m1 · scale);
- `group_size`: 16 (NVFP4) or 32 (MXFP4);
- `kind`: "nvfp4" or "mxfp4" (W4A16), or "nvfp4_w4a4": NVFP4 weights with the activations
  quantized to NVFP4 too (groups of 16, FP8 scales computed per call over a static global scale);
- `input_global_scale`: float32 [1], the checkpoint's `input_global_scale` for "nvfp4_w4a4"
  (absent or None otherwise).

`build` returns x -> y; the twin's candidate decodes the weight once at build (W4A16: into
x's dtype, then `F.linear`; W4A4: fp32, the activations quantized per call, an fp32 matmul),
kept as `.weight`.
"""

from __future__ import annotations

import torch.nn.functional as F

from quantkit.kernels.choice import Candidate, Problem, always, triton_module
from quantkit.kernels.fp4 import twin as fp4_twin


def _weight(p: Problem) -> tuple:
    return p.packed, p.scales, p.global_scale, p.group_size, p.kind, getattr(p, "input_global_scale", None)


def _triton_ok(p: Problem) -> tuple[bool, str]:
    return (True, "") if triton_module("fp4.triton", p) is not None else (False, "triton is not installed")


def _triton(p: Problem):
    kernel, weight = triton_module("fp4.triton", p).fp4_gemm, _weight(p)
    return lambda x: kernel(x, *weight)


def _dense(p: Problem):
    dense = fp4_twin.dequantize_fp4(*_weight(p)[:5])
    if p.kind == "nvfp4_w4a4":
        gx = p.input_global_scale
        run = lambda x: (fp4_twin.quantize_nvfp4_activations(x, gx) @ dense.t()).to(x.dtype)  # noqa: E731
    else:
        dense = dense.to(p.dtype)
        run = lambda x: F.linear(x, dense)  # noqa: E731
    run.weight = dense
    return run


CANDIDATES = [
    Candidate("fp4_gemm (Triton)", _triton_ok, _triton, device="cuda", backend="triton"),
    Candidate("fp4 twin (dequantized once, F.linear)", always, _dense, backend="torch"),
]
