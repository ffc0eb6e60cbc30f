"""quantkit's INT4 W4A16 against its peers (llm-compressor, GPTQModel, AutoRound), side by side.

    OMP_NUM_THREADS=1 python benchmarks/peers.py --model smollm2-135m --windows 32 \\
        --cases quantkit-rtn:w4a16:128 quantkit-best:w4a16:128 llmc-awq:w4a16:128 llmc-gptq:w4a16:128 \\
                llmc-autoround:w4a16:128 gptqmodel:w4a16:128 autoround:w4a16:128 autoround-best:w4a16:128

A case is TOOL:SCHEME:GROUP, SCHEME w4a16 (symmetric int4, what vLLM's Marlin kernels serve) or
w4a16-asym. One run, in this order:
1. the inputs, once per model (OUT/MODEL/calib.json): the built-in float folder and the calibration
   rows exactly as `quantkit awq --calib news --samples 64 --seq-len 512` draws them (seed 0,
   `gptq_peer.prepare_inputs`); every tool calibrates on these rows and no others;
2. each case's checkpoint, made by its tool as a subprocess under `/usr/bin/time -v` (wall, user +
   system CPU, peak RSS of the whole command: imports, load, calibration, save), each peer in its
   own virtual environment under --peers (never a quantkit dependency), with the settings of its
   README example and its default dtype:
   - quantkit-rtn: `quantkit rtn`; quantkit-best: `quantkit awq --gptq --guided 4` (the best
     recipe in docs/benchmarks.md, "INT4 accuracy on smollm2-135m");
   - llmc-awq / llmc-gptq / llmc-autoround: llm-compressor's `oneshot` with `AWQModifier()` then
     `QuantizationModifier`, `GPTQModifier` or `AutoRoundModifier` (targets Linear, ignore
     lm_head, the preset W4A16 / W4A16_ASYM with the case's group size), model loaded with
     dtype="auto", saved compressed (compressed-tensors pack-quantized);
   - gptqmodel: `QuantizeConfig(bits=4, group_size=G, sym=S)`, `GPTQModel.load(path, cfg)` (its
     default dtype), `quantize(rows, batch_size=1)`, `save` (GPTQ v1);
   - autoround / autoround-best: `AutoRound(path, scheme="W4A16", group_size=G, sym=S,
     dataset=rows)`, its defaults (200 iterations) or its "best" recipe (1000 iterations; its
     512 samples replaced by the common 64 rows), saved with format="auto_gptq" (GPTQ v1);
3. one evaluator for all: quantkit's `quantkit eval --ppl wiki --limit W --baseline MODEL` code
   (`gates.measure` with `kld.Recorder` / `kld.Comparer`), the float model scored once per model
   and its log-probabilities kept in OUT/MODEL/baseline-W, then each checkpoint through quantkit's
   loader (it reads compressed-tensors and GPTQ v1), computing in float32 as the float model does
   whatever dtype its tool exported (`quantkit eval --dtype float32`; GPTQModel writes bf16,
   AutoRound fp16; before 2026-12-05 each ran in its own): perplexity of the first W 2048-token windows
   of `wiki`, KL(float ‖ checkpoint) per token and top-1 agreement on the same positions.

Prints a markdown table per model (also OUT/MODEL/table-W.md): ppl, Δ vs float, Δ / Δ(RTN of
the same scheme and group), KL, top-1, wall, CPU, peak RSS. results.json in OUT/MODEL is updated
after every step, so a run resumes and several runs on other cases can share it. A peer that
fails is a row saying why; a peer worse than RTN is marked for a look.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_peer import cpu_model, peer_env, prepare_inputs, tail, timed  # noqa: E402

TOOLS = ("quantkit-rtn", "quantkit-best", "llmc-awq", "llmc-gptq", "llmc-autoround", "gptqmodel", "autoround")
TOOLS += ("autoround-best",)
VENV = {"llmc": "llmc", "gptqmodel": "gptqmodel", "autoround": "auto-round"}  # under --peers

# llm-compressor 0.14: the README's recipes, on the common rows; prints "PEER_RESULT {json}".
LLMC = r"""
import json, sys, time
a = json.loads(sys.argv[1])
start = time.perf_counter()
import torch, transformers, llmcompressor, compressed_tensors
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from compressed_tensors.quantization import preset_name_to_scheme
model = AutoModelForCausalLM.from_pretrained(a["model"], dtype="auto")
tokenizer = AutoTokenizer.from_pretrained(a["model"])
scheme = preset_name_to_scheme("W4A16" if a["sym"] else "W4A16_ASYM", ["Linear"])
scheme.weights.group_size = a["group"]
common = dict(config_groups={"group_0": scheme}, ignore=["lm_head"])
if a["method"] == "awq":
    from llmcompressor.modifiers.transform import AWQModifier
    from llmcompressor.pipelines import cache
    # 0.14's AWQ pins its cached activations for GPU copies, which a CPU-only torch refuses: no-op here
    if not torch.cuda.is_available():
        cache.IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    recipe = [AWQModifier(), QuantizationModifier(**common)]
elif a["method"] == "gptq":
    recipe = [GPTQModifier(**common)]
else:
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    recipe = [AutoRoundModifier(**common, **a["extra"])]
rows = json.loads(open(a["calib"]).read())["samples"]
ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
loaded = time.perf_counter()
oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=len(rows), max_seq_length=len(rows[0]))
quantized = time.perf_counter()
model.save_pretrained(a["out"], save_compressed=True)
tokenizer.save_pretrained(a["out"])
settings = {}
for m in recipe:
    try:
        settings[type(m).__name__] = {k: str(v) for k, v in m.model_dump().items() if k not in ("ignore",)}
    except Exception as e:
        settings[type(m).__name__] = repr(e)
print("PEER_RESULT " + json.dumps({
    "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                 "torch": torch.__version__, "transformers": transformers.__version__},
    "settings": settings, "dtype": str(model.dtype),
    "load_s": loaded - start, "quantize_s": quantized - loaded, "save_s": time.perf_counter() - quantized,
}), flush=True)
"""

# GPTQModel: its README example (bits 4, the group size, its defaults otherwise, its default dtype).
GPTQMODEL = r"""
import json, sys, time
a = json.loads(sys.argv[1])
start = time.perf_counter()
import torch, transformers, gptqmodel
from gptqmodel import GPTQModel, QuantizeConfig
rows = json.loads(open(a["calib"]).read())["samples"]
cfg = QuantizeConfig(bits=4, group_size=a["group"], sym=a["sym"], **a["extra"])
model = GPTQModel.load(a["model"], cfg)
loaded = time.perf_counter()
model.quantize([{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows], batch_size=1)
quantized = time.perf_counter()
model.save(a["out"])
keys = ("bits", "group_size", "sym", "desc_act", "act_group_aware", "damp_percent", "mse", "format", "v2")
print("PEER_RESULT " + json.dumps({
    "versions": {"gptqmodel": gptqmodel.__version__, "torch": torch.__version__,
                 "transformers": transformers.__version__},
    "settings": {k: str(getattr(cfg, k, None)) for k in keys},
    "dtype": str(getattr(model.model, "dtype", None)),
    "load_s": loaded - start, "quantize_s": quantized - loaded, "save_s": time.perf_counter() - quantized,
}), flush=True)
"""

# AutoRound: its README example (scheme W4A16, the group size and symmetry set), default or "best".
AUTOROUND = r"""
import json, sys, time
a = json.loads(sys.argv[1])
start = time.perf_counter()
import torch, transformers, auto_round
from auto_round import AutoRound
rows = json.loads(open(a["calib"]).read())["samples"]
data = [torch.tensor([r]) for r in rows]
ar = AutoRound(a["model"], scheme="W4A16", group_size=a["group"], sym=a["sym"], dataset=data,
               nsamples=len(rows), seqlen=len(rows[0]), device_map="cpu", **a["extra"])
loaded = time.perf_counter()
ar.quantize_and_save(output_dir=a["out"], format="auto_gptq")
done = time.perf_counter()
settings = {k: str(getattr(ar, k, None)) for k in ("iters", "lr", "minmax_lr", "batch_size", "nsamples", "seqlen",
                                                  "amp", "enable_minmax_tuning", "enable_quanted_input")}
print("PEER_RESULT " + json.dumps({
    "versions": {"auto_round": auto_round.__version__, "torch": torch.__version__,
                 "transformers": transformers.__version__},
    "settings": settings, "dtype": str(getattr(getattr(ar, "model", None), "dtype", None)),
    "load_s": loaded - start, "quantize_and_save_s": done - loaded,
}), flush=True)
"""


def parse_case(case: str) -> tuple[str, str, int]:
    tool, scheme, group = case.split(":")
    if tool not in TOOLS or scheme not in ("w4a16", "w4a16-asym"):
        raise SystemExit(f"{case}: TOOL:SCHEME:GROUP with TOOL in {TOOLS}, SCHEME w4a16 or w4a16-asym")
    return tool, scheme, int(group)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cases", nargs="+", default=[f"{t}:w4a16:128" for t in TOOLS])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--peers", type=Path, default=Path("/work/peers"), help="the peers' virtual environments")
    p.add_argument("--venv", nargs="*", default=[], metavar="FAMILY=PATH", help="e.g. autoround=/work/peers/ar2")
    p.add_argument("--extra", nargs="*", default=[], metavar="TOOL.KEY=JSON", help="more settings for a peer")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--table-only", action="store_true", help="print the table of what is measured")
    p.add_argument("--out", type=Path, default=Path("out/peers"))
    return p.parse_args()


class Run:
    """One model's output folder and results.json (re-read and merged on every save, so several
    runs on other cases can share the folder)."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = (a.out / Path(a.model).name).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_path = self.out / "results.json"
        self.qk = str(Path(sys.executable).with_name("quantkit"))
        self.model_dir: Path | None = None
        self.calib_path: Path | None = None

    @property
    def results(self) -> dict:
        return json.loads(self.results_path.read_text()) if self.results_path.exists() else {}

    def put(self, key: str, value: dict) -> None:
        with open(self.out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            results = self.results | {key: value}
            tmp = self.results_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(results, indent=2))
            tmp.replace(self.results_path)

    def folder(self, case: str) -> Path:
        return self.out / case.replace(":", "-")


def time_v(path: Path) -> dict:
    """Wall, CPU (user + system) seconds and peak RSS (MiB) from a `/usr/bin/time -v` report."""
    text = path.read_text() if path.exists() else ""

    def field(name: str) -> str | None:
        m = re.search(rf"^\s*{re.escape(name)}: (.+)$", text, re.M)
        return m.group(1).strip() if m else None

    wall = field("Elapsed (wall clock) time (h:mm:ss or m:ss)")
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":")))) if wall else None
    user, system, rss = (
        field("User time (seconds)"),
        field("System time (seconds)"),
        field("Maximum resident set size (kbytes)"),
    )
    return {
        "rc": int(field("Exit status") or -1),
        "wall_s": seconds,
        "cpu_s": float(user) + float(system) if user and system else None,
        "peak_rss_mib": round(int(rss) / 1024) if rss else None,
    }


def command(run: Run, case: str) -> tuple[list[str], dict]:
    """The command that makes `case`'s checkpoint, and its environment."""
    tool, scheme, group = parse_case(case)
    a, folder, env = run.a, run.folder(case), dict(os.environ)
    if tool.startswith("quantkit"):
        cmd = [run.qk, "rtn" if tool == "quantkit-rtn" else "awq", "-m", a.model, "--scheme", scheme]
        cmd += ["--group-size", str(group), "-o", str(folder), "--overwrite"]
        if tool == "quantkit-best":
            cmd += ["--calib", "news", "--samples", str(a.samples), "--seq-len", str(a.seq_len), "--gptq"]
            cmd += ["--guided", "4"]
        return cmd, env
    family = "llmc" if tool.startswith("llmc") else "autoround" if tool.startswith("autoround") else "gptqmodel"
    venvs = {k: Path(v) for k, v in (item.split("=", 1) for item in a.venv)}
    python = venvs.get(family, a.peers / VENV[family]) / "bin" / "python"
    extra = {"autoround-best": {"iters": 1000}}.get(tool, {})
    for item in a.extra:
        key, value = item.split("=", 1)
        if key.split(".", 1)[0] == tool:
            extra[key.split(".", 1)[1]] = json.loads(value)
    args = {"model": str(run.model_dir), "calib": str(run.calib_path), "out": str(folder)}
    args |= {"sym": scheme == "w4a16", "group": group, "method": tool.removeprefix("llmc-"), "extra": extra}
    script = {"llmc": LLMC, "gptqmodel": GPTQMODEL, "autoround": AUTOROUND}[family]
    return [str(python), "-c", script, json.dumps(args)], peer_env(env) if family == "gptqmodel" else env


def quantize(run: Run, case: str) -> None:
    """Make `case`'s checkpoint under `/usr/bin/time -v`, unless results.json has it (or a run of
    the same command left its folder and time report)."""
    folder, stem = run.folder(case), run.out / case.replace(":", "-")
    done = run.results.get(case)
    if done and done.get("rc") == 0 and folder.is_dir():
        return
    cmd, env = command(run, case)
    report = stem.with_suffix(".time")
    log = stem.with_suffix(".log")
    adopted = time_v(report) if report.exists() and (folder / "config.json").exists() else None
    if adopted is None or adopted["rc"] != 0:
        shown = [c if c not in (LLMC, GPTQMODEL, AUTOROUND) else "SCRIPT" for c in cmd]
        print(f"{case}: {' '.join(shown)}", flush=True)
        timed(["/usr/bin/time", "-v", "-o", str(report), *cmd], log, env, cwd=run.out)
    result = time_v(report) | {"cmd": [c if c not in (LLMC, GPTQMODEL, AUTOROUND) else "SCRIPT" for c in cmd]}
    line = next((s for s in log.read_text().splitlines() if s.startswith("PEER_RESULT ")), None)
    if line:
        result |= json.loads(line.removeprefix("PEER_RESULT "))
    if (folder / "quantkit.json").exists():
        prov = json.loads((folder / "quantkit.json").read_text())
        result |= {"inner_wall_s": prov.get("wall_time_s"), "inner_peak_rss_mib": prov.get("peak_rss_mib")}
    if result["rc"] != 0 or not (folder / "config.json").exists():
        result |= {"rc": result["rc"] or 1, "error": tail(log, 3)}
        print(f"  failed: {result['error']}", flush=True)
    else:
        print(f"  {result['wall_s']:.0f} s wall, {result['cpu_s']:.0f} s CPU, {result['peak_rss_mib']} MiB", flush=True)
    run.put(case, result)


def baseline(run: Run) -> Path:
    """The float model's log-probabilities on the first W windows (recorded once, kept)."""
    from quantkit.eval.gates import measure
    from quantkit.eval.kld import Recorder

    folder = run.out / f"baseline-{run.a.windows}"
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key = f"eval {run.a.windows}/float"
        if key not in run.results:
            print(f"{key}: recording the float model's log-probabilities in {folder}", flush=True)
            recorder = Recorder(folder)
            m = measure(run.a.model, "wiki", [], limit=run.a.windows, observe=recorder)
            if recorder.full_from is not None:
                raise SystemExit(f"{folder}: the disk filled at window {recorder.full_from}")
            run.put(key, {"ppl": m["metrics"]["ppl"], "eval_s": m["eval_time_s"], "ppl_details": m["ppl"]})
    return folder


def evaluate(run: Run, case: str) -> None:
    """ppl, KL and top-1 of `case`'s checkpoint against the float model (or the loader's error)."""
    import torch

    from quantkit.eval.gates import measure
    from quantkit.eval.kld import Comparer

    key = f"eval {run.a.windows}/{case}"
    if key in run.results or run.results.get(case, {}).get("rc") != 0:
        return
    stored = baseline(run)
    print(f"{key}: quantkit's evaluator on {run.folder(case)}", flush=True)
    comparer = Comparer(stored)
    try:
        # in float32, the float model's dtype, whatever dtype the tool exported (GPTQModel: bf16)
        m = measure(str(run.folder(case)), "wiki", [], limit=run.a.windows, observe=comparer, dtype=torch.float32)
        s = comparer.summary()
        res = {"ppl": m["metrics"]["ppl"], "kld": s["kld"], "kld_p99": s["kld_p99"], "top1": s["top1_agreement"]}
        res |= {"positions": s["positions"], "eval_s": m["eval_time_s"]}
        print(f"  ppl {res['ppl']:.4f}, KL {res['kld']:.4f}, top-1 {res['top1']:.4f}", flush=True)
    except Exception as e:  # a checkpoint quantkit's loader cannot read is a row saying so
        res = {"error": f"{type(e).__name__}: {e}"}
        print(f"  {res['error']}", flush=True)
    run.put(key, res)


def label(case: str) -> str:
    tool, scheme, group = parse_case(case)
    return f"{tool} {scheme} g{group}"


def started(run: Run, case: str) -> str:
    """'not run', or when a run without a result yet began (its time report is made at its start)."""
    report = (run.out / case.replace(":", "-")).with_suffix(".time")
    if not report.exists():
        return "not run"
    return f"unfinished (started {datetime.datetime.fromtimestamp(report.stat().st_mtime):%H:%M})"


def table(run: Run, cases: list[str]) -> str:
    r, w = run.results, run.a.windows
    base = (r.get(f"eval {w}/float") or {}).get("ppl")
    lines = [
        f"{run.a.model}, wiki {w} × 2048; float ppl {base if base is None else f'{base:.4f}'}",
        "",
        "| case | wiki ppl | Δ vs float | Δ / Δ(RTN) | KL (nats/token) | top-1 | wall | CPU | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        q, e = r.get(case) or {}, r.get(f"eval {w}/{case}")
        _, scheme, group = parse_case(case)
        rtn = (r.get(f"eval {w}/quantkit-rtn:{scheme}:{group}") or {}).get("ppl")
        if q.get("rc", 1) != 0:
            lines.append(f"| {label(case)} | not made: {q.get('error', started(run, case))} | | | | | | | |")
            continue
        cost = f"{q['wall_s']:.0f} s | {q['cpu_s']:.0f} s | {q['peak_rss_mib']} MiB"
        if e is None or "error" in e:
            lines.append(f"| {label(case)} | eval: {(e or {}).get('error', 'not run')} | | | | | {cost} |")
            continue
        frac = f"{(e['ppl'] - base) / (rtn - base):.3f}" if rtn and base and rtn != base else ""
        flag = " (worse than RTN)" if rtn and e["ppl"] > rtn and not case.startswith("quantkit-rtn") else ""
        lines.append(
            f"| {label(case)} | {e['ppl']:.4f}{flag} | {e['ppl'] - base:+.4f} | {frac} | {e['kld']:.4f} "
            f"| {e['top1']:.4f} | {cost} |"
        )
    return "\n".join(lines)


def details(run: Run, cases: list[str]) -> str:
    """Each tool's versions, settings and dtype, as it reported them."""
    out = [f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"]
    out[0] += f", OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    for case in cases:
        q = run.results.get(case) or {}
        if "versions" in q:
            out.append(f"- {case}: {json.dumps(q['versions'])}; dtype {q.get('dtype')}")
            out.append(f"  settings {json.dumps(q.get('settings'))}")
    return "\n".join(out)


def main() -> None:
    a = parse_args()
    for case in a.cases:
        parse_case(case)
    run = Run(a)
    prepare_inputs(run)
    if not a.table_only:
        for case in a.cases:
            quantize(run, case)
            if not a.no_eval:
                evaluate(run, case)
    text = details(run, a.cases) + "\n\n" + table(run, a.cases)
    (run.out / f"table-{a.windows}.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
