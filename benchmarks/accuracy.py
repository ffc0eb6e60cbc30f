"""Perplexity of INT4 checkpoints against the float model, side by side in one run.

    python benchmarks/int4_accuracy.py --runs rtn:w4a16-asym:64 rtn:w4a16:64 --out out/bench

Each run is ALGORITHM:SCHEME:GROUP (GPTQ with act-order static, the CLI's default). Calibration: `news`, --samples x --seq-len, seed 0;
perplexity: `wiki`, --windows x 2048 (the papers' protocol). Prints a markdown table
(ppl, increase over float, increase relative to RTN's on the same scheme and group,
calibration wall time and peak memory) and writes results.json beside the checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from quantkit.eval.run import evaluate
from quantkit.quantize import Calibration, quantize
from quantkit.scheme import preset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", nargs="+", default=["rtn:w4a16-asym:64", "rtn:w4a16:64"])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results_path = a.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}

    def ppl(model: str) -> float:
        if model not in results:
            results[model] = evaluate(model, "wiki", 2048, a.windows, batch_size=1)
            results_path.write_text(json.dumps(results, indent=2))
        return results[model]["ppl"]

    base = ppl(a.model)
    rows = []
    for run in a.runs:
        algorithm, scheme, group = run.split(":")
        out = a.out / run.replace(":", "-")
        calib = None if algorithm == "rtn" else Calibration("news", a.samples, a.seq_len, 0)
        qscheme = preset(scheme).with_group_size(int(group))
        if algorithm == "gptq":
            qscheme = qscheme.replace(weights=dataclasses.replace(qscheme.weights, actorder="static"))
        if not out.exists():
            prov = quantize(a.model, qscheme, out, algorithm, calib)
        else:
            prov = json.loads((out / "quantkit.json").read_text())
        rows.append((algorithm, scheme, group, ppl(str(out)), prov))

    print(f"\nfloat {a.model}: ppl {base:.4f} (wiki, {a.windows} x 2048)\n")
    print("| algorithm | scheme | group | wiki ppl | Δ vs float | Δ / Δ(RTN) | calib time | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for algorithm, scheme, group, value, prov in rows:
        rtn = next((v for al, s, g, v, _ in rows if al == "rtn" and s == scheme and g == group), None)
        ratio = f"{(value - base) / (rtn - base):.2f}" if rtn is not None and rtn != base else "–"
        print(f"| {algorithm} | {scheme} | {group} | {value:.4f} | +{value - base:.4f} | {ratio} | "
              f"{prov['wall_time_s']:.0f} s | {prov['peak_rss_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
