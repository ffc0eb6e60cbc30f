"""KL divergence and top-1 agreement of a candidate against its baseline, on the
perplexity windows, with only one model in memory at a time.

The baseline runs first. A `Recorder` sees its logits one perplexity chunk at a time
(`perplexity.head_logits`: b windows × up to CHUNK positions) and writes their
log-softmax, rounded to fp16, to a folder, one file per chunk:

    w{window:06d}-p{position:06d}.pt   {"targets":  int32 [b, c]       the next tokens, to check the data
                                        "top1":     int32 [b, c]       the baseline's argmax (from fp32)
                                        "logprobs": float16 [b, c, V]  the baseline's log-probabilities}

2·V + 8 bytes per position (96 KiB for smollm2-135m's 49,152 tokens, 512 KiB for Gemma 3's
262,144). The candidate runs second; a `Comparer` reads the file of the same chunk and
computes, per position, KL(baseline ‖ candidate) = Σ_v p(v) (log p(v) - log q(v)) in fp32
and whether the candidate's argmax is the baseline's. Rounding the baseline to fp16 moved
the mean KL by -5.6e-5 relative on smollm2-135m; keeping only its top 4,096 tokens (and
the rest as one outcome) would lower it by 0.7%, the top 256 by 8% (docs/accuracy.md).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from quantkit.errors import QuantkitError


def divergence(baseline: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(baseline ‖ candidate) per position, in nats [...] fp32, from the baseline's
    log-probabilities [..., V] (any float dtype; normalised again in fp32, which takes out
    most of what rounding them to fp16 did) and the candidate's fp32 logits [..., V]. A
    token the baseline gives probability 0 adds nothing. Two fp32 tensors of the input's
    size are kept at once."""
    base = baseline.to(torch.float32, copy=True)
    base -= base.logsumexp(-1, keepdim=True)
    diff = candidate.log_softmax(-1).neg_().add_(base)  # log p - log q
    p = base.exp_()
    diff.masked_fill_(p == 0, 0.0)
    return torch.einsum("...v,...v->...", p, diff)


def percentile(values: torch.Tensor, q: float) -> float:
    """The `q`-th percentile (0-100) of a 1-D tensor, interpolated linearly between the two
    nearest ranks (numpy's default), for any length."""
    ordered = values.double().sort().values
    rank = q / 100 * (ordered.numel() - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return (ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)).item()


def _chunk_file(folder: Path, window: int, position: int) -> Path:
    return folder / f"w{window:06d}-p{position:06d}.pt"


class Recorder:
    """The baseline's side: an `observe` callback for `perplexity` that writes each chunk's
    fp16 log-probabilities to `folder`. When the disk would fill (1 GiB is kept free), the
    windows from that one on are not stored (`full_from`), and the comparison covers the
    windows before it."""

    def __init__(self, folder: str | Path):
        self.folder, self.full_from = Path(folder), None

    def __call__(self, window: int, ids: torch.LongTensor, position: int, logits: torch.Tensor) -> None:
        if self.full_from is not None and window >= self.full_from:
            return
        targets = ids[:, position + 1 : position + 1 + logits.shape[1]]  # [b, c]
        need, free = 2 * logits.numel() + 8 * targets.numel(), shutil.disk_usage(self.folder).free
        if need + 2**30 > free:  # keep 1 GiB for everything else
            self.full_from = window
            for partial in self.folder.glob(f"w{window:06d}-*.pt"):
                partial.unlink()
            return
        chunk = {
            "targets": targets.int().cpu(),
            "top1": logits.argmax(-1).int().cpu(),
            "logprobs": logits.log_softmax(-1).half().cpu(),
        }
        torch.save(chunk, _chunk_file(self.folder, window, position))


class Comparer:
    """The candidate's side: an `observe` callback for `perplexity` that compares each chunk
    with what a `Recorder` wrote to `folder`; `summary()` gives the result."""

    def __init__(self, folder: str | Path, windows: int | None = None):
        self.folder, self.windows, self.kl, self.same, self.seen = Path(folder), windows, [], [], set()

    def __call__(self, window: int, ids: torch.LongTensor, position: int, logits: torch.Tensor) -> None:
        if self.windows is not None and window >= self.windows:  # the baseline's disk was full from here
            return
        self.seen.add(window)
        path = _chunk_file(self.folder, window, position)
        targets = ids[:, position + 1 : position + 1 + logits.shape[1]].int().cpu()
        stored = torch.load(path) if path.is_file() else None
        if stored is None or not torch.equal(stored["targets"], targets):
            raise QuantkitError(
                f"the candidate's perplexity windows differ from the baseline's at window {window}, "
                f"position {position}; set --seq-len to a window length both models take."
            )
        if stored["logprobs"].shape != logits.shape:
            raise QuantkitError(
                f"the candidate scores {logits.shape[-1]} tokens and the baseline "
                f"{stored['logprobs'].shape[-1]}; compare a checkpoint with the model it was made from."
            )
        kl = divergence(stored["logprobs"].to(logits.device), logits)
        self.kl.append(kl.flatten().cpu())
        self.same.append((logits.argmax(-1).cpu() == stored["top1"]).flatten())

    def summary(self) -> dict:
        """{"kld": mean KL(baseline ‖ candidate) per position (nats), "kld_p99": its 99th
        percentile, "top1_agreement": share of positions whose argmax is the baseline's,
        "positions", "windows" (compared), "stored": how the baseline was kept}."""
        kl, same = torch.cat(self.kl), torch.cat(self.same)
        return {
            "kld": kl.double().mean().item(),
            "kld_p99": percentile(kl, 99),
            "top1_agreement": same.double().mean().item(),
            "positions": kl.numel(),
            "windows": len(self.seen),
            "stored": "fp16 log-probabilities of every token",
        }
