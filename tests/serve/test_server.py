"""A real server (uvicorn on a free 127.0.0.1 port, the tiny model) against the official
openai client and raw HTTP: answers equal the offline engine's, errors take OpenAI's
shape and status, a full queue answers 429, clients that leave free their KV blocks, and
the Prometheus counters add up."""

import asyncio
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams
from quantkit.serve.app import create_app
from quantkit.serve.async_engine import AsyncEngine

torch.set_num_threads(1)
KEY = "test-key"
NAME = "tiny"
BLOCKS = 64
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = [f"The quick brown fox {i}" if i % 2 else f"Quantization maps weights {i} times" for i in range(64)]


class GatedLLM(LLM):
    """The engine with a brake for tests: `gate` cleared blocks the next step (10 s at most),
    `delay` slows every step, `fail` makes the next step raise after scheduling."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.delay, self.fail = threading.Event(), 0.0, False
        self.gate.set()

    def step(self):
        self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            self.fail = False
            self.scheduler.schedule()  # blocks taken, then the forward "crashes"
            raise RuntimeError("simulated kernel failure")
        return super().step()


@contextlib.contextmanager
def running(engine: AsyncEngine, api_key=KEY, max_body_bytes=1 << 20):
    """Serve `engine` with uvicorn in a thread on a free loopback port; yields the base URL."""
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, NAME, api_key, max_body_bytes), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()
        engine.stop()


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def idle(engine: AsyncEngine) -> bool:
    return engine.num_in_flight == 0 and engine.llm.block_manager.num_free_blocks == BLOCKS


def counters(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny-chat"
    shutil.copytree(tiny_llama, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def offline(chat_model):
    return LLM(str(chat_model), block_size=16, num_blocks=BLOCKS)


@pytest.fixture(scope="module")
def server(chat_model):
    engine = AsyncEngine(GatedLLM(str(chat_model), block_size=16, num_blocks=BLOCKS, max_num_seqs=8), max_queue=64)
    with running(engine) as url:
        yield url, engine


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=30)


def test_completions_match_the_offline_engine(server, client, offline):
    url, engine = server
    assert [m.id for m in client.models.list().data] == [NAME]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = offline.generate([PROMPTS[0]], params)[0]
    got = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), 8)
    chunks = list(
        client.completions.create(
            model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"

    # stop strings end the text before them, streaming or not
    stop = want.text[3:5]
    cut = want.text[: want.text.index(stop)]
    got = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut

    # logprobs, n samples with seeds, token-id prompts
    got = client.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == got.choices[0].text
    sampled = client.completions.create(
        model=NAME, prompt=[5, 6, 7], max_tokens=6, temperature=1, seed=3, n=2, extra_body={"ignore_eos": True}
    )
    again = client.completions.create(
        model=NAME, prompt=[5, 6, 7], max_tokens=6, temperature=1, seed=3, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert sampled.usage.completion_tokens == 12 and sampled.usage.prompt_tokens == 3
    wait_until(lambda: idle(engine))


def test_chat_streaming_and_not(server, client, offline):
    url, engine = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The lazy dog"}]
    prompt = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    got = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert len(got.choices[0].logprobs.content) == 6 and len(got.choices[0].logprobs.content[0].top_logprobs) == 2
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    wait_until(lambda: idle(engine))


def test_bad_requests_get_openai_errors(server):
    url, engine = server
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(body, path="/v1/completions", headers=auth, raw=None):
        r = httpx.post(
            f"{url}{path}", headers=headers, timeout=30, **({"content": raw} if raw is not None else {"json": body})
        )
        if r.status_code != 200:
            assert set(r.json()["error"]) >= {"message", "type", "code"}, r.text
        return r

    ok = {"model": NAME, "prompt": "hi there", "max_tokens": 2}
    assert post(ok).status_code == 200
    assert post(None, raw=b"{not json").status_code == 400
    assert post(None, raw=b"[1, 2]").status_code == 400
    assert post(None, raw=b"[" * 100_000).status_code == 400
    for bad in [
        {"max_tokens": -1},
        {"temperature": 5},
        {"temperature": "hot"},
        {"top_p": 0},
        {"n": 0},
        {"logprobs": 100},
        {"stop": 3},
        {"prompt": ""},
        {"prompt": [[]]},
        {"prompt": {"a": 1}},
        {"prompt": [1, 2, 10**6]},
        {"prompt": list(range(1, 300))},
        {"prompt": "fox " * 400},
        {"max_tokens": 10**9},
    ]:
        r = post(ok | bad)
        assert r.status_code == 400, (bad, r.text)
    assert post({"model": NAME, "messages": "hello"}, "/v1/chat/completions").status_code == 400
    assert (
        post(
            {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "/v1/chat/completions"
        ).status_code
        == 400
    )
    assert post(ok | {"model": "gpt-9"}).status_code == 404
    assert post(ok, headers={}).status_code == 401
    assert post(ok, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/v1/nothing", headers=auth, timeout=10).json()["error"]["code"] == "not_found"
    r = post(ok | {"prompt": "x" * (1 << 20)})
    assert r.status_code == 413
    wait_until(lambda: idle(engine))
    errors = {labels: v for (name, labels), v in counters(url).items() if name == "quantkit_request_errors_total"}
    assert errors[(("kind", "invalid_api_key"),)] == 3 and errors[(("kind", "request_too_large"),)] == 1


def test_clients_that_leave_free_their_blocks(server):
    url, engine = server
    before = counters(url).get(("quantkit_requests_total", (("finish_reason", "abort"),)), 0)
    engine.llm.delay = 0.02  # 200 tokens take 4 s at least: the client leaves long before
    try:
        body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(4)][0].startswith("data: ")
        wait_until(lambda: idle(engine))
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(
                f"{url}/v1/completions",
                json=body | {"stream": False},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=0.5,
            )
        wait_until(lambda: idle(engine))
    finally:
        engine.llm.delay = 0.0
    assert counters(url)[("quantkit_requests_total", (("finish_reason", "abort"),))] == before + 2


def test_64_concurrent_streams_match_offline_and_metrics_add_up(server, offline):
    url, engine = server
    want = offline.generate(PROMPTS, [SamplingParams(max_tokens=8, temperature=0, seed=i) for i in range(len(PROMPTS))])
    before = counters(url)

    async def one(client, i):
        text, finish, usage = "", None, None
        stream = await client.completions.create(
            model=NAME,
            prompt=PROMPTS[i],
            max_tokens=8,
            temperature=0,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(len(PROMPTS)))), 120)

    results = asyncio.run(main())
    assert [(t, f) for t, f, _ in results] == [(o.text, o.finish_reason) for o in want]
    assert [u.completion_tokens for *_, u in results] == [len(o.token_ids) for o in want]
    wait_until(lambda: idle(engine))
    after = counters(url)

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert grew("quantkit_generation_tokens_total") == sum(u.completion_tokens for *_, u in results)
    assert grew("quantkit_prompt_tokens_total") == sum(u.prompt_tokens for *_, u in results)
    assert grew("quantkit_time_to_first_token_seconds_count") == len(PROMPTS)
    assert grew("quantkit_e2e_request_latency_seconds_count") == len(PROMPTS)
    assert after[("quantkit_num_requests_running", ())] == 0 and after[("quantkit_kv_cache_usage_ratio", ())] == 0


def test_full_queue_answers_429_and_no_template_400(tiny_llama):
    llm = GatedLLM(str(tiny_llama), block_size=16, num_blocks=BLOCKS, max_num_seqs=1)
    engine = AsyncEngine(llm, max_queue=0)
    with running(engine, api_key=None) as url:
        llm.gate.clear()  # the engine stalls in its next step
        body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as first:
            assert first.status_code == 200
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            llm.gate.set()
            lines = [line for line in first.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"]
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        llm.fail = True  # a failing step fails its requests, frees their blocks, and the server goes on
        r = httpx.post(f"{url}/v1/completions", json=body | {"stream": False}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        wait_until(lambda: idle(engine))
        assert httpx.post(f"{url}/v1/completions", json=body | {"stream": False}, timeout=30).status_code == 200
        wait_until(lambda: idle(engine))
    assert not engine._thread.is_alive()


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(chat_model):
    code = f"from quantkit.serve.server import serve; serve({str(chat_model)!r}, port=0, max_num_seqs=2)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None:  # uvicorn names the port it got
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            found = re.search(r"running on (http://127\.0\.0\.1:\d+)", proc.stderr.readline())
            url = found and found.group(1)
        body = {
            "model": str(chat_model),
            "prompt": "The quick brown fox",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
