"""The one place that chooses a kernel. `backend="auto"` takes the Triton kernel when the
tensors live on a GPU; otherwise the batched CPU path (`quantkit.kernels.cpu_attention`)
for the paged KV cache and the torch twin (`quantkit.kernels.reference`) for the rest.
"triton" and "torch" (the twin) force one. Nothing else in the code calls a kernel directly."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import cpu_attention, cpu_fused, reference

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True, slots=True)
class Kernel:
    """The kernel a layer was given at load: its name, and why it is not the fast one (None
    when it is)."""

    name: str
    why: str | None = None


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise QuantkitError(f"backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}.")


def _triton(backend: str, module: str, x: torch.Tensor):
    """The Triton launcher module to use, or None for a torch path."""
    check_backend(backend)
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return None
    try:
        return importlib.import_module(f"quantkit.kernels.{module}")
    except ImportError as e:
        if backend == "triton":
            raise QuantkitError(
                f"the Triton kernel {module} is unavailable ({e}); install triton or use backend torch."
            ) from None
        return None


def int4_gemm(x, w_packed, scales, zeros, group_size, g_idx=None, backend: str = "auto") -> torch.Tensor:
    """W4A16 matmul; see `quantkit.kernels.reference.int4_gemm` for shapes and dtypes."""
    k = _triton(backend, "int4_gemm", x)
    return (k or reference).int4_gemm(x, w_packed, scales, zeros, group_size, g_idx)


def fp8_gemm(x, w_fp8, w_scale, x_scale=None, backend: str = "auto") -> torch.Tensor:
    """W8A8 fp8 matmul; see `quantkit.kernels.reference.fp8_gemm` for shapes and dtypes."""
    k = _triton(backend, "fp8_gemm", x)
    return (k or reference).fp8_gemm(x, w_fp8, w_scale, x_scale)


def _cache_path(backend: str, module: str, x: torch.Tensor):
    """The module for a paged-KV-cache op: Triton, the batched CPU path (auto off the GPU), or the twin."""
    k = _triton(backend, module, x)
    if k is not None:
        return k
    return cpu_attention if backend == "auto" and not x.is_cuda else reference


def attention_kernel(device: torch.device | str, kv_dtype: torch.dtype, backend: str = "auto") -> Kernel:
    """The paged-attention kernels `paged_attention`/`paged_prefill`/`kv_store` take for a cache of
    `kv_dtype` on `device` with `backend` (what the engine reports at load)."""
    check_backend(backend)
    if backend == "triton" or (backend == "auto" and torch.device(device).type == "cuda"):
        return Kernel("paged_attention and kv_store (Triton), prefill on gathered blocks (SDPA)")
    if backend == "torch":
        return Kernel("the attention twins (torch, a sequence at a time)", "backend torch")
    from quantkit.kernels import cpu_ext

    if cpu_ext.load() is not None:
        return Kernel(
            "paged attention (quantkit C++; prefill on AMX where the CPU has it, else long ones through SDPA)"
        )
    return Kernel("batched paged attention (torch CPU: gathered blocks + SDPA)", cpu_ext.reason())


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
    window, scores soft-capped at ±softcap; see `quantkit.kernels.paged_attention`."""
    reference.check_window_softcap("paged_attention", window, softcap)
    k = _cache_path(backend, "paged_attention", q)
    return k.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window, softcap)


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
    """Causal attention of the new tokens of several sequences over their cached blocks
    (gathered blocks + SDPA; on a GPU the twin's path), with an optional sliding window and
    softcap as `paged_attention`; see `quantkit.kernels.reference.paged_prefill`."""
    check_backend(backend)
    reference.check_window_softcap("paged_prefill", window, softcap)
    m = cpu_attention if backend == "auto" and not q.is_cuda else reference
    return m.paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap
    )


def kv_store(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, backend: str = "auto") -> None:
    """Write new keys/values into their cache slots, quantising on the way; see `quantkit.kernels.kv_store`.
    On the CPU one C++ pass (`kernels/csrc/fused.cpp`) where scales are fp32 and given exactly
    for fp8/int8 caches."""
    fused = _fused(backend, k, v)
    scales = [s for s in (k_scale, v_scale) if s is not None]
    if (
        fused is not None
        and len(scales) == (2 if k_cache.element_size() == 1 else 0)
        and all(s.dtype == torch.float32 for s in scales)
    ):
        fused.kv_store_(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    m = _cache_path(backend, "kv_store", k)
    m.kv_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def int4_cpu_weight(w_packed, scales, zeros, group_size, g_idx=None):
    """(weight, why): the int4 weight built once, at load, for `int4_gemm_cpu`, and which CPU
    kernel it takes and why (the AMX kernel of `kernels/csrc/int4_gemm.cpp`, else torch's
    int4pack); (None, why) when none can take its shape. See `quantkit.kernels.cpu_int4`."""
    from quantkit.kernels import cpu_int4

    return cpu_int4.repack(w_packed, scales, zeros, group_size, g_idx)


def int4_gemm_cpu(x, weight) -> torch.Tensor:
    """W4A16 on the CPU with an `int4_cpu_weight` (computes in bf16)."""
    from quantkit.kernels import cpu_int4

    return cpu_int4.gemm(x, weight)


def int8_cpu_weight(q, scales):
    """A symmetric per-channel int8 weight (int8 [N, K], scales [N] or [N, 1]) for
    `int8_gemm_cpu`, or None when that kernel cannot take its shape; see `quantkit.kernels.cpu`."""
    from quantkit.kernels import cpu

    if not cpu.supports_int8(*q.shape):
        return None
    return cpu.repack_int8_cpu(q, scales)


def int8_cpu_unsupported(out_features, in_features) -> str | None:
    """Why torch's CPU int8-weight kernel cannot take an [out, in] weight, or None when it can."""
    from quantkit.kernels import cpu

    return (
        None
        if cpu.supports_int8(out_features, in_features)
        else f"torch's CPU int8-weight kernel needs K % 16 == 0, not {in_features}"
    )


def int8_gemm_cpu(x, weight) -> torch.Tensor:
    """W8A16 on the CPU through torch's int8-weight kernel (computes in x's dtype)."""
    from quantkit.kernels import cpu

    return cpu.int8_gemm_cpu(x, weight)


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

    return cpu.bf16_linear(x, weight, bias)


def int8_gemm(x, w_int8, w_scale, backend: str = "auto") -> torch.Tensor:
    """W8A8 int8 matmul, activations quantized per token; see `quantkit.kernels.reference.int8_gemm`
    for shapes and dtypes. On a GPU (and with backend "triton", the GPU path: there is no Triton
    kernel) `torch._int_mm` (`quantkit.kernels.int8_gemm`), else the twin. The engine's CPU path
    is `w8a8_gemm_cpu`, with the weight prepacked at load."""
    check_backend(backend)
    if backend == "triton" or (backend == "auto" and x.is_cuda):
        from quantkit.kernels import int8_gemm as k

        return k.int8_gemm(x, w_int8, w_scale)
    return reference.int8_gemm(x, w_int8, w_scale)


def int8_gemm_unsupported(out_features, in_features, device) -> str | None:
    """Why `int8_gemm`'s `torch._int_mm` path cannot take an [out, in] weight on `device`, or None."""
    from quantkit.kernels import int8_gemm as k

    return k.unsupported(out_features, in_features, device)


def w8a8_cpu_unsupported(out_features, in_features) -> str | None:
    """Why oneDNN's int8 linear cannot take an [out, in] W8A8 weight on this CPU, or None."""
    from quantkit.kernels import cpu

    return cpu.w8a8_unsupported(out_features, in_features)


def w8a8_cpu_weight(w_int8, w_scale):
    """A W8A8 weight (int8 [N, K], scales [N, 1] or [1]) prepacked once for `w8a8_gemm_cpu`;
    see `quantkit.kernels.cpu`."""
    from quantkit.kernels import cpu

    return cpu.prepack_w8a8(w_int8, w_scale)


def w8a8_cpu_ext_reason() -> str:
    """Why the C++ quantization passes of `w8a8_gemm_cpu` are unavailable here ("" when they run)."""
    from quantkit.kernels import cpu_w8a8

    return cpu_w8a8.reason()


def w8a8_gemm_cpu(x, weight) -> torch.Tensor:
    """W8A8 on the CPU: x quantized per token, oneDNN's int8 GEMM (AMX / VNNI), in x's dtype."""
    from quantkit.kernels import cpu

    return cpu.w8a8_gemm_cpu(x, weight)


def _fused(backend: str, *tensors: torch.Tensor):
    """The C++ element-wise kernels (`kernels/cpu_fused.py`) for CPU tensors of one float dtype
    with backend auto, or None for the twins (a GPU, backend torch or triton, no build). Called
    for every op of every layer: the cheap tests first."""
    if backend != "auto":
        check_backend(backend)
        return None
    x = tensors[0]
    if x.device.type != "cpu":
        return None
    for t in tensors[1:]:
        if t.dtype != x.dtype:
            return None
    return cpu_fused.load()


def fused_kernel(device: torch.device | str, backend: str = "auto") -> Kernel:
    """What `rms_norm`, `add_rms_norm_`, `rope_` and `silu_mul` run on `device` with `backend`."""
    check_backend(backend)
    if backend == "torch":
        return Kernel("norms, rotary embedding and SiLU as torch ops", "backend torch")
    if backend == "triton" or torch.device(device).type != "cpu":
        return Kernel("norms, rotary embedding and SiLU as torch ops")
    if cpu_fused.load() is not None:
        return Kernel("norms, rotary embedding and SiLU (quantkit C++)")
    return Kernel("norms, rotary embedding and SiLU as torch ops", cpu_fused.reason())


def rms_norm(x, weight, eps: float, gemma: bool = False, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim, Llama's way or Gemma's; see `quantkit.kernels.reference.rms_norm`."""
    k = _fused(backend, x, weight)
    return k.rms_norm(x, weight, eps, gemma) if k is not None else reference.rms_norm(x, weight, eps, gemma)


def add_rms_norm_(x, delta, weight, eps: float, gemma: bool = False, backend: str = "auto") -> torch.Tensor:
    """x += delta in place, then `rms_norm(x)`; see `quantkit.kernels.reference.add_rms_norm_`."""
    k = _fused(backend, x, delta, weight)
    if k is not None:
        return k.add_rms_norm_(x, delta, weight, eps, gemma)
    return reference.add_rms_norm_(x, delta, weight, eps, gemma)


def rope_(x, cos, sin_signed, backend: str = "auto") -> None:
    """Rotary embedding of x [T, heads, D] in place (cos, sign-folded sin [T, R]); see
    `quantkit.kernels.reference.rope`."""
    k = _fused(backend, x, cos, sin_signed)
    (k or reference).rope_(x, cos, sin_signed)


def silu_mul(gate_up, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I]; see `quantkit.kernels.reference.silu_mul`."""
    k = _fused(backend, gate_up)
    return (k or reference).silu_mul(gate_up)


def argmax(x, backend: str = "auto") -> torch.Tensor:
    """x.argmax(-1) for logits [rows, vocab] (the first index of each row's maximum); one
    vectorised pass in C++ on the CPU, where torch's argmax is a scalar loop."""
    k = _fused(backend, x)
    if k is not None:
        return k.argmax(x)
    if backend == "auto" and not x.is_cuda:
        return cpu_fused.torch_argmax(x)
    return reference.argmax(x)
