"""The OpenAI-compatible HTTP API over an AsyncEngine: /v1/models, /v1/completions and
/v1/chat/completions (whole answers, or server-sent events ending with `data: [DONE]`),
/health and /metrics (Prometheus text). Errors take OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, and every path out of a handler aborts
the requests it started, so no client can leave KV blocks behind."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from quantkit.errors import QuantkitError
from quantkit.runtime.sequence import SamplingParams
from quantkit.serve.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestStream

MAX_N = 128
MAX_LOGPROBS = 20
POLL_S = 0.25  # how often a handler checks that its client is still connected


class APIError(Exception):
    def __init__(
        self, status: int, message: str, code: str, kind: str = "invalid_request_error", headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.headers = status, message, code, kind, headers


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code)


def _check_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401,
            "missing or wrong API key; send it as the header 'Authorization: Bearer <key>'.",
            "invalid_api_key",
            "authentication_error",
            {"WWW-Authenticate": "Bearer"},
        )


async def _read_json(request: Request, limit: int) -> dict:
    size = request.headers.get("content-length", "0")
    too_big = APIError(413, f"the request body is larger than {limit} bytes.", "request_too_large")
    if not size.isdigit() or int(size) > limit:
        raise too_big if size.isdigit() else _bad("the Content-Length header is not a number.", "invalid_header")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise _bad("the request body is not valid JSON.", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object.", "invalid_json")
    return body


def _get(body: dict, key: str, default=None):
    value = body.get(key)
    return default if value is None else value


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return prompt
    raise _bad("prompt must be a string, a list of strings, a list of token ids or a list of such lists.")


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects.")
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: only text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise _bad("message content parts must be of type text; this server reads text only.")
            content = "".join(p["text"] for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str | None):
            raise _bad("each message must be an object with a string role and string (or text parts) content.")
        out.append({"role": m["role"], "content": content or ""})
    return out


def _sampling(body: dict, chat: bool, context: int) -> tuple[list[SamplingParams], bool]:
    """One SamplingParams per choice (n of them, seed + i each) and whether max_tokens is to be fitted."""
    n = _get(body, "n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise _bad(f"n must be an integer in [1, {MAX_N}], got {n!r}.")
    max_tokens = _get(body, "max_completion_tokens", body.get("max_tokens")) if chat else _get(body, "max_tokens", 16)
    fit = max_tokens is None  # chat without a limit: up to the end of the context
    temperature = _get(body, "temperature", 1.0)
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature > 2:
        raise _bad(f"temperature must be between 0 and 2, got {temperature!r}.")
    if chat:
        top = _get(body, "top_logprobs", 0)
        logprobs = top if _get(body, "logprobs", False) is True else None
        if body.get("logprobs") not in (None, True, False):
            raise _bad("logprobs must be true or false for chat completions.")
    else:
        logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise _bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}.")
    stop = _get(body, "stop", [])
    if not isinstance(stop, str | list):
        raise _bad("stop must be a string or a list of strings.")
    seed = body.get("seed")
    try:
        return [
            SamplingParams(
                max_tokens=context if fit else max_tokens,
                temperature=temperature,
                top_p=_get(body, "top_p", 1.0),
                top_k=_get(body, "top_k", 0),
                seed=seed + i if _is_int(seed) else seed,
                stop=stop,
                logprobs=logprobs,
                ignore_eos=_get(body, "ignore_eos", False) is True,
            )
            for i in range(n)
        ], fit
    except QuantkitError as e:
        raise _bad(str(e)) from None


def _finite(v: float) -> float:
    return v if math.isfinite(v) else -9999.0


def _logprobs(entries: list, chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object for (id, text, logprob, top) entries; `offset`: text before them."""
    if chat:

        def item(text, lp):
            return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode())}

        return {
            "content": [item(t, lp) | {"top_logprobs": [item(tt, v) for _, tt, v in top]} for _, t, lp, top in entries]
        }
    offsets = []
    for _, t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for _, t, _, _ in entries],
        "token_logprobs": [_finite(lp) for _, _, lp, _ in entries],
        "top_logprobs": [{tt: _finite(v) for _, tt, v in top} for *_, top in entries],
        "text_offset": offsets,
    }


async def _merged(request: Request, streams: list[RequestStream]):
    """(choice index, delta) from all streams as they come. Ends early when the client has
    gone; on every way out it aborts the streams still running."""
    tasks = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    polled = time.monotonic()
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if time.monotonic() - polled >= POLL_S:
                polled = time.monotonic()
                if await request.is_disconnected():
                    return
            for task in sorted(done, key=tasks.get):
                i = tasks.pop(task)
                delta = task.result()
                yield i, delta
                if delta.finish_reason is None:
                    tasks[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in tasks:
            if not task.cancel() and not task.cancelled():
                task.exception()  # retrieved, so asyncio does not warn about it
        for s in streams:
            s.abort()


SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _usage(streams: list[RequestStream], n: int, completion_tokens: int, spec: list | None = None) -> dict:
    """OpenAI's usage block; with speculative decoding also `speculative`: the requests' drafts
    (verify steps), draft tokens and accepted tokens summed over the choices."""
    prompt_tokens = sum(len(s.prompt_token_ids) for s in streams[::n])  # each prompt counted once
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    spec = [s for s in spec or [] if s]
    if spec:
        usage["speculative"] = {k: sum(s[k] for s in spec) for k in SPEC_KEYS}
    return usage


async def _start(engine: AsyncEngine, prompts: list, params: list[SamplingParams], fit: bool) -> list[RequestStream]:
    """Queue n requests per prompt and wait until the engine took them all; on any failure
    abort those already queued and raise the matching APIError."""
    streams = []
    try:
        for prompt in prompts:
            streams += [engine.generate(prompt, p, fit) for p in params]
        for s in streams:
            await s.ready()
        return streams
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, QueueFull):
            raise APIError(429, str(e), "queue_full", "rate_limit_error", {"Retry-After": str(e.retry_after)}) from None
        if isinstance(e, EngineStopped):
            raise APIError(503, str(e), "unavailable", "server_error", {"Retry-After": "5"}) from None
        if isinstance(e, QuantkitError):
            raise _bad(str(e)) from None
        raise


async def _collect(
    request: Request, streams: list[RequestStream], n: int, chat: bool, head: dict, logprobs: bool
) -> dict:
    texts, reasons, counts = [""] * len(streams), [None] * len(streams), [0] * len(streams)
    entries, spec = [[] for _ in streams], [None] * len(streams)
    async for i, d in _merged(request, streams):
        texts[i] += d.text
        reasons[i], counts[i] = d.finish_reason, d.num_output_tokens
        spec[i] = d.spec or spec[i]
        entries[i] += d.logprobs or []
    choices = []
    for i, (text, reason, e) in enumerate(zip(texts, reasons, entries)):
        answer = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        choices.append(
            {"index": i, **answer, "logprobs": _logprobs(e, chat) if logprobs else None, "finish_reason": reason}
        )
    return head | {"choices": choices, "usage": _usage(streams, n, sum(counts), spec)}


async def _sse(request: Request, streams: list[RequestStream], n: int, chat: bool, head: dict, usage: bool, metrics):
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`."""
    head = head | {"object": "chat.completion.chunk"} if chat else head
    extra = {"usage": None} if usage else {}

    def event(chunk: dict) -> str:
        return f"data: {json.dumps(chunk)}\n\n"

    offsets, produced, spec = [0] * len(streams), [0] * len(streams), [None] * len(streams)
    try:
        if chat:
            for i in range(len(streams)):
                yield event(
                    head
                    | {
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    }
                    | extra
                )
        async for i, d in _merged(request, streams):
            produced[i] = d.num_output_tokens
            spec[i] = d.spec or spec[i]
            if not (d.text or d.finish_reason or d.logprobs):
                continue
            lp = _logprobs(d.logprobs, chat, offsets[i]) if d.logprobs is not None else None
            offsets[i] += sum(len(t) for _, t, _, _ in d.logprobs or [])
            answer = (
                {"delta": {"content": d.text} if d.text or not d.finish_reason else {}} if chat else {"text": d.text}
            )
            yield event(
                head | {"choices": [{"index": i, **answer, "logprobs": lp, "finish_reason": d.finish_reason}]} | extra
            )
        if usage:
            yield event(head | {"choices": [], "usage": _usage(streams, n, sum(produced), spec)})
    except Exception as e:  # the engine failed mid-stream: say so in the stream
        metrics.errors.labels("internal_error").inc()
        yield event({"error": {"message": str(e), "type": "server_error", "param": None, "code": "internal_error"}})
    yield "data: [DONE]\n\n"


def _error_response(metrics, status: int, message: str, code: str, kind: str, headers=None) -> JSONResponse:
    metrics.errors.labels(code).inc()
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status, headers)


def _add_error_handlers(app: FastAPI, metrics) -> None:
    # every error leaves in OpenAI's shape and is counted by its code
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error_response(metrics, e.status, e.message, e.code, e.kind, e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return _error_response(
            metrics,
            e.status_code,
            str(e.detail),
            "not_found" if e.status_code == 404 else "http_error",
            "invalid_request_error",
            getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return _error_response(metrics, 500, f"internal error: {e}", "internal_error", "server_error")


async def _open_request(request: Request, api_key: str | None, max_body_bytes: int, served_model_name: str) -> dict:
    _check_key(request, api_key)
    body = await _read_json(request, max_body_bytes)
    model = body.get("model", served_model_name)
    if model != served_model_name:
        raise APIError(
            404, f"model {model!r} does not exist; this server serves {served_model_name!r}.", "model_not_found"
        )
    return body


async def _respond(
    request: Request, engine: AsyncEngine, served_model_name: str, body: dict, prompts: list, chat: bool
):
    params, fit = _sampling(body, chat, engine.context)
    stream_options = _get(body, "stream_options", {})
    if not isinstance(stream_options, dict):
        raise _bad("stream_options must be an object.")
    streams = await _start(engine, prompts, params, fit)
    rid, kind = (
        (f"chatcmpl-{uuid.uuid4().hex}", "chat.completion") if chat else (f"cmpl-{uuid.uuid4().hex}", "text_completion")
    )
    head = {"id": rid, "object": kind, "created": int(time.time()), "model": served_model_name}
    if _get(body, "stream", False):
        usage = stream_options.get("include_usage") is True
        events = _sse(request, streams, len(params), chat, head, usage, engine.metrics)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(request, streams, len(params), chat, head, params[0].logprobs is not None)


def _chat_prompt(engine: AsyncEngine, served_model_name: str, messages: list[dict]) -> str:
    if not getattr(engine.tokenizer, "chat_template", None):
        raise _bad(f"{served_model_name} has no chat template; use /v1/completions.", "no_chat_template")
    try:
        return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise _bad(f"the chat template failed on these messages: {e}", "invalid_messages") from None


def create_app(
    engine: AsyncEngine, served_model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20
) -> FastAPI:
    """The FastAPI app serving `engine` as model `served_model_name`. With `api_key`, every
    /v1 route wants `Authorization: Bearer <api_key>`; /health and /metrics stay open.
    Shutting the app down stops the engine."""
    metrics, created = engine.metrics, int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app, metrics)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(request, api_key)
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "quantkit"}
        return {"object": "list", "data": [card | {"max_model_len": engine.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _open_request(request, api_key, max_body_bytes, served_model_name)
        return await _respond(request, engine, served_model_name, body, _prompts(body.get("prompt")), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _open_request(request, api_key, max_body_bytes, served_model_name)
        messages = _messages(body.get("messages"))
        prompt = _chat_prompt(engine, served_model_name, messages)
        return await _respond(request, engine, served_model_name, body, [prompt], chat=True)

    return app
