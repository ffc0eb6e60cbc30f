"""quantkit autoround against AutoRound's own tool (intel/auto-round 0.16), side by side.

    OMP_NUM_THREADS=1 python benchmarks/autoround_peer.py [--iters 200] [--samples 64] [--seq-len 512]
        [--batch 8] [--group-size 64] [--grids full,minmax] [--windows 8] [--out out/autoround-peer]
        [--peer-python /work/peers/auto-round/bin/python] [--no-peer] [--parallel]

One run, in this order:
1. the inputs, once: the built-in smollm2-135m float folder and the calibration rows exactly as
   `quantkit autoround --calib news --samples N --seq-len L` draws them (`calibration_samples`,
   seed 0), written to OUT/calib.json for the peer;
2. the checkpoints, w4a16 symmetric at --group-size: `quantkit rtn`, `quantkit autoround
   --iters I --batch B --grid G` for each of --grids (row `autoround` for full, AutoRound's own
   symmetric grid and the default; `autoround-minmax` for compressed-tensors' grid), and
   AutoRound's (its own virtual environment, run as a subprocess:
   `AutoRound(model, tokenizer, bits=4, group_size=G, sym=True, iters=I, nsamples=N, seqlen=L,
   batch_size=B, dataset=<the same rows>, device_map="cpu", amp=False)` then
   `quantize_and_save(format="auto_gptq")`, a GPTQ v1 folder quantkit reads); wall and CPU time
   of each (with --parallel, quantkit's and the peer's run at once, each on its own core);
3. `quantkit eval DIR --ppl wiki --limit WINDOWS --baseline smollm2-135m --json ...` on each.

Prints a markdown table (ppl, Δ / Δ(RTN), KL, top-1, times) and keeps results.json in OUT, so an
interrupted run resumes. Group 64, not 128: smollm2's hidden width 576 is 4.5 × 128, which
quantkit refuses as a group size for the linears that read it (AutoRound would pad). The peer's
environment:

    python3 -m venv /work/peers/auto-round
    /work/peers/auto-round/bin/pip install torch==2.13.0 'auto-round==0.16.*'
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_peer import cpu_model, tail, timed  # noqa: E402

# Runs in the peer's environment: quantize with AutoRound, save as GPTQ, print "PEER_RESULT {json}".
PEER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
start = time.perf_counter()
import torch, transformers, auto_round
from transformers import AutoModelForCausalLM, AutoTokenizer
from auto_round import AutoRound
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(args["model"])
rows = json.loads(open(args["calib"]).read())["samples"]
data = [torch.tensor([r]) for r in rows]
ar = AutoRound(model, tokenizer=tokenizer, bits=4, group_size=args["group_size"], sym=True, iters=args["iters"],
               nsamples=len(rows), seqlen=len(rows[0]), batch_size=args["batch"], dataset=data,
               device_map="cpu", amp=False, seed=0)
loaded = time.perf_counter()
ar.quantize_and_save(args["out"], format="auto_gptq")
done = time.perf_counter()
print("PEER_RESULT " + json.dumps({
    "versions": {"auto_round": auto_round.__version__, "torch": torch.__version__,
                 "transformers": transformers.__version__},
    "load_s": loaded - start, "quantize_save_s": done - loaded,
}), flush=True)
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--grids", default="full,minmax", help="quantkit autoround's --grid values, one row each")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("out/autoround-peer"))
    p.add_argument("--peer-python", default="/work/peers/auto-round/bin/python")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--parallel", action="store_true", help="quantkit's and the peer's quantization at once")
    return p.parse_args()


class Run:
    def __init__(self, a: argparse.Namespace):
        self.a, self.out = a, a.out.resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "results.json"
        self.results = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.qk = str(Path(sys.executable).parent / "quantkit")

    def save(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=1))


def prepare_inputs(run: Run) -> tuple[Path, Path]:
    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.models.loading import load_tokenizer, resolve_model

    model_dir = resolve_model("smollm2-135m")
    calib = run.out / "calib.json"
    if not calib.exists():
        rows = calibration_samples(
            load_tokenizer(model_dir), load_documents("news", "calib"), run.a.samples, run.a.seq_len, 0
        )
        calib.write_text(json.dumps({"samples": rows.tolist()}))
    return model_dir, calib


def quantkit_cmd(run: Run, method: str, grid: str = "full") -> list[str]:
    a = run.a
    cmd = [run.qk, method, "--model", "smollm2-135m", "--scheme", "w4a16", "--group-size", str(a.group_size)]
    cmd += ["--calib", "news", "--samples", str(a.samples), "--seq-len", str(a.seq_len)]
    if method == "autoround":
        cmd += ["--iters", str(a.iters), "--batch", str(a.batch), "--grid", grid]
    return [*cmd, "-o", str(run.out / row_key(method, grid)), "--overwrite"]


def row_key(method: str, grid: str = "full") -> str:
    return method if method == "rtn" or grid == "full" else f"{method}-{grid}"


def autoround_keys(run: Run) -> list[str]:
    return [row_key("autoround", g) for g in run.a.grids.split(",")]


def peer_cmd(run: Run, model_dir: Path, calib: Path) -> list[str]:
    a = run.a
    args = {"model": str(model_dir), "out": str(run.out / "peer"), "calib": str(calib), "iters": a.iters}
    args |= {"batch": a.batch, "group_size": a.group_size}
    return [run.a.peer_python, "-c", PEER, json.dumps(args)]


def quantize_all(run: Run, model_dir: Path, calib: Path) -> None:
    """The checkpoints (skipping any already made), the peer beside quantkit's first autoround with --parallel."""
    jobs = {"rtn": quantkit_cmd(run, "rtn")}
    jobs |= {row_key("autoround", g): quantkit_cmd(run, "autoround", g) for g in run.a.grids.split(",")}
    if not run.a.no_peer:
        jobs["peer"] = peer_cmd(run, model_dir, calib)
    todo = {k: c for k, c in jobs.items() if run.results.get(k, {}).get("rc") != 0}
    first = autoround_keys(run)[0]
    if run.a.parallel and {first, "peer"} <= todo.keys():
        env = dict(os.environ, OMP_NUM_THREADS="1")
        log = run.out / "peer.log"
        with open(log, "w") as f:  # in OUT: from the repository root its `import kernels` finds quantkit's kernels/
            peer = subprocess.Popen(todo.pop("peer"), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=run.out)
        start, ended = time.perf_counter(), {}

        def reap():  # the peer's own wall and CPU time (getrusage of all children would mix in quantkit's)
            _, status, usage = os.wait4(peer.pid, 0)
            ended.update(wall=time.perf_counter() - start, cpu=usage.ru_utime + usage.ru_stime)
            peer.returncode = os.waitstatus_to_exitcode(status)

        reaper = threading.Thread(target=reap)
        reaper.start()
        run.results[first] = timed(todo.pop(first), run.out / f"{first}.log", env)
        reaper.join()
        wall, cpu = round(ended["wall"], 1), round(ended["cpu"], 1)
        run.results["peer"] = {"rc": peer.returncode, "wall_s": wall, "cpu_s": cpu}
        _peer_result(run)
    for key, cmd in todo.items():
        print(f"{key}: {' '.join(cmd[:3])} ...", flush=True)
        run.results[key] = timed(cmd, run.out / f"{key}.log", dict(os.environ), cwd=run.out if key == "peer" else None)
        if key == "peer":
            _peer_result(run)
        run.save()
    run.save()


def _peer_result(run: Run) -> None:
    log = run.out / "peer.log"
    line = next((s for s in log.read_text().splitlines() if s.startswith("PEER_RESULT ")), None)
    if line is None:
        run.results["peer"]["error"] = tail(log, 3)
        print(f"  AutoRound failed: {tail(log, 3)}", flush=True)
    else:
        run.results["peer"] |= json.loads(line.removeprefix("PEER_RESULT "))
        inner = [p.parent for p in (run.out / "peer").rglob("config.json") if p.parent != run.out / "peer"]
        for f in inner[0].iterdir() if inner else ():  # AutoRound saves into a folder named after the model
            f.rename(run.out / "peer" / f.name)


def evaluate(run: Run, key: str) -> dict:
    ekey = f"eval {run.a.windows}/{key}"
    if run.results.get(ekey, {}).get("rc") == 0:
        return run.results[ekey]
    j = run.out / f"eval-{key}.json"
    cmd = [run.qk, "eval", str(run.out / key), "--ppl", "wiki", "--limit", str(run.a.windows)]
    cmd += ["--baseline", "smollm2-135m", "--dtype", "float32", "--json", str(j)]  # AutoRound exports fp16
    r = timed(cmd, run.out / f"eval-{key}.log", dict(os.environ))
    if r["rc"] == 0:
        rows = {row["metric"]: row for row in json.loads(j.read_text())["rows"]}
        r |= {"float_ppl": rows["ppl"]["baseline"], "ppl": rows["ppl"]["candidate"]}
        r |= {"kld": rows["kld"]["candidate"], "top1": rows["top1_agreement"]["candidate"]}
    else:
        r["error"] = tail(run.out / f"eval-{key}.log", 3)
    run.results[ekey] = r
    run.save()
    return r


def main() -> None:
    a = parse_args()
    run = Run(a)
    model_dir, calib = prepare_inputs(run)
    quantize_all(run, model_dir, calib)
    keys = ["rtn", *autoround_keys(run)] + ([] if a.no_peer else ["peer"])
    evals = {k: evaluate(run, k) for k in keys if run.results.get(k, {}).get("rc") == 0}
    print(f"\n{datetime.date.today()}, {cpu_model()}, load {os.getloadavg()[0]:.2f}")
    print(f"smollm2-135m w4a16 sym g{a.group_size}; quantkit autoround grids: {a.grids}")
    print(f"{a.samples} x {a.seq_len} news rows, {a.iters} steps of {a.batch} rows; wiki, {a.windows} windows\n")
    print("| run | wiki ppl | Δ / Δ(RTN) | KL | top-1 | quantize wall s | CPU s |\n|---|---|---|---|---|---|---|")
    for k, e in evals.items():
        print(_row(k, e, evals.get("rtn"), run.results[k]))


def _row(key: str, e: dict, rtn: dict | None, made: dict) -> str:
    if e.get("rc") != 0:
        return f"| {key} | failed: {e.get('error')} | | | | | |"
    ppl, base = e.get("ppl"), e.get("float_ppl")
    keep = (ppl - base) / (rtn["ppl"] - base) if rtn and base and rtn.get("ppl") and rtn["ppl"] != base else None
    kl, top1 = e.get("kld"), e.get("top1")
    cells = [key, f"{ppl:.4f}", f"{keep:.3f}" if keep is not None else "", f"{kl:.4f}", f"{top1:.4f}"]
    cells += [str(made.get("wall_s")), str(made.get("cpu_s"))]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
