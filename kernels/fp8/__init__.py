"""The W8A8 fp8 GEMMs, each a list of candidates, fastest first, the twin last
(`quantkit.kernels.choice`):

- `CANDIDATES`: e4m3 weights with per-channel or per-tensor scales, activations quantized per
  token or with a static scale. A problem gives `dtype` (the activations'), `weight` fp8 [N, K],
  `scales` and `input_scale` (None: dynamic).
- `BLOCK`: compressed-tensors' FP8_BLOCK (DeepSeek-V3's layout), activations quantized per token
  and per 128 columns dynamically. A problem gives `dtype`, `weight` float8_e4m3fn [N, K] and
  `scales` float [ceil(N/128), ceil(K/128)] (`weight_scale`, one per 128 x 128 block).
- `MX`: MXFP8 weights, activations in their own dtype (the MXFP8A16 preset). A problem gives
  `dtype`, `weight` float8_e4m3fn [N, K] and `scales` uint8 E8M0 exponents [N, K/32].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.kernels.choice import Candidate, Problem, always, triton_module
from quantkit.kernels.fp8 import twin as fp8_twin


def _triton_ok(p: Problem) -> tuple[bool, str]:
    return (True, "") if triton_module("fp8.triton", p) is not None else (False, "triton is not installed")


def _triton(p: Problem):
    kernel, weight = triton_module("fp8.triton", p).fp8_gemm, (p.weight, p.scales, p.input_scale)
    return lambda x: kernel(x, *weight)


def _twin(p: Problem):
    weight = (p.weight, p.scales, p.input_scale)
    return lambda x: fp8_twin.fp8_gemm(x, *weight)


CANDIDATES = [
    Candidate("fp8_gemm (Triton)", _triton_ok, _triton, device="cuda", backend="triton"),
    Candidate("fp8 twin (dequantizes on every call)", always, _twin, backend="torch"),
]


def _block_triton_ok(p: Problem) -> tuple[bool, str]:
    if triton_module("fp8.block_triton", p) is None:
        return False, "triton is not installed"
    if p.device.type == "cuda" and torch.cuda.get_device_capability(p.device) < (8, 9):
        return False, "its GPU has no fp8 tensor cores (compute capability below 8.9)"
    return True, ""


def _block_triton(p: Problem):
    kernel, weight = triton_module("fp8.block_triton", p).fp8_block_gemm, (p.weight, p.scales)
    return lambda x: kernel(x, *weight)


def _block_twin(p: Problem):
    dense = fp8_twin.dequantize_fp8_block(p.weight, p.scales)  # fp32, once at build

    run = lambda x: (fp8_twin.fake_quantize_per_group(x) @ dense.t()).to(x.dtype)  # noqa: E731
    run.weight = dense
    return run


BLOCK = [
    Candidate("fp8_block_gemm (Triton)", _block_triton_ok, _block_triton, device="cuda", backend="triton"),
    Candidate("fp8 block twin (weight dequantized once, fp32 matmul)", always, _block_twin, backend="torch"),
]


def _mx_triton_ok(p: Problem) -> tuple[bool, str]:
    return (True, "") if triton_module("fp8.mx_triton", p) is not None else (False, "triton is not installed")


def _mx_triton(p: Problem):
    kernel, weight = triton_module("fp8.mx_triton", p).mxfp8_gemm, (p.weight, p.scales)
    return lambda x: kernel(x, *weight)


def _mx_twin(p: Problem):
    dense = fp8_twin.dequantize_mxfp8(p.weight, p.scales).to(p.dtype)  # once at build
    run = lambda x: F.linear(x, dense)  # noqa: E731
    run.weight = dense
    return run


MX = [
    Candidate("mxfp8_gemm (Triton)", _mx_triton_ok, _mx_triton, device="cuda", backend="triton"),
    Candidate("mxfp8 twin (dequantized once, F.linear)", always, _mx_twin, backend="torch"),
]
