"""`quantkit.kernels.cpu.HugePageArena`: the copies hold the values, do not overlap, survive the
arena moving on to a new mapping, and fall back to a plain contiguous tensor when disabled.
`cpu.zeros` (the KV cache's memory): zeros of the shape and dtype, each in its own writable
mapping on 2 MB boundaries, or torch.zeros where huge pages are off, its pages taken when made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from quantkit.kernels import cpu


def test_arena_copies_are_exact_and_separate():
    arena = cpu.HugePageArena(chunk=4096)  # tiny mappings: the third copy starts a new one
    tensors = [torch.randn(300), torch.randint(-8, 8, (7, 16), dtype=torch.int32), torch.randn(2000).t()]
    copies = [arena.copy(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert torch.equal(c, t) and c.is_contiguous() and c.dtype == t.dtype
    if cpu.HugePageArena.available():
        spans = sorted((c.data_ptr(), c.data_ptr() + c.nbytes) for c in copies)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert all(c.data_ptr() % 64 == 0 for c in copies)
    copies[0].fill_(1.0)  # writable, and writing one leaves the others alone
    assert torch.equal(copies[1], tensors[1]) and torch.equal(copies[2], tensors[2])
    del arena  # the mappings live as long as their tensors
    assert torch.equal(copies[2], tensors[2])


def test_arena_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("QUANTKIT_HUGE_PAGES", "0")
    t = torch.randn(8, 4).t()
    c = cpu.HugePageArena().copy(t)
    assert not cpu.HugePageArena.available() and torch.equal(c, t) and c.is_contiguous()


@pytest.mark.parametrize("huge", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_zeros_are_zeros_of_their_own(monkeypatch, huge, dtype):
    monkeypatch.setenv("QUANTKIT_HUGE_PAGES", huge)
    shape = (5, 64, 3, 64)
    a, b = cpu.zeros(shape, dtype), cpu.zeros(shape, dtype, torch.device("cpu"))
    for t in (a, b):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.view(torch.uint8).any()
    if huge == "1" and cpu.HugePageArena.available():
        assert a.data_ptr() % cpu.HUGE_PAGE == 0 and b.data_ptr() % cpu.HUGE_PAGE == 0
    a.view(torch.uint8).fill_(7)  # writable, and b is elsewhere
    assert not b.view(torch.uint8).any() and a.view(torch.uint8).eq(7).all()
    assert cpu.zeros((0, 4), dtype).shape == (0, 4)


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc/self/statm")
@pytest.mark.skipif(not cpu.HugePageArena.available(), reason="no MADV_HUGEPAGE: cpu.zeros is torch.zeros")
def test_zeros_takes_its_pages_when_made():
    """Not on first write while serving, where a huge-page fault can wait on compaction (a new
    mapping, so every page it takes adds to the process's resident memory)."""
    before = resident_bytes()
    t = cpu.zeros((64, 1 << 20), torch.uint8)
    assert resident_bytes() - before >= t.nbytes * 0.95
