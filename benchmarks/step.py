"""Where a decode step's time goes at N sequences: the engine's own work (scheduling, the batch's
slot mapping and block tables, sampling, bookkeeping) against the model's forward, and inside the
forward the GEMMs, attention, KV writes, the other ops, and the time between ops (Python and
op dispatch).

    python benchmarks/step.py [--model smollm2-135m] [--seqs 64] [--steps 20] [--threads 1]

All sequences are first prefilled (prompts 32:512 tokens, as the benchmark workload), then
`--steps` pure decode steps are timed with wall-clock timers around each part of `LLM.step`,
and `--steps` more under torch's profiler, whose self times of the ops split the forward; what
the ops' own time leaves of the unprofiled forward is the time between ops.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from quantkit.perf.bench import synthetic_workload
from quantkit.runtime.engine import LLM
from quantkit.runtime.sequence import SamplingParams

KINDS = {  # profiler op name -> part of the forward
    "gemm": ("mm", "linear", "matmul", "addmm", "mkldnn", "_weight_int4pack", "_weight_int8pack", "_int_mm"),
    "attention": ("scaled_dot_product", "paged", "index_select", "_flash_attention", "quantkit_attention"),
    "kv store": ("index_copy", "index_put", "kv_store"),
}


def timed(obj, name: str, totals: dict, key: str) -> None:
    """Wrap obj.name so that its wall time accumulates in totals[key]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def kind(op: str) -> str:
    return next((k for k, names in KINDS.items() if any(n in op for n in names)), "other ops")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", default="32:512", help="prompt lengths, as the workload's (e.g. 32 or 32:512)")
    p.add_argument("--top", type=int, default=0, help="also list the N ops with the most self time")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.seqs)
    requests = synthetic_workload(llm.tokenizer, a.seqs, a.prompt, "1", seed=0)
    params = SamplingParams(max_tokens=2 * a.steps + 8, temperature=0, ignore_eos=True)
    for r in requests:
        llm.add_request(r.prompt, params)
    while llm.scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in llm.scheduler.running):
        llm.step()  # prefill everything; what follows is decode only
    for _ in range(2):
        llm.step()

    totals: dict[str, float] = defaultdict(float)
    timed(llm.scheduler, "schedule", totals, "schedule")
    timed(llm, "_batch", totals, "batch (slots, tables)")
    timed(llm.runner, "copy_blocks", totals, "copy blocks")
    timed(llm.runner, "forward", totals, "forward")
    timed(llm.sampler, "sample", totals, "sampling")
    timed(llm.scheduler, "postprocess", totals, "scheduler postprocess")
    step = 0.0
    for _ in range(a.steps):
        start = time.perf_counter()
        llm.step()
        step += time.perf_counter() - start
    totals["outputs bookkeeping"] = step - sum(totals.values())
    live, totals = totals, dict(totals)  # the timers keep counting in `live`; `totals` are the unprofiled steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            llm.step()
    profiled_forward = live["forward"] - totals["forward"]
    ops: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        ops[kind(e.key)] += e.self_cpu_time_total / 1e6
    op_time = sum(ops.values())
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: a.top]

    n = a.steps
    ms = lambda s: 1000 * s / n  # noqa: E731
    print(f"\n{a.model}, {llm.runner.dtype}, {a.seqs} sequences decoding, {a.threads} thread(s), {n} steps each\n")
    print("| part of a decode step | ms / step | share |\n|---|---|---|")
    for key, s in totals.items():
        print(f"| {key} | {ms(s):.2f} | {100 * s / step:.1f}% |")
    print(f"| **step** | **{ms(step):.2f}** | 100% |")
    engine = step - totals["forward"]
    print(f"\nThe engine's own work (everything but the forward): {ms(engine):.2f} ms, {100 * engine / step:.1f}%.")
    forward = totals["forward"]
    print("\n| inside the forward | ms / step | share of the forward |\n|---|---|---|")
    between = max(forward - op_time, 0.0)  # unprofiled wall time minus the ops' own (profiled) time
    for key, s in sorted(ops.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {ms(s):.2f} | {100 * s / forward:.1f}% |")
    print(f"| between ops (Python, dispatch) | {ms(between):.2f} | {100 * between / forward:.1f}% |")
    print(f"| **forward** | **{ms(forward):.2f}** | 100% |")
    if top:
        print("\n| op | kind | calls / step | ms / step |\n|---|---|---|---|")
        for e in top:
            print(f"| {e.key} | {kind(e.key)} | {e.count / n:g} | {ms(e.self_cpu_time_total / 1e6):.3f} |")
    print(
        f"\nScheduling, slot mapping, sampling, bookkeeping and op dispatch together: "
        f"{ms(engine + between):.2f} ms, {100 * (engine + between) / step:.1f}% of a step. "
        f"(The profiled steps took {ms(profiled_forward):.2f} ms of forward each: the profiler's own cost.)"
    )


if __name__ == "__main__":
    main()
