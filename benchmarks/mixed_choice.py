"""Does a cheaper sensitivity choose as well? `--target-bits` end to end (`quantize(target_bits=)`)
with the sensitivity quantizing each unit by the method's own options (as shipped) and with
`--cheaper`'s settings (`mixed.SENSITIVITY_CHEAPER`; default GPTQ without range search and
refinement passes), then, with `--uniform`, the uniform run of the same method; each run's CPU
seconds (`time.process_time`, this process) split into the sensitivity and the rest, and each
checkpoint's wiki perplexity on `--windows` windows of 2048 tokens. The runs go one after the
other in one process; the sensitivities are measured afresh (`--cache`, default a new folder).

    OMP_NUM_THREADS=1 nice -n 15 python benchmarks/mixed_choice.py [--model smollm2-135m]
        [--method gptq] [--bits 4.56275] [--windows 16] [--samples 128] [--seq-len 512] [--uniform]
        [--cheaper range_search=false refine=0] [--costs-from rtn] [--no-own] [--out /tmp/mixed-choice]

`--no-own` skips the first run (the method's own options), so the second is compared with the
uniform run alone. `--costs-from METHOD` makes the second run's sensitivity quantize each unit by METHOD with its
default options instead of `--cheaper`'s settings (e.g. AWQ's choice from round-to-nearest's costs).

The scheme is w4a16-asym group 64 (act-order static for GPTQ, as its command), calibration
`news`, seed 0, the method's default options.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mixed_speed import setting  # benchmarks/mixed_speed.py: "key=value" -> (key, bool / int / float)

from quantkit.calibration.method import Calibration
from quantkit.calibration.registry import METHODS
from quantkit.eval.run import evaluate
from quantkit.pipeline import mixed
from quantkit.pipeline.quantize import quantize
from quantkit.scheme import preset, with_actorder


def run(a, label: str, out: Path, cheaper: dict | None, cache: Path, costs_from: str | None = None) -> dict:
    """One run: the checkpoint in out/label, its CPU seconds (sensitivity, all), choice and
    perplexity; with `costs_from`, the sensitivity quantizes by that method (its own options)."""
    method = METHODS[a.method]
    scheme = with_actorder(preset("w4a16-asym").with_group_size(64), "static" if method.actorder else None)
    measure, spent = mixed.sensitivity, [0.0]

    def timed(*args, **kwargs):
        start = time.process_time()
        if costs_from:
            kwargs |= {"method": costs_from, "options": None}
        try:
            return measure(*args, **kwargs, cache=cache)
        finally:
            spent[0] += time.process_time() - start

    mixed.sensitivity, kept = timed, mixed.SENSITIVITY_CHEAPER
    mixed.SENSITIVITY_CHEAPER = cheaper or {}
    try:
        start = time.process_time()
        bits = None if cheaper is None else a.bits
        made = quantize(
            a.model,
            scheme,
            out / label,
            a.method,
            Calibration(samples=a.samples, seq_len=a.seq_len),
            overwrite=True,
            target_bits=bits,
        )
        total = time.process_time() - start
    finally:
        mixed.sensitivity, mixed.SENSITIVITY_CHEAPER = measure, kept
    ppl = evaluate(str(out / label), "wiki", limit=a.windows)["ppl"]
    choice = made.get("mixed_precision", {}).get("choice")
    return {"label": label, "sensitivity": spent[0], "total": total, "choice": choice, "ppl": ppl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="gptq", choices=("gptq", "awq", "rtn"))
    parser.add_argument("--bits", type=float, default=4.56275, help="--target-bits (uniform g64's bits)")
    parser.add_argument("--windows", type=int, default=16, help="wiki windows of 2048 tokens")
    parser.add_argument("--samples", type=int, default=128, help="calibration rows (the command's default)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    parser.add_argument("--cheaper", nargs="*", default=["range_search=false", "refine=0"])
    parser.add_argument("--costs-from", default=None, choices=("rtn", "gptq", "awq"), help="the second run's costs")
    parser.add_argument("--uniform", action="store_true", help="also the uniform run (no --target-bits)")
    parser.add_argument("--no-own", action="store_true", help="skip the run with the method's own options")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "mixed-choice")
    parser.add_argument("--cache", type=Path, default=None, help="sensitivity cache (default: a new folder)")
    a = parser.parse_args()
    cache = a.cache or Path(tempfile.mkdtemp(prefix="sensitivity-"))
    second = ("costs-" + a.costs_from, {}) if a.costs_from else ("cheaper", dict(map(setting, a.cheaper)))
    plans = [("shipped", {})] * (not a.no_own) + [second] + [("uniform", None)] * a.uniform
    print(f"| {a.method} | sensitivity (CPU s) | the rest (CPU s) | all (CPU s) | wiki ppl ({a.windows}) | choice |")
    print("|---|---|---|---|---|---|")
    rows = []
    for label, cheaper in plans:
        r = run(a, label, a.out, cheaper, cache, a.costs_from if label.startswith("costs-") else None)
        rows.append(r)
        first = rows[0]["choice"]
        differ = "" if r["choice"] is None else f"{sum(first[k] != v for k, v in r['choice'].items())} groups differ"
        rest = r["total"] - r["sensitivity"]
        line = f"| {r['label']} | {r['sensitivity']:.1f} | {rest:.1f} | {r['total']:.1f} | {r['ppl']:.4f} | {differ} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
