"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from quantkit import ops
from quantkit.runtime.sequence import SamplingParams


class Sampler:
    """Keeps one random generator per seeded request so its samples repeat exactly. `argmax` is
    the greedy kernel (logits [rows, vocab] -> int64 [rows]): the engine passes the one its
    runner chose at load (`ModelRunner.argmax`); `ops.argmax`, which chooses per call, otherwise."""

    def __init__(self, argmax=ops.argmax):
        self.generators: dict[int, torch.Generator] = {}
        self.argmax = argmax

    def forget(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    def generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        if seq_id not in self.generators:
            self.generators[seq_id] = torch.Generator().manual_seed(params.seed)
        return self.generators[seq_id]

    def sample(self, logits: torch.Tensor, requests: list[tuple[int, SamplingParams]]):
        """One token per row of logits [n, vocab] (any float dtype; probabilities are
        computed in fp32); returns (token ids, logprob records: None, or (logprob of the
        token, [(id, logprob)] top-n) per row). A greedy row costs one shared argmax."""
        greedy = self.argmax(logits).tolist()
        if all(p.temperature == 0 and p.logprobs is None for _, p in requests):
            return greedy, [None] * len(greedy)
        logits = logits.float()
        tokens, records = [], []
        logp = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for _, p in requests) else None
        for row, (seq_id, p) in enumerate(requests):
            token = greedy[row] if p.temperature == 0 else self._draw(logits[row], seq_id, p)
            tokens.append(token)
            if p.logprobs is None:
                records.append(None)
                continue
            top = torch.topk(logp[row], p.logprobs) if p.logprobs else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            records.append((logp[row, token].item(), pairs))
        return tokens, records

    def _draw(self, logits: torch.Tensor, seq_id: int, p: SamplingParams) -> int:
        return int(torch.multinomial(self.probs(logits, p), 1, generator=self.generator(seq_id, p)))

    def probs(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution a row of logits [vocab] (fp32) is sampled from: temperature (> 0),
        then top-k, then top-p; fp32 [vocab] summing to 1."""
        x = logits / p.temperature  # [vocab]
        if p.top_k:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs /= probs.sum()
        return probs
