"""`quantkit serve`: load a model into the engine and serve it over HTTP with uvicorn."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import torch

from quantkit.runtime.engine import LLM
from quantkit.serve.app import create_app
from quantkit.serve.async_engine import AsyncEngine


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_num_seqs: int = 64,
    max_queue: int = 256,
    kv_cache_memory: float = 1 << 30,
    served_model_name: str | None = None,
    dtype: torch.dtype | str | None = None,
    max_body_bytes: int = 1 << 20,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    log: Callable[[str], None] = print,
    speculative_config: dict | str | None = None,
) -> None:
    """Serve `model` (built-in name, folder, hub id or quantkit checkpoint) on an OpenAI-compatible
    API until SIGINT/SIGTERM; then take no new connections, let the requests in flight finish for
    up to `drain_timeout` seconds, abort the rest, stop the engine and return (exit code 0).
    `api_key` (or the QUANTKIT_API_KEY environment variable) guards the /v1 routes;
    `kv_cache_memory` is bytes when > 1, else a fraction of the free memory; `dtype` a torch
    dtype or its name ("auto" or None: `runtime.loader.serving_dtype`); `log` gets the engine's notes;
    `speculative_config` turns on speculative decoding (`runtime.speculative`)."""
    import uvicorn

    api_key = api_key or os.environ.get("QUANTKIT_API_KEY") or None
    llm = LLM(
        model,
        dtype=dtype,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=max_num_seqs,
        speculative_config=speculative_config,
    )
    for note in llm.notes:
        log(note)
    engine = AsyncEngine(llm, max_queue=max_queue)
    app = create_app(engine, served_model_name or model, api_key, max_body_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done; catch it here so that a
    # graceful SIGTERM ends with exit code 0 instead of the default handler killing us.
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        server.run()
    finally:
        engine.stop(timeout=0)  # the app's shutdown already drained it; this is for a failed start
        for sig, handler in previous.items():
            signal.signal(sig, handler)
