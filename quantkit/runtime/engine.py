"""The engine: continuous batching over the paged KV cache.

    llm = LLM("out/smollm2-awq")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Each `step` asks the scheduler what to run, builds one flat batch of prefill and decode
tokens, runs the model, samples one token per finished prefill or decode, and hands the
tokens back to the scheduler (which stops sequences and frees their blocks).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from quantkit.errors import QuantkitError
from quantkit.malloc import keep_freed_memory
from quantkit.models.loading import check_causal_lm, load_tokenizer, resolve_model
from quantkit.progress import Track, no_progress
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.loader import load, parse_dtype, serving_dtype
from quantkit.runtime.model_runner import Batch, ModelRunner, check_supported, kv_bytes_per_block, kv_cache_dtype
from quantkit.runtime.sampling import Sampler
from quantkit.runtime.scheduler import Scheduler, SchedulerOutput
from quantkit.runtime.sequence import SamplingParams, Sequence
from quantkit.runtime.speculative import (
    NgramProposer,
    SpecStats,
    SpeculativeConfig,
    Speculator,
    parse_speculative_config,
    verify_greedy,
    verify_sampled,
)


@dataclass(slots=True)
class RequestOutput:
    """A finished (or streaming) request: text and ids so far, why it stopped, timings."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    spec: dict | None = None  # speculative decoding, once finished: `SpecStats.as_dict` of this request

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def num_blocks_for(config, kv_cache_memory: float, block_size: int, dtype: torch.dtype) -> int:
    """Blocks that fit in `kv_cache_memory`: bytes when > 1, else a fraction of free RAM/VRAM."""
    if kv_cache_memory <= 0:
        raise QuantkitError(f"--kv-cache-memory must be positive, got {kv_cache_memory}.")
    if kv_cache_memory <= 1:
        import os

        kv_cache_memory *= os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    n = int(kv_cache_memory // kv_bytes_per_block(config, block_size, dtype))
    if n < 2:
        raise QuantkitError(f"--kv-cache-memory {kv_cache_memory:.0f} bytes holds fewer than 2 KV blocks; give more.")
    return n


def default_block_size(device: torch.device) -> int:
    """Tokens per KV block: 64 on the CPU, where decode attention reads whole blocks from memory
    and longer runs of them stream faster (one 64-sequence step of smollm2's attention: 78 ms
    with 16-token blocks, 65 with 64, 64 with 128, docs/benchmarks.md), 16 on a GPU. vLLM's CPU
    build takes 128; 64 keeps prefix caching finer for the same speed."""
    return 64 if torch.device(device).type == "cpu" else 16


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of a sequence, a block at a time."""
    slots = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = block_table[b] * block_size - b * block_size  # slot of position p in block b: base + p
        slots += range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size))
    return slots


class LLM:
    """Offline engine over a float model or a quantkit checkpoint. On the CPU it calls
    `keep_freed_memory` (process-wide) and runs on torch's threads (`torch.set_num_threads`
    or OMP_NUM_THREADS; torch's default, one per core, suits a machine of its own).
    `dtype` None or "auto": `loader.serving_dtype`. Each layer's kernel is chosen once, at
    load (`backend` "auto", or "triton"/"torch" to force one everywhere); `notes` says how the
    model runs where it is not the fast way, and why."""

    def __init__(
        self,
        model: str,
        dtype: torch.dtype | str | None = None,
        kv_cache_memory: float = 1 << 30,
        block_size: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        num_blocks: int | None = None,
        backend: str = "auto",
        speculative_config: dict | str | None = None,
    ):
        speculative_config = parse_speculative_config(speculative_config)  # a mistake is told before loading
        path = resolve_model(model)
        dtype, note = serving_dtype(check_causal_lm(path), parse_dtype(dtype))
        self.notes = [note] if note else []  # what a user should know about how the model runs
        self.model = load(path, dtype)
        self.notes += getattr(self.model, "load_notes", [])  # e.g. fp4/fp8 formats dequantized at load
        check_supported(self.model)
        self.tokenizer = load_tokenizer(path)
        block_size = block_size or default_block_size(self.model.get_input_embeddings().weight.device)
        num_blocks = num_blocks or num_blocks_for(
            self.model.config, kv_cache_memory, block_size, kv_cache_dtype(self.model)
        )
        self.runner = ModelRunner(self.model, num_blocks, block_size, backend, max_num_seqs)
        self.notes += self.runner.kernel_notes()
        if self.runner.device.type == "cpu":
            keep_freed_memory()
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        eos = self.model.generation_config.eos_token_id if getattr(self.model, "generation_config", None) else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, eos_token_id=eos)
        self.sampler = Sampler(self.runner.argmax)
        self.context = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        self._ids = itertools.count()
        self.outputs: dict[int, RequestOutput] = {}
        self.seqs: dict[int, Sequence] = {}
        self.speculator = self._speculator(speculative_config)

    def _speculator(self, config: SpeculativeConfig | None) -> Speculator | None:
        if config is None:
            return None
        if config.method == "ngram":
            return Speculator(config, NgramProposer(config))
        from quantkit.runtime.draft import DraftModel

        return Speculator(config, DraftModel.for_target(self, config))

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if len(ids) + params.max_tokens > self.context:
            raise QuantkitError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.context} tokens; shorten one of them."
            )
        seq = Sequence(next(self._ids), ids, params)
        self.scheduler.add(seq)
        self.seqs[seq.seq_id] = seq
        self.outputs[seq.seq_id] = RequestOutput(
            seq.seq_id, ids, [], "", None, [] if params.logprobs is not None else None, time.perf_counter()
        )
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.outputs[request_id].finish_reason = "abort"
            self._release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def _release(self, request_id: int) -> None:
        self.seqs.pop(request_id, None)
        self.sampler.forget(request_id)
        if self.speculator is not None:
            stats = self.speculator.forget(request_id)
            self.outputs[request_id].spec = (stats or SpecStats()).as_dict()

    def _batch(self, out: SchedulerOutput, drafts: dict) -> Batch:
        """The step's flat batch: prefill chunks, then each speculating sequence's last token and
        drafts as a prefill-style chunk at its context (logits at all of them), then decodes."""
        bs, ids, pos, slots, rows, chunks = self.block_manager.block_size, [], [], [], {}, []

        def chunk(seq, start, tokens, sampled):
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            slots.extend(_slots(seq.block_table, start, start + len(tokens), bs))
            chunks.append((seq, start + len(tokens), len(tokens)))
            rows[seq.seq_id] = list(range(len(ids) - sampled, len(ids)))

        for seq, n in out.prefill:
            start = seq.num_computed_tokens
            chunk(seq, start, seq.token_ids[start : start + n], 1)
        for seq in out.decode:
            d = drafts.get(seq.seq_id, ((), None))[0]
            if d:
                chunk(seq, seq.num_tokens - 1, [seq.last_token, *d], 1 + len(d))
        num_prefill = len(ids)
        plain = [s for s in out.decode if not drafts.get(s.seq_id, ((), None))[0]]
        for seq in plain:
            p = seq.num_tokens - 1
            ids.append(seq.last_token)
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            rows[seq.seq_id] = [len(ids) - 1]
        dev = self.runner.device

        def table(rows):
            width = max((len(r) for r in rows), default=0)
            return (
                torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=dev)
                if rows
                else torch.zeros(0, 1, dtype=torch.int32, device=dev)
            )

        def ints(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=dev)

        return Batch(
            ints(ids),
            ints(pos),
            ints(slots),
            table([s.block_table for s, _, _ in chunks]),
            ints([n for _, n, _ in chunks], torch.int32),
            ints([q for _, _, q in chunks], torch.int32),
            table([s.block_table for s in plain]),
            ints([s.num_tokens for s in plain], torch.int32),
            ints([i for s in out.sampled for i in rows[s.seq_id]]),
            num_prefill,
        )

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of the requests that got a token."""
        spec = self.speculator
        if spec is not None:
            t0 = time.perf_counter()
            spec.plan(self.scheduler)
            t_plan = time.perf_counter() - t0
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self.runner.copy_blocks(out.copies)
        if spec is not None and hasattr(spec.proposer, "runner"):  # a draft model's KV is copied on write too
            spec.proposer.runner.copy_blocks(out.copies)
        drafts = {}
        if spec is not None:
            t0 = time.perf_counter()
            drafts = self._propose(out)
            t1 = time.perf_counter()
        logits = self.runner.forward(self._batch(out, drafts))
        tokens, records = self._sample(out, logits, drafts)
        if spec is not None and any(d for d, _ in drafts.values()):
            spec.stats.steps += 1
            spec.stats.draft_s += t_plan + t1 - t0
            spec.stats.verify_s += time.perf_counter() - t1
        self.scheduler.postprocess(out, tokens)
        return self._outputs(out, records)

    def _propose(self, out: SchedulerOutput) -> dict:
        speculating = [s for s in out.decode if s.num_lookahead]
        return self.speculator.proposer.propose(speculating) if speculating else {}

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, drafts: dict) -> tuple[list, list]:
        """A token per plain row (`Sampler.sample`); a speculating sequence's k + 1 rows give its
        accepted drafts and the target's next token (`verify_greedy`, `verify_sampled`), cut
        after the first token whose text completes a stop string."""
        counts = [1 + len(drafts.get(s.seq_id, ((), None))[0]) for s in out.sampled]
        if all(n == 1 for n in counts):
            return self.sampler.sample(logits, [(s.seq_id, s.params) for s in out.sampled])
        starts = list(itertools.accumulate([0] + counts[:-1]))
        plain = [i for i, n in enumerate(counts) if n == 1]
        tokens, records = [None] * len(counts), [None] * len(counts)
        if plain:
            index = torch.tensor([starts[i] for i in plain], dtype=torch.long, device=logits.device)
            requests = [(out.sampled[i].seq_id, out.sampled[i].params) for i in plain]
            for i, t, r in zip(plain, *self.sampler.sample(logits[index], requests)):
                tokens[i], records[i] = t, r
        greedy = self.runner.argmax(logits).tolist()
        for i, (seq, n) in enumerate(zip(out.sampled, counts)):
            if n == 1:
                continue
            d, q = drafts[seq.seq_id]
            p = seq.params
            if p.temperature == 0:
                accepted = verify_greedy(greedy[starts[i] : starts[i] + n], d)
            else:
                probs = torch.stack([self.sampler.probs(row, p) for row in logits[starts[i] : starts[i] + n].float()])
                accepted = verify_sampled(probs, d, q, self.sampler.generator(seq.seq_id, p))
            self.speculator.record(seq.seq_id, len(d), len(accepted) - 1)
            tokens[i] = self._before_stop(seq, accepted)
        return tokens, records

    def _before_stop(self, seq: Sequence, accepted: list[int]) -> list[int]:
        if not seq.params.stop:
            return accepted
        for j in range(len(accepted) - 1):
            text = self.tokenizer.decode(seq.output_token_ids + accepted[: j + 1], skip_special_tokens=True)
            if any(s in text for s in seq.params.stop):
                return accepted[: j + 1]
        return accepted

    def _outputs(self, out: SchedulerOutput, records: list) -> list[RequestOutput]:
        now = time.perf_counter()
        touched = []
        for seq, record in zip(out.sampled, records):
            o = self.outputs[seq.seq_id]
            if o.finish_reason == "abort":
                continue
            new = len(seq.output_token_ids) - len(o.token_ids)
            o.token_ids = list(seq.output_token_ids)
            o.token_times += [now] * new  # a verify step's tokens all arrive now
            o.first_token_time = o.first_token_time or now
            if record is not None:
                o.logprobs.append(record)
            if seq.params.stop or seq.is_finished:
                o.text = self.tokenizer.decode(o.token_ids, skip_special_tokens=True)
            hit = next((s for s in seq.params.stop if s in o.text), None)
            if hit is not None:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "stop")
                o.text = o.text[: o.text.index(hit)]
            if seq.is_finished:
                o.finish_reason, o.finish_time = seq.finish_reason, now
                self._release(seq.seq_id)
            touched.append(o)
        return touched

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        track: Track = no_progress,
    ) -> list[RequestOutput]:
        """Run the prompts to completion together; outputs in prompt order."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        steps = iter(int, 1)  # forever, until nothing is left
        for _ in track(steps, "generating", None):
            if not self.has_unfinished():
                break
            self.step()
        return [self.outputs.pop(i) for i in ids]
