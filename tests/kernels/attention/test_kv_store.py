"""kv_store (Triton; under TRITON_INTERPRET=1 without a GPU) against its torch twin, and the
twin against `calibration.kv.fake_quantize_kv`.

Tolerance: none. Storing is a copy or a quantisation with one rounding, so the kernel's
cache bytes must equal the twin's (`torch.equal` on the raw bytes, which also compares the
untouched NaN "stale" slots), and the twin's dequantised values must equal
fake_quantize_kv's. bf16 inputs are only copied or upcast, which the interpreter does
exactly (it is its fp32 -> bf16 downcast that truncates).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.calibration.kv import fake_quantize_kv, kv_scales
from quantkit.kernels.attention import twin as attention_twin
from quantkit.kernels.attention.triton_kv_store import kv_store
from quantkit.scheme import preset

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 16, 16, 4

CACHES = {  # name: (cache dtype, input dtype, scale strategy; None = not quantized)
    "fp16": (torch.float16, torch.float16, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "fp32": (torch.float32, torch.float32, None),
    "fp8-tensor": (torch.float8_e4m3fn, torch.float16, "tensor"),
    "fp8-head": (torch.float8_e4m3fn, torch.bfloat16, "attn_head"),
    "fp8-head-fp32": (torch.float8_e4m3fn, torch.float32, "attn_head"),
    "int8-tensor": (torch.int8, torch.float32, "tensor"),
    "int8-head": (torch.int8, torch.float16, "attn_head"),
}


def kv_args(dtype: torch.dtype, strategy: str):
    args = preset("kv-fp8" if dtype == torch.float8_e4m3fn else "kv-int8").kv_cache
    return dataclasses.replace(args, strategy=strategy)


def stale_cache(dtype: torch.dtype, kv_heads: int) -> torch.Tensor:
    """A cache full of stale values: NaN (fp16/bf16/fp32, and fp8's 0x7F), 127 for int8."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM)
    if dtype.itemsize == 1:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def make_tokens(cache: str, kv_heads: int, num_tokens: int = 19, seed: int = 0):
    """k, v [num_tokens, kv_heads, head_dim] with per-head magnitudes, their scales, and a
    slot_mapping into distinct random slots with one negative (skipped) entry."""
    dtype, in_dtype, strategy = CACHES[cache]
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-1, 1, kv_heads).reshape(1, kv_heads, 1)  # heads of different size
    k = (torch.randn(num_tokens, kv_heads, HEAD_DIM, generator=g) * spread).to(in_dtype)
    v = (torch.randn(num_tokens, kv_heads, HEAD_DIM, generator=g) * spread * 3).to(in_dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[num_tokens // 2] = -1
    scales = (None, None)
    if strategy is not None:
        args = kv_args(dtype, strategy)
        scales = tuple(kv_scales(x.float().abs().amax(dim=(0, 2)), args).to(DEVICE) for x in (k, v))
    return k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), scales


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("cache", list(CACHES))
def test_kernel_matches_twin(cache, kv_heads):
    dtype = CACHES[cache][0]
    k, v, slots, (k_scale, v_scale) = make_tokens(cache, kv_heads)
    caches = [stale_cache(dtype, kv_heads) for _ in range(4)]
    kv_store(k, v, caches[0], caches[1], slots, k_scale, v_scale)
    attention_twin.kv_store(k, v, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(raw(caches[0]), raw(caches[2]))
    assert torch.equal(raw(caches[1]), raw(caches[3]))


@pytest.mark.parametrize("cache", list(CACHES))
def test_twin_matches_fake_quantize_kv(cache):
    dtype, _, strategy = CACHES[cache]
    kv_heads = 2
    k, v, slots, (k_scale, v_scale) = make_tokens(cache, kv_heads, seed=1)
    k_cache, v_cache = stale_cache(dtype, kv_heads), stale_cache(dtype, kv_heads)
    attention_twin.kv_store(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    keep = slots >= 0
    for x, c, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        stored = c.flatten(0, 1)[slots[keep]].float()  # [n, kv_heads, head_dim]
        x = x[keep].float()
        if strategy is None:
            assert torch.equal(stored, x)
            continue
        dense = fake_quantize_kv(x.transpose(0, 1)[None], s, kv_args(dtype, strategy))[0].transpose(0, 1)
        assert torch.equal(stored * s.reshape(-1, 1), dense)


def test_skipped_slots_leave_the_cache_untouched():
    k = torch.ones(3, 1, HEAD_DIM, device=DEVICE)
    k_cache, v_cache = stale_cache(torch.float32, 1), stale_cache(torch.float32, 1)
    kv_store(k, 2 * k, k_cache, v_cache, torch.tensor([-1, 37, -5], device=DEVICE))
    written = ~torch.isnan(k_cache)
    assert written.sum() == HEAD_DIM and written[37 // BLOCK_SIZE, 37 % BLOCK_SIZE].all()
    assert torch.equal(v_cache[2, 5], 2 * k[1])


def test_fp8_rounding_matches_torch_bit_for_bit():
    """Ties go to even, subnormals survive, values past ±448 saturate, -0.0 keeps its sign."""
    edge = [
        100.0,
        104.0,
        108.0,
        -100.0,
        2**-10,
        3 * 2**-10,
        5 * 2**-10,
        0.0013,
        -1e-4,
        -0.0,
        0.0,
        448.0,
        464.0,
        470.0,
        1e4,
        -1e4,
        1e-30,
        0.5 + 2**-5,
        0.5 + 2**-4 + 2**-5,
        240.0,
        3.0 * 2**-7,
    ]
    exponents = torch.randint(-12, 10, (16 * HEAD_DIM - len(edge),), generator=torch.Generator().manual_seed(2))
    x = torch.cat([torch.tensor(edge), torch.randn(len(exponents)) * 2.0**exponents]).reshape(16, 1, HEAD_DIM)
    x = x.to(DEVICE)
    one, slots = torch.ones(1, device=DEVICE), torch.arange(16, device=DEVICE)
    k_cache, v_cache = stale_cache(torch.float8_e4m3fn, 1), stale_cache(torch.float8_e4m3fn, 1)
    kv_store(x, -x, k_cache, v_cache, slots, one, one)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(raw(k_cache[:1]).flatten(), raw(want).flatten())
    assert torch.equal(raw(v_cache[:1]).flatten(), raw((-x).clamp(-448, 448).to(torch.float8_e4m3fn)).flatten())


def test_int8_rounds_half_to_even_and_clamps():
    vals = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.4, 200.0, -128.6, -300.0, 0.49])
    x = torch.zeros(1, 1, HEAD_DIM)
    x[0, 0, : len(vals)] = vals
    x = x.to(DEVICE)
    k_cache, v_cache = stale_cache(torch.int8, 1), stale_cache(torch.int8, 1)
    half = torch.full((1,), 0.5, device=DEVICE)
    kv_store(x, x, k_cache, v_cache, torch.tensor([3], device=DEVICE), torch.ones(1, device=DEVICE), half)
    assert k_cache[0, 3, 0, : len(vals)].tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, -128, -128, 0]
    assert v_cache[0, 3, 0, :4].tolist() == [1, 3, 5, -1]


def _good(dtype=torch.float8_e4m3fn, kv_heads=2):
    k = torch.randn(3, kv_heads, HEAD_DIM, device=DEVICE)
    scale = torch.ones(1, device=DEVICE) if dtype.itemsize == 1 else None
    return dict(
        k=k,
        v=k.clone(),
        k_cache=stale_cache(dtype, kv_heads),
        v_cache=stale_cache(dtype, kv_heads),
        slot_mapping=torch.arange(3, device=DEVICE),
        k_scale=scale,
        v_scale=scale,
    )


BAD = {
    "missing scale": (dict(k_scale=None), r"needs k_scale"),
    "scale per head of wrong size": (dict(v_scale=torch.ones(3)), r"v_scale must be float32 of shape \[1\] or \[2\]"),
    "fp16 scale": (dict(k_scale=torch.ones(1, dtype=torch.float16)), r"k_scale must be float32"),
    "k of wrong head_dim": (dict(k=torch.randn(3, 2, 8)), r"k and v must both be \[num_tokens, 2, 16\]"),
    "v shaped unlike k": (dict(v=torch.randn(4, 2, HEAD_DIM)), r"k and v must both be"),
    "int k": (
        dict(k=torch.ones(3, 2, HEAD_DIM, dtype=torch.int32), v=torch.ones(3, 2, HEAD_DIM, dtype=torch.int32)),
        r"k and v must be float16, bfloat16 or float32",
    ),
    "slot_mapping too short": (dict(slot_mapping=torch.arange(2)), r"slot_mapping must be int64 of shape \[3\]"),
    "float slot_mapping": (dict(slot_mapping=torch.zeros(3)), r"slot_mapping must be int64"),
    "3-d cache": (
        dict(k_cache=torch.zeros(4, 16, 2)),
        r"k_cache must be \[num_blocks, block_size, num_kv_heads, head_dim\]",
    ),
    "caches differ": (dict(v_cache=torch.zeros(4, 16, 2, HEAD_DIM, dtype=torch.int8)), r"v_cache must match k_cache"),
    "unsupported cache dtype": (
        dict(
            k_cache=torch.zeros(4, 16, 2, HEAD_DIM, dtype=torch.float64),
            v_cache=torch.zeros(4, 16, 2, HEAD_DIM, dtype=torch.float64),
        ),
        r"cache dtype torch.float64 is not supported",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_launcher_errors(case):
    changes, message = BAD[case]
    kwargs = _good() | {name: t.to(DEVICE) if t is not None else None for name, t in changes.items()}
    with pytest.raises(ValueError, match=message):
        kv_store(**kwargs)


def test_launcher_errors_for_float_caches():
    kwargs = _good(torch.float16)
    with pytest.raises(ValueError, match=r"k and v must be torch.float16"):
        kv_store(**kwargs)  # fp32 k into an fp16 cache: the launcher does not cast
    kwargs |= dict(k=kwargs["k"].half(), v=kwargs["v"].half(), k_scale=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match=r"k_scale is only for fp8/int8 caches"):
        kv_store(**kwargs)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kwargs = {n: t.cpu() if t is not None else None for n, t in _good().items()}
    with pytest.raises(ValueError, match=r"needs a GPU; on CPU call quantkit.kernels.attention.twin.kv_store"):
        kv_store(**kwargs)
