"""Does a cheaper sensitivity keep the choice? Mixed precision's sensitivity (`mixed.sensitivity`)
measured in full (the method's own options on every unit × format, as before 2026-12-06) and in
cheaper ways, one after the other in one process, each one's CPU seconds (`time.process_time`),
and each one's `--target-bits` choice scored by the full costs: how many fusion groups choose
differently and the summed KL (by the full costs) of its choice, against the full one's and the
uniform scheme's. No checkpoint is made (`mixed_choice.py` does that, end to end).

    OMP_NUM_THREADS=1 python benchmarks/sensitivity_choice.py [--model smollm2-135m] [--method awq]
        [--bits 4.56275] [--ways full shipped shipped:clip_rounds=0 shipped:grid=10]
        [--save FILE] [--compare FILE] [--load FILE]

`--save` keeps every way's CPU seconds and costs in FILE (JSON); `--compare` scores this run's
ways against those of another run (e.g. an earlier commit's, `benchmarks/old_tree.sh`, running
this script with that tree's python): per way saved in both, the groups choosing differently at
`--bits` and the largest relative difference of a cost (`--load` reads this run's ways from a
`--save` file instead of measuring them). A single way need not be full.

A way is `full` (the method on every unit × format with its own options: `mixed.ROUNDED` and
`mixed.SENSITIVITY_CHEAPER` empty) or `shipped` (as `--target-bits` measures: for AWQ its int8
costs by round-to-nearest), then `:KEY=VALUE` settings put in place of the method's options
(`mixed.SENSITIVITY_CHEAPER`'s role). (A third way, AWQ's scales searched once per unit, was
measured at commit 4defee1 as `abridged` and is not in the code: docs/benchmarks.md.)
The scheme is w4a16-asym group 64, the sensitivity's windows
`mixed.SENSITIVITY_WINDOWS` of `news`, seed 0; the costs are kept in `--out` (a new folder each way).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from mixed_speed import setting  # benchmarks/mixed_speed.py: "key=value" -> (key, bool / int / float)

from quantkit.calibration.method import Calibration
from quantkit.calibration.registry import METHODS
from quantkit.pipeline import mixed
from quantkit.scheme import preset


def measure(a, way: str, out: Path) -> tuple[float, list[dict]]:
    """(CPU s, the units' costs) of one way."""
    kind, *settings = way.split(":")
    if kind not in ("full", "shipped"):
        raise SystemExit(f"a way is full or shipped, then :KEY=VALUE settings; not {way!r}")
    rows, seq = mixed.SENSITIVITY_WINDOWS
    scheme = preset("w4a16-asym").with_group_size(64)
    kept = mixed.ROUNDED, mixed.SENSITIVITY_CHEAPER
    mixed.ROUNDED = {} if kind == "full" else kept[0]
    mixed.SENSITIVITY_CHEAPER = dict(map(setting, settings)) if settings or kind == "full" else kept[1]
    try:
        start = time.process_time()
        result = mixed.sensitivity(
            a.model,
            scheme,
            Calibration(samples=rows, seq_len=seq),
            method=a.method,
            options=METHODS[a.method].options(),
            cache=Path(tempfile.mkdtemp(dir=out)),
        )
        return time.process_time() - start, result["units"]
    finally:
        mixed.ROUNDED, mixed.SENSITIVITY_CHEAPER = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="awq", choices=("awq", "gptq", "rtn"))
    parser.add_argument("--bits", type=float, default=4.56275, help="--target-bits (uniform g64's bits)")
    parser.add_argument("--ways", nargs="+", default=["full", "shipped"])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "sensitivity-choice")
    parser.add_argument("--save", type=Path, default=None, help="every way's CPU s and costs (JSON)")
    parser.add_argument("--compare", type=Path, default=None, help="another run's --save file to score against")
    parser.add_argument("--load", type=Path, default=None, help="a --save file to compare instead of measuring")
    a = parser.parse_args()
    saved = json.loads(a.load.read_text()) if a.load else measure_ways(a)
    if a.save:
        a.save.write_text(json.dumps(saved))
    if a.compare:
        compare(saved, json.loads(a.compare.read_text()), a.bits)


def measure_ways(a) -> dict:
    """Measure each of `a.ways` and print its choice scored by the first (full) way's costs."""
    a.out.mkdir(parents=True, exist_ok=True)
    if a.ways[0] != "full" and len(a.ways) > 1:
        raise SystemExit("the first way is full: the others are scored by its costs")
    print(f"| {a.method} sensitivity | CPU s | ÷ full | groups choosing differently | summed KL by the full costs |")
    print("|---|---|---|---|---|")
    full, saved = None, {}
    for way in a.ways:
        seconds, units = measure(a, way, a.out)
        saved[way] = {"cpu_s": seconds, "units": units}
        if full is None:
            full, base = units, seconds
            uniform = sum(r["kld"]["int4-g64"] for r in units)
            best = mixed.choose(units, a.bits)
        choice = mixed.choose(units, a.bits)
        differ = sum(best[k] != v for k, v in choice.items())
        kl = sum(r["kld"][choice[r["label"]]] for r in full)
        kept = (uniform - kl) / (uniform - sum(r["kld"][best[r["label"]]] for r in full))
        gain = f"{kl:.5f} ({kept:.1%} of the full choice's gain)"
        print(f"| {way} | {seconds:.1f} | {seconds / base:.2f} | {differ} of {len(choice)} | {gain} |", flush=True)
    print(f"\nuniform w4a16-asym g64: summed KL {uniform:.5f} by the full costs")
    return saved


def compare(mine: dict, theirs: dict, bits: float) -> None:
    """Each way in both runs: groups choosing differently at `bits`, the largest relative cost difference."""
    print("\n| against another run | CPU s (this, that) | groups choosing differently | largest cost difference |")
    print("|---|---|---|---|")
    for way in [w for w in mine if w in theirs]:
        ours, other = mine[way]["units"], theirs[way]["units"]
        a, b = mixed.choose(ours, bits), mixed.choose(other, bits)
        pairs = [(x["kld"][k], y["kld"][k]) for x, y in zip(ours, other) for k in x["kld"] if x["kld"][k]]
        worst = max(abs(x - y) / abs(x) for x, y in pairs)
        differ = sum(a[k] != v for k, v in b.items())
        print(f"| {way} | {mine[way]['cpu_s']:.1f}, {theirs[way]['cpu_s']:.1f} | {differ} of {len(a)} | {worst:.1e} |")


if __name__ == "__main__":
    main()
