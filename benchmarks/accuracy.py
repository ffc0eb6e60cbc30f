"""Perplexity of quantized checkpoints against the float model, side by side in one run.

    python benchmarks/accuracy.py --runs rtn:w4a16-asym:64 awq:w4a16-asym:64 fp8:fp8-dynamic kv:fp8

A run is one of
  rtn|awq|gptq:SCHEME:GROUP   INT4 weights (GPTQ with act-order static and range search, the
                              CLI's defaults; gptq:SCHEME:GROUP:minmax takes min-max group ranges,
                              gptq:SCHEME:GROUP:damp=D another damping,
                              gptq:SCHEME:GROUP:refine=N N passes of coordinate descent;
                              awq:SCHEME:GROUP:gptq rounds with GPTQ after AWQ's scales;
                              gptq:...:guided=N and awq:...:gptq:guided=N loss-guided Hessians)
  rtn|awq|gptq:SCHEME:GROUP:bits=B  mixed precision at B bits per weight (--target-bits),
                              compared with RTN on SCHEME:GROUP
  rtn|awq|gptq:SCHEME         a scheme with its own group (the FP4/MX formats, w4afp8, fp8-block:
                              `rtn:nvfp4a16 gptq:nvfp4a16 awq:nvfp4a16 gptq:fp8-block`), compared
                              with rtn:SCHEME (or fp8:SCHEME)
  fp8:fp8-dynamic|fp8[:smooth] FP8 weights and activations (smooth: SmoothQuant first)
  kv:fp8|int8[:head]           KV-cache scales added to the float model (head: per KV head)
Calibration: `news`, --samples x --seq-len, seed 0; perplexity: `wiki`, --windows x 2048
(the papers' protocol); KL divergence from the float model and top-1 agreement on the first
--kld-windows of those windows. Prints a markdown table (ppl, increase over float, for INT4
the increase relative to RTN's on the same scheme and group, KL and top-1, bits per weight
as inspect counts them, calibration wall time and peak memory) and keeps results.json
beside the checkpoints, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from quantkit.calibration.kv import kv_args
from quantkit.eval.gates import evaluate_gates
from quantkit.eval.run import evaluate
from quantkit.formats.inspect import describe
from quantkit.pipeline.kv import add_kv_scales
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.scheme import preset


def make(run: str, model: str, out: Path, calib: Calibration) -> dict:
    algorithm, scheme, *rest = run.split(":")
    if algorithm == "kv":
        return add_kv_scales(model, kv_args(scheme, "head" in rest), out, calib)["kv_cache"]
    if algorithm == "fp8":
        return quantize(
            model, preset(scheme), out, "fp8", calib, transforms=[("smooth", {})] if "smooth" in rest else []
        )
    group, rest = _group(rest)
    qscheme = preset(scheme) if group is None else preset(scheme).with_group_size(group)
    options = {}
    if algorithm == "gptq":
        qscheme = qscheme.replace(weights=dataclasses.replace(qscheme.weights, actorder="static"))
        options = {"range_search": "minmax" not in rest}
        for key, kind in (("damp", float), ("refine", int)):
            if (value := _setting(rest, key, kind)) is not None:
                options[key] = value
    if algorithm == "awq" and "gptq" in rest:
        options = {"gptq": True}
    if (groups := _setting(rest, "guided", int)) is not None:
        options["guided"] = groups
    return quantize(model, qscheme, out, algorithm, calib, options, target_bits=_setting(rest, "bits", float))


def _group(rest: list[str]) -> tuple[int | None, list[str]]:
    """(GROUP, the settings after it) of a run's fields after its scheme; (None, all) where the
    run names no group (the scheme's own)."""
    return (int(rest[0]), rest[1:]) if rest and rest[0].isdigit() else (None, rest)


def _setting(rest: list[str], key: str, kind):
    """The value of `key=VALUE` among a run's settings, as `kind`, or None."""
    return next((kind(r.removeprefix(f"{key}=")) for r in rest if r.startswith(f"{key}=")), None)


def reference(run: str, runs: list[str]) -> str | None:
    """The round-to-nearest run among `runs` that `run` is compared with: rtn (or fp8) on the same
    scheme and group."""
    algorithm, scheme, *rest = run.split(":")
    if algorithm == "kv":
        return None
    group, _ = _group(rest)
    names = [f"rtn:{scheme}:{group}"] if group is not None else [f"rtn:{scheme}", f"fp8:{scheme}"]
    return next((r for r in runs if r in names), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", nargs="+", default=["rtn:w4a16-asym:64", "awq:w4a16-asym:64", "gptq:w4a16-asym:64"])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--kld-windows", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results_path = a.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    calib = Calibration("news", a.samples, a.seq_len, 0)

    def ppl(model: str) -> float:
        if model not in results:
            results[model] = evaluate(model, "wiki", 2048, a.windows, batch_size=1)
            results_path.write_text(json.dumps(results, indent=2))
        return results[model]["ppl"]

    def kld(model: str) -> tuple[float, float]:
        key = f"{model} kld {a.kld_windows}"
        if key not in results:
            report = evaluate_gates(model, a.model, ppl="wiki", limit=a.kld_windows, seq_len=2048)
            results[key] = {r["metric"]: r["candidate"] for r in report["rows"]}
            results_path.write_text(json.dumps(results, indent=2))
        return results[key]["kld"], results[key]["top1_agreement"]

    base = ppl(a.model)
    rows = []
    for run in a.runs:
        out = a.out / run.replace(":", "-").replace("=", "")
        prov = make(run, a.model, out, calib) if not out.exists() else json.loads((out / "quantkit.json").read_text())
        prov = prov.get("kv_cache", prov) if run.startswith("kv:") else prov
        kl, top1 = kld(str(out))
        # the KL run scores the same windows' perplexity when it covers them all: one evaluation, not two
        value = results[f"{out} kld {a.kld_windows}"]["ppl"] if a.kld_windows == a.windows else ppl(str(out))
        rows.append((run, value, prov, kl, top1, describe(str(out))["bits_per_weight"]))

    print(f"\nfloat {a.model}: ppl {base:.4f} (wiki, {a.windows} × 2048)\n")
    print(
        f"| run | wiki ppl | Δ vs float | Δ / Δ(RTN) | KL ({a.kld_windows} windows) | top-1 | bits/weight "
        "| calibration time | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run, value, prov, kl, top1, bits in rows:
        ref = reference(run, [r for r, *_ in rows])
        rtn = next((v for r, v, *_ in rows if r == ref), None) if ref != run else None
        ratio = f"{(value - base) / (rtn - base):.2f}" if rtn is not None and rtn != base else "–"
        peak = f"{prov['peak_rss_mib']:.0f} MiB" if "peak_rss_mib" in prov else "–"
        print(
            f"| {run} | {value:.4f} | {value - base:+.4f} ({100 * (value - base) / base:+.2f}%) | {ratio} | "
            f"{kl:.4f} | {top1:.4f} | {f'{bits:.3f}' if bits else '–'} | {prov['wall_time_s']:.0f} s | {peak} |"
        )


if __name__ == "__main__":
    main()
