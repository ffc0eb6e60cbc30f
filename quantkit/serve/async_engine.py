"""The engine behind the server. One thread owns the `LLM` (which is not thread-safe) and
runs its step loop; asyncio handlers hand it requests and aborts through a thread-safe
inbox and get each request's output back, delta by delta, on an asyncio.Queue fed with
`loop.call_soon_threadsafe`.

    engine = AsyncEngine(LLM("out/smollm2-awq"), max_queue=64)
    stream = engine.generate("Hello", SamplingParams(max_tokens=8))  # may raise QueueFull
    await stream.ready()                                               # may raise QuantkitError
    async for delta in stream: print(delta.text, end="")
    engine.stop()
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

from quantkit.errors import QuantkitError
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams, SequenceStatus
from quantkit.serve.metrics import Metrics

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests than `max_num_seqs + max_queue` are in flight; retry after `retry_after` s."""

    retry_after = 1


class EngineStopped(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclass(slots=True)
class Delta:
    """What one request got since its previous delta. `logprobs`, when asked for, holds one
    (token id, token text, logprob, [(id, text, logprob)] top-n) per new token."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    spec: dict | None = None  # on the last delta, with speculative decoding: the request's draft counts


class RequestStream:
    """Async iterator over one request's deltas, ending after the one with a finish_reason."""

    def __init__(self, engine: AsyncEngine, request_id: int):
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_token_ids: list[int] | None = None
        self.finished = False
        self.error: BaseException | None = None

    async def _get(self):
        if self.error is not None:
            raise self.error
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished, self.error = True, item
            raise item
        return item

    async def ready(self) -> list[int]:
        """Wait until the engine took the request; returns its prompt token ids, or raises
        the QuantkitError (bad prompt or parameters) it was refused with."""
        if self.prompt_token_ids is None:
            self.prompt_token_ids = await self._get()
        return self.prompt_token_ids

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        await self.ready()
        if self.finished:
            raise StopAsyncIteration
        delta = await self._get()
        self.finished = delta.finish_reason is not None
        return delta

    def abort(self) -> None:
        """Stop the request (if it still runs) and free its KV blocks."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def __del__(self):  # a stream dropped on any path still gives its blocks back
        self.abort()


@dataclass(slots=True, eq=False)
class _Request:
    key: int
    push: functools.partial
    prompt: str | list[int]
    params: SamplingParams
    fit: bool
    accepted: float
    engine_id: int = -1
    sent: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0
    prefix: int = 0  # incremental detokenization: the window decoded each step starts here,
    read: int = 0  # and its text up to here has been sent


def _push(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _hold_back(text: str, stops: tuple[str, ...]) -> str:
    # Not sent yet: an unfinished multibyte character, and a tail that may begin a stop string.
    text = text.rstrip("\ufffd")
    cut = max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)
    return text[: len(text) - cut]


class AsyncEngine:
    """Runs `llm` in one background thread. At most `max_num_seqs + max_queue` requests are
    in flight; beyond that `generate` raises QueueFull."""

    def __init__(self, llm: LLM, max_queue: int = 256, metrics: Metrics | None = None):
        if max_queue < 0:
            raise QuantkitError(f"max_queue must be >= 0, got {max_queue}.")
        self.llm, self.max_queue = llm, max_queue
        self.metrics = metrics or Metrics()
        self.tokenizer = llm.tokenizer  # for rendering chat templates only; the engine thread encodes
        self.context = llm.context
        self.capacity = llm.scheduler.max_num_seqs + max_queue
        self._vocab = llm.model.get_input_embeddings().num_embeddings
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._reqs: dict[int, _Request] = {}  # engine thread only, by engine request id
        self._keys: dict[int, int] = {}  # our request id -> engine request id
        self._unscheduled: dict[int, _Request] = {}
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop ----
    def generate(self, prompt: str | list[int], params: SamplingParams, fit: bool = False) -> RequestStream:
        """Queue a request and return its stream. `fit` lowers max_tokens to what the context
        and the KV cache leave after the prompt. Raises QueueFull or EngineStopped."""
        stream = RequestStream(self, next(self._ids))
        push = functools.partial(_push, asyncio.get_running_loop(), stream.queue)
        with self._lock:  # checked and queued together, so nothing slips in after stop()
            if self._closed:
                raise EngineStopped("the server is shutting down and takes no new requests.")
            if self._in_flight >= self.capacity:
                raise QueueFull(f"{self._in_flight} requests are in flight, the most this server queues; retry later.")
            self._in_flight += 1
            self._inbox.put(("add", _Request(stream.request_id, push, prompt, params, fit, time.perf_counter())))
        return stream

    def abort(self, request_id: int) -> None:
        self._inbox.put(("abort", request_id))

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def stop(self, timeout: float = 30.0) -> None:
        """Take no new requests, let the running ones finish for up to `timeout` seconds, abort
        the rest, and join the engine thread. Safe to call twice."""
        with self._lock:
            self._closed = True
            self._inbox.put(("stop", time.monotonic() + timeout))
        self._thread.join(timeout + 10)

    # ---- the engine thread ----
    def _run(self) -> None:
        error = None
        try:
            self._loop()
        except Exception as e:  # a bug; fail what is in flight rather than leave clients hanging
            log.exception("the engine thread failed")
            error = RuntimeError(f"the engine failed: {e}")
        with self._lock:
            self._closed = True
        for key in list(self._keys):
            self._abort(key, error)
        for kind, arg in self._messages(block=False):
            if kind == "add":
                self._fail(arg, EngineStopped("the server is shutting down and takes no new requests."))
        self.metrics.engine_state(self.llm)

    def _loop(self) -> None:
        deadline = None
        while True:
            busy = self.llm.has_unfinished()
            for kind, arg in self._messages(block=not busy and deadline is None):
                if kind == "add":
                    self._add(arg)
                elif kind == "abort":
                    self._abort(arg)
                else:
                    deadline = arg if deadline is None else min(deadline, arg)
            if deadline is not None and (not self.llm.has_unfinished() or time.monotonic() > deadline):
                return
            if self.llm.has_unfinished():
                self._step()
            self.metrics.engine_state(self.llm)

    def _messages(self, block: bool) -> list:
        try:
            msgs = [self._inbox.get() if block else self._inbox.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _add(self, req: _Request) -> None:
        llm, bm = self.llm, self.llm.block_manager
        try:
            ids = llm.encode(req.prompt)
            if not all(0 <= t < self._vocab for t in ids):
                raise QuantkitError(f"prompt token ids must lie in [0, {self._vocab}).")
            params = req.params
            room = min(llm.context, bm.num_blocks * bm.block_size + 1) - len(ids)
            if req.fit and room >= 1:
                params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
            req.engine_id = llm.add_request(ids, params)
        except Exception as e:  # QuantkitError: the client's mistake; anything else: ours
            self._fail(req, e)
            return
        self._reqs[req.engine_id] = self._unscheduled[req.engine_id] = req
        self._keys[req.key] = req.engine_id
        self.metrics.prompt_tokens.inc(len(ids))
        req.push(ids)

    def _fail(self, req: _Request, error: BaseException) -> None:
        with self._lock:
            self._in_flight -= 1
        req.push(error)

    def _end(self, req: _Request, output, reason: str) -> None:
        self._reqs.pop(req.engine_id, None)
        self._keys.pop(req.key, None)
        self._unscheduled.pop(req.engine_id, None)
        self.llm.outputs.pop(req.engine_id, None)
        with self._lock:
            self._in_flight -= 1
        if output is not None:
            self.metrics.finished(output, req.accepted, reason)

    def _abort(self, key: int, error: BaseException | None = None) -> None:
        req = self._reqs.get(self._keys.get(key, -1))
        if req is None:
            return
        try:
            self.llm.abort(req.engine_id)
        except Exception:  # a failed step may leave it half-done; its blocks are what matter
            log.exception("aborting request %d failed", req.engine_id)
        self._end(req, self.llm.outputs.get(req.engine_id), "abort")
        req.push(error if error is not None else Delta(key, [], "", "abort", num_output_tokens=req.num_tokens))

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.llm.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight")
            self.metrics.errors.labels("engine_error").inc()
            for key in list(self._keys):
                self._abort(key, RuntimeError(f"the engine failed while running this request: {e}"))
            return
        for eid, req in list(self._unscheduled.items()):
            seq = self.llm.seqs.get(eid)
            if seq is None or seq.status is not SequenceStatus.WAITING:
                self.metrics.queue_time.observe(max(0.0, start - req.accepted))
                del self._unscheduled[eid]
        for o in outputs:
            if o.request_id in self._reqs:
                self._publish(self._reqs[o.request_id], o)

    def _detokenize(self, req: _Request, ids: list[int], flush: bool) -> str:
        # Decode a short window that starts a few tokens back, so the cost per token stays flat
        # and pieces that need their neighbours (split characters, leading spaces) come out right.
        decode = functools.partial(self.llm.tokenizer.decode, skip_special_tokens=True)
        before, window = decode(ids[req.prefix : req.read]), decode(ids[req.prefix :])
        if len(window) <= len(before) or (window.endswith("\ufffd") and not flush):
            return ""
        req.prefix, req.read = req.read, len(ids)
        return window[len(before) :]

    def _publish(self, req: _Request, o) -> None:
        new = o.token_ids[req.num_tokens :]
        req.num_tokens = len(o.token_ids)
        self.metrics.generation_tokens.inc(len(new))
        done = o.finish_reason is not None
        if req.params.stop:  # the engine decodes the whole text to look for them; reuse it
            text = o.text if done else _hold_back(o.text, req.params.stop)
            delta_text = text[len(req.sent) :]
        else:
            delta_text = self._detokenize(req, o.token_ids, flush=done)
        req.sent += delta_text
        tok = self.llm.tokenizer
        logprobs = None
        if o.logprobs is not None:
            records, req.num_logprobs = o.logprobs[req.num_logprobs :], len(o.logprobs)
            logprobs = [
                (t, tok.decode([t]), lp, [(i, tok.decode([i]), v) for i, v in top])
                for t, (lp, top) in zip(new, records)
            ]
        if done:
            self._end(req, o, o.finish_reason)
        spec = o.spec if done else None
        req.push(
            Delta(req.key, new, delta_text, o.finish_reason, logprobs, len(o.prompt_token_ids), len(o.token_ids), spec)
        )
