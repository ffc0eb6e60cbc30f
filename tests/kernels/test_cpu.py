"""`quantkit.kernels.cpu.HugePageArena`: the copies hold the values, do not overlap, survive the
arena moving on to a new mapping, and fall back to a plain contiguous tensor when disabled."""

from __future__ import annotations

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
