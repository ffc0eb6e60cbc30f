"""The paged KV cache's operations: decode attention, prefill attention and the KV store, each
a list of candidates, fastest first, the twin last (`quantkit.kernels.choice`).

A problem gives `dtype` (the queries'), `kv_dtype` (the cache's), `head_dim`, `num_heads`, and
for the KV store `scales`: the dtypes of the layers' k/v scales (empty for a float cache). The
engine's queries are views whose last dim is contiguous, which the C++ kernels need.
"""

from __future__ import annotations

import torch

from quantkit.kernels import cpu_ext
from quantkit.kernels.attention import cpu as cpu_attention
from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.choice import Candidate, Problem, always, fixed, triton_module
from quantkit.kernels.elementwise import cpp as cpu_fused


def _triton(module: str, fn: str) -> Candidate:
    def ok(p: Problem) -> tuple[bool, str]:
        return (True, "") if triton_module(module, p) is not None else (False, "triton is not installed")

    return Candidate("Triton", ok, lambda p: getattr(triton_module(module, p), fn), device="cuda", backend="triton")


def _cpp_ok(p: Problem) -> tuple[bool, str]:
    if p.head_dim % 16:
        return False, f"it takes head_dim a multiple of 16, not {p.head_dim}"
    if cpu_ext.load() is None:
        return False, cpu_ext.reason()
    return True, ""


def _amx_ok(p: Problem) -> tuple[bool, str]:
    ok, why = _cpp_ok(p)
    if not ok:
        return ok, why
    if p.dtype != torch.bfloat16:
        return False, f"its queries are {str(p.dtype)[6:]}; it takes bfloat16"
    if p.head_dim not in (64, 128):
        return False, f"it takes head_dim 64 or 128, not {p.head_dim}"
    if p.kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.int8):
        return False, f"it takes a bf16, fp8 or int8 cache, not {str(p.kv_dtype)[6:]}"
    q = torch.empty(1, p.num_heads, p.head_dim, dtype=p.dtype)
    if not cpu_ext.load().amx_prefill(q, torch.empty(1, 1, 1, p.head_dim, dtype=p.kv_dtype)):
        return False, "this CPU has no AMX-BF16 the OS grants (or QUANTKIT_NO_AMX=1)"
    return True, ""


def _fused_store_ok(p: Problem) -> tuple[bool, str]:
    quantized = p.kv_dtype.itemsize == 1
    if len(p.scales) != (2 if quantized else 0) or any(s != torch.float32 for s in p.scales):
        return False, "it takes fp32 k/v scales with an fp8 or int8 cache and none with a float one"
    if cpu_fused.load() is None:
        return False, cpu_fused.reason()
    return True, ""


def _ext(make):
    return lambda p: make(cpu_ext.load())


TORCH = "batched torch (gathered blocks + SDPA)"

# (q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window, softcap) -> out
DECODE = [
    _triton("attention.triton", "paged_attention"),
    Candidate("quantkit C++", _cpp_ok, _ext(cpu_attention.cpp_decode), device="cpu"),
    Candidate(TORCH, always, fixed(cpu_attention.torch_paged_attention), device="cpu"),
    Candidate("the twin (torch, a sequence at a time)", always, fixed(attention_twin.paged_attention), backend="torch"),
]

# (q, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, k_scale, v_scale, window, softcap) -> out
PREFILL = [
    Candidate("quantkit C++ on AMX", _amx_ok, _ext(cpu_attention.amx_prefill), device="cpu"),
    Candidate("quantkit C++ (short sequences), SDPA (long)", _cpp_ok, _ext(cpu_attention.split_prefill), "cpu"),
    Candidate(TORCH, always, fixed(cpu_attention.torch_paged_prefill), device="cpu"),
    Candidate("gathered blocks + SDPA (the twin)", always, fixed(attention_twin.paged_prefill), backend="torch"),
]

# (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None
KV_STORE = [
    _triton("attention.triton_kv_store", "kv_store"),
    Candidate("quantkit C++", _fused_store_ok, lambda p: cpu_fused.load().kv_store_, device="cpu"),
    Candidate("index_copy_ (torch)", always, fixed(cpu_attention.kv_store), device="cpu"),
    Candidate("the twin (torch)", always, fixed(attention_twin.kv_store), backend="torch"),
]
