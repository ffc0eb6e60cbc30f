"""Checkpoints against their float model on `quantkit eval`'s protocol (perplexity, KL
divergence, top-1 agreement on the same windows), the baseline scored once for all of
them: the table of docs/benchmarks.md's "Rotations fused into the weights".

    OMP_NUM_THREADS=1 python benchmarks/rotate.py --baseline smollm2-135m --limit 8 out/rtn out/rtn-rot ...

Each row: perplexity, its change against the baseline, KL (nats per position), its 99th
percentile, top-1 agreement, and the seconds the scoring took (CPU time, `process_time`)."""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from quantkit.eval.gates import measure
from quantkit.eval.kld import Comparer, Recorder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--baseline", default="smollm2-135m")
    p.add_argument("--ppl", default="wiki")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        start = time.process_time()
        base = measure(args.baseline, args.ppl, (), limit=args.limit, observe=Recorder(folder))
        base_ppl = base["metrics"]["ppl"]
        print(f"{args.baseline}: ppl {base_ppl:.4f} ({time.process_time() - start:.0f} s CPU)", flush=True)
        for name in args.checkpoints:
            start, comparer = time.process_time(), Comparer(folder)
            result = measure(name, args.ppl, (), limit=args.limit, observe=comparer)
            ppl, kl = result["metrics"]["ppl"], comparer.summary()
            row = {
                "checkpoint": name,
                "ppl": ppl,
                "increase": ppl / base_ppl - 1,
                "kld": kl["kld"],
                "kld_p99": kl["kld_p99"],
                "top1": kl["top1_agreement"],
                "cpu_s": round(time.process_time() - start, 1),
            }
            rows.append(row)
            print(
                f"| {name} | {ppl:.4f} | {row['increase']:+.2%} | {row['kld']:.4f} | {row['kld_p99']:.3f} "
                f"| {row['top1']:.4f} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": args.baseline, "baseline_ppl": base_ppl, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
