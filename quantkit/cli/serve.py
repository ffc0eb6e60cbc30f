"""`quantkit generate` and `quantkit serve`: the engine, streaming to a terminal or over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantkit.cli.common import DTYPE, JSON, command, note, out, rows_table, write_json
from quantkit.errors import QuantkitError

SPECULATIVE = typer.Option(
    None,
    "--speculative-config",
    help='Speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\'.',
)


def engine(model: str, dtype: str, **kwargs):
    """The engine on `model`, its notes (dtype, kernels) printed once."""
    from quantkit.runtime.engine import LLM

    llm = LLM(model, dtype=dtype, **kwargs)
    for message in llm.notes:
        note(message)
    return llm


@command
def generate(
    model: str = typer.Argument(..., help="Built-in name, local folder, hub id or quantkit checkpoint."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    max_tokens: int = typer.Option(128, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0: all)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the tokenizer's chat template."),
    dtype: str = DTYPE,
    speculative_config: Optional[str] = SPECULATIVE,
    json_path: Optional[Path] = JSON,
):
    """Stream a completion to the terminal through the engine, then print TTFT, TPOT and tokens/s."""
    from quantkit.runtime.sequence import SamplingParams

    llm = engine(model, dtype, max_num_seqs=1, speculative_config=speculative_config)
    if chat:
        if not getattr(llm.tokenizer, "chat_template", None):
            raise QuantkitError(f"{model} has no chat template; drop --chat.")
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    request = llm.add_request(prompt, params)
    shown = ""
    output = None
    while llm.has_unfinished():
        for o in llm.step():
            if o.request_id == request:
                output = o
                text = llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # wait for the rest of a multibyte character
                    out.print(text[len(shown) :], end="", markup=False, highlight=False, soft_wrap=True)
                    shown = text
    out.print()
    n = len(output.token_ids)
    total = output.finish_time - output.arrival_time
    write_json(
        json_path,
        {
            "prompt": prompt,
            "text": shown,
            "prompt_tokens": len(output.prompt_token_ids),
            "generated_tokens": n,
            "finish_reason": output.finish_reason,
            "ttft_ms": 1000 * output.ttft,
            "tpot_ms": 1000 * output.tpot if output.tpot else None,
            "tokens_per_s": n / total,
            "speculative": output.spec,
        },
    )
    out.print(
        rows_table(
            "generation",
            [
                ("tokens", f"{len(output.prompt_token_ids)} prompt, {n} generated ({output.finish_reason})"),
                ("TTFT", f"{1000 * output.ttft:.1f} ms"),
                ("TPOT", f"{1000 * output.tpot:.1f} ms" if output.tpot else "–"),
                ("throughput", f"{n / total:.1f} tokens/s"),
                *_spec_rows(output.spec),
            ],
        )
    )


def _spec_rows(spec: dict | None) -> list[tuple[str, str]]:
    if not spec or not spec["num_drafts"]:
        return []
    return [
        (
            "speculative",
            f"{spec['num_accepted_tokens']}/{spec['num_draft_tokens']} drafts accepted "
            f"({spec['acceptance_rate']:.0%}), {spec['mean_accepted_length']:.2f} tokens per verify step",
        ),
    ]


@command
def serve(
    model: str = typer.Argument(..., help="Built-in name, local folder, hub id or quantkit checkpoint."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(
        None, help="Require `Authorization: Bearer KEY` on /v1 (or QUANTKIT_API_KEY)."
    ),
    max_num_seqs: int = typer.Option(64, help="Sequences per engine step at most."),
    max_queue: int = typer.Option(256, help="Requests that may wait beyond those running; more get 429."),
    kv_cache_memory: float = typer.Option(1 << 30, help="KV-cache bytes (or a fraction of free memory)."),
    served_model_name: Optional[str] = typer.Option(None, help="The model name clients use (default: MODEL)."),
    dtype: str = DTYPE,
    speculative_config: Optional[str] = SPECULATIVE,
):
    """An OpenAI-compatible HTTP server (completions, chat, streaming, /metrics) on quantkit's engine."""
    from quantkit.serve.server import serve as run_server

    run_server(
        model,
        host,
        port,
        api_key,
        max_num_seqs,
        max_queue,
        kv_cache_memory,
        served_model_name,
        dtype,
        log=note,
        speculative_config=speculative_config,
    )
