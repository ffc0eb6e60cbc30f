"""The kernels by operation, for a caller that asks per call (tests, benchmarks, calibration,
eval): each function chooses from its operation's candidates (`quantkit.kernels.choice`) on
every call, with `backend="auto"|"triton"|"torch"`. The engine does not come here: its runner
and linears choose once, at load, from the same lists, and call the winners.

`auto` takes the Triton kernel when the tensors live on a GPU; on a CPU the C++ kernels where they
are built (else batched torch) for the paged-cache and element-wise ops, and the twin
(each operation's `twin.py`) for the GEMMs, whose CPU kernels build their weight layout at load.
"triton" and "torch" (the twin) force one."""

from __future__ import annotations

import torch

from quantkit.kernels import attention, elementwise, fp8, int4, int8
from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.choice import Problem, choose


def _gemm(op: str, candidates: list, x: torch.Tensor, backend: str, **weight):
    """The GPU kernel or the twin of a GEMM for x (its CPU kernels are the engine's: they build a
    weight layout at load)."""
    return choose(op, [c for c in candidates if c.device != "cpu"], Problem(x.device, x.dtype, backend, **weight)).fn


def int4_gemm(x, w_packed, scales, zeros, group_size, g_idx=None, backend: str = "auto") -> torch.Tensor:
    """W4A16 matmul; see `quantkit.kernels.int4.twin.int4_gemm` for shapes and dtypes."""
    weight = (w_packed, scales, zeros, group_size, g_idx)
    return _gemm("int4 GEMM", int4.CANDIDATES, x, backend, weight=weight)(x)


def fp8_gemm(x, w_fp8, w_scale, x_scale=None, backend: str = "auto") -> torch.Tensor:
    """W8A8 fp8 matmul; see `quantkit.kernels.fp8.twin.fp8_gemm` for shapes and dtypes."""
    return _gemm("fp8 GEMM", fp8.CANDIDATES, x, backend, weight=w_fp8, scales=w_scale, input_scale=x_scale)(x)


def int8_gemm(x, w_int8, w_scale, backend: str = "auto") -> torch.Tensor:
    """W8A8 int8 matmul, activations quantized per token; see `quantkit.kernels.int8.twin.int8_gemm`
    for shapes and dtypes. On a GPU (and with backend "triton", the GPU path: there is no Triton
    kernel) `torch._int_mm` (`quantkit.kernels.int8.int_mm`) where it takes the shape, else the twin.
    The engine's CPU path, oneDNN on a weight prepacked at load, is `quantkit.kernels.int8.W8A8`'s."""
    return _gemm("W8A8 int8 GEMM", int8.W8A8, x, backend, weight=w_int8, scales=w_scale)(x)


def _cache_problem(q: torch.Tensor, k_cache: torch.Tensor, backend: str, **more) -> Problem:
    head_dim = q.shape[-1]
    if q.stride(-1) != 1:  # the C++ kernels need a contiguous last dim: give them a head_dim they refuse
        head_dim = 1
    return Problem(q.device, q.dtype, backend, head_dim=head_dim, num_heads=q.shape[1], kv_dtype=k_cache.dtype, **more)


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    k_scale=None,
    v_scale=None,
    window: int | None = None,
    softcap: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode attention over a block table, over the last `window` tokens with a sliding
    window, scores soft-capped at ±softcap; see `quantkit.kernels.attention.triton`."""
    attention_twin.check_window_softcap("paged_attention", window, softcap)
    fn = choose("decode attention", attention.DECODE, _cache_problem(q, k_cache, backend)).fn
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window, softcap)


def paged_prefill(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_lens,
    scale,
    k_scale=None,
    v_scale=None,
    window: int | None = None,
    softcap: float | None = None,
    backend: str = "auto",
):
    """Causal attention of the new tokens of several sequences over their cached blocks, with an
    optional sliding window and softcap as `paged_attention`; see
    `quantkit.kernels.attention.twin.paged_prefill`."""
    attention_twin.check_window_softcap("paged_prefill", window, softcap)
    fn = choose("prefill attention", attention.PREFILL, _cache_problem(q, k_cache, backend)).fn
    return fn(q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap)


def kv_store(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, backend: str = "auto") -> None:
    """Write new keys/values into their cache slots, quantising on the way; see
    `quantkit.kernels.attention.triton_kv_store`. On the CPU one C++ pass (`elementwise/fused.cpp`)
    where scales are fp32 and given exactly for fp8/int8 caches."""
    scales = tuple(s.dtype for s in (k_scale, v_scale) if s is not None)
    if v.dtype != k.dtype:
        scales = (None,)  # the C++ pass takes k and v of one dtype: refuse it
    fn = choose("KV store", attention.KV_STORE, _cache_problem(k, k_cache, backend, scales=scales)).fn
    fn(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether `device` computes bf16 natively (a GPU that supports it; a CPU with AVX512-BF16
    or AMX, through oneDNN)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from quantkit.kernels import cpu

    return cpu.native_bf16()


def float_cpu_weight(weight):
    """A bf16 linear weight reordered once for `float_gemm_cpu`, or None when the dtype or
    the torch build does not allow it; see `quantkit.kernels.cpu`."""
    from quantkit.kernels import cpu

    return cpu.prepack_bf16(weight)


def float_gemm_cpu(x, weight, bias=None) -> torch.Tensor:
    """F.linear in bf16 on the CPU with a `float_cpu_weight`."""
    from quantkit.kernels import cpu

    return cpu.packed_linear(x, weight, bias)


def _elementwise(op: str, candidates: list, x: torch.Tensor, backend: str, *others: torch.Tensor):
    return choose(op, candidates, Problem(x.device, x.dtype, backend, dtypes=tuple(t.dtype for t in others))).fn


def rms_norm(x, weight, eps: float, gemma: bool = False, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim, Llama's way or Gemma's; see `quantkit.kernels.elementwise.twin.rms_norm`."""
    return _elementwise("rms_norm", elementwise.RMS_NORM, x, backend, weight)(x, weight, eps, gemma)


def add_rms_norm_(x, delta, weight, eps: float, gemma: bool = False, backend: str = "auto") -> torch.Tensor:
    """x += delta in place, then `rms_norm(x)`; see `quantkit.kernels.elementwise.twin.add_rms_norm_`."""
    fn = _elementwise("add_rms_norm_", elementwise.ADD_RMS_NORM, x, backend, delta, weight)
    return fn(x, delta, weight, eps, gemma)


def rope_(x, cos, sin_signed, backend: str = "auto") -> None:
    """Rotary embedding of x [T, heads, D] in place (cos, sign-folded sin [T, R]); see
    `quantkit.kernels.elementwise.twin.rope`."""
    _elementwise("rope_", elementwise.ROPE, x, backend, cos, sin_signed)(x, cos, sin_signed)


def silu_mul(gate_up, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I]; see `quantkit.kernels.elementwise.twin.silu_mul`."""
    return _elementwise("silu_mul", elementwise.SILU_MUL, gate_up, backend)(gate_up)


def argmax(x, backend: str = "auto") -> torch.Tensor:
    """x.argmax(-1) for logits [rows, vocab] (the first index of each row's maximum); one
    vectorised pass in C++ on the CPU, where torch's argmax is a scalar loop."""
    return _elementwise("argmax", elementwise.ARGMAX, x, backend)(x)
