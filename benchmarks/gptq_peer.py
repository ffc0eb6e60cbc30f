"""quantkit's GPTQ against GPTQModel's, side by side on one independent evaluator.

    OMP_NUM_THREADS=1 python benchmarks/gptq_peer.py [--schemes w4a16 w4a16-asym] [--out out/gptq-peer]
        [--peer-python /tmp/gptqmodel-env/bin/python] [--peer-config act_group_aware=false] [--no-peer]

One run, in this order:
1. the inputs, once: the built-in smollm2-135m float folder (quantkit converts it into its cache)
   and the calibration rows exactly as `quantkit gptq --calib news --samples 64 --seq-len 512`
   draws them (`calibration_samples`, seed 0), written to OUT/calib.json for the peer;
2. for each scheme: RTN (`quantkit rtn`), quantkit's GPTQ (`quantkit gptq`, its defaults:
   act-order static, range search, plus --damp 0.05 spelled out) and GPTQModel's GPTQ (its
   own virtual environment, run as a subprocess: bits 4, group 64, desc_act False, damp 0.05,
   fp32 weights, on the rows of calib.json; saved as a GPTQ v1 checkpoint). Wall time and
   CPU time (user + sys) of each subprocess;
3. one evaluator, written here and sharing no code with quantkit's loaders: each checkpoint's
   int4 weights are unpacked by the functions below (compressed-tensors pack-quantized for
   quantkit, GPTQ v1 for GPTQModel, docs/formats.md) into the float transformers model, and
   perplexity is the mean next-token cross-entropy over the first --windows non-overlapping
   2048-token windows of the built-in `wiki` text ("\\n\\n"-joined documents, tokenized once
   without special tokens, as `quantkit eval` builds its stream), fp32;
4. a cross-check: `quantkit eval --limit WINDOWS` on the symmetric checkpoints (quantkit's own
   loader; it also reads GPTQ v1), next to this evaluator's number.

Prints a markdown table: ppl, increase over float, and each method's fraction of RTN's
increase on the same scheme, (ppl - float) / (rtn - float). Keeps results.json in OUT, so an
interrupted run resumes (--fresh starts over).

The peer is never a quantkit dependency. Its environment (GPTQModel 7.6.0 is an sdist whose
kernels compile only when used; nothing to build for CPU quantization):

    python -m venv /tmp/gptqmodel-env
    /tmp/gptqmodel-env/bin/pip install torch==2.13.0 gptqmodel==7.6.0

On a machine with 2 CPUs GPTQModel 7.6.0 stops with "Virtual pool 'model_loader:cpu' requests
2 workers but parent 'cpu' only has 1" (it gives the CPU (cpus + 1) // 2 workers and its model
loader 2); GPTQMODEL_CPU_WORKERS=2, its own setting, is passed to the peer for that. Without
the peer's python (or when it fails), quantkit's side still runs and the table says the peer
is missing, and why.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SCHEMES = ("w4a16", "w4a16-asym")

# Runs in the peer's environment: quantize with GPTQModel on the rows of calib.json, save, and
# print one line "PEER_RESULT {json}".
PEER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
start = time.perf_counter()
import torch, transformers, gptqmodel
from gptqmodel import GPTQModel, QuantizeConfig
rows = json.loads(open(args["calib"]).read())["samples"]
cfg = QuantizeConfig(bits=4, group_size=args["group_size"], sym=args["sym"], desc_act=False,
                     damp_percent=args["damp"], **args["extra"])
imported = time.perf_counter()
model = GPTQModel.load(args["model"], cfg, dtype=torch.float32)
loaded = time.perf_counter()
model.quantize([{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows],
               batch_size=1, calibration_sort=None)
quantized = time.perf_counter()
model.save(args["out"])
saved = time.perf_counter()
print("PEER_RESULT " + json.dumps({
    "versions": {"gptqmodel": gptqmodel.__version__, "torch": torch.__version__,
                 "transformers": transformers.__version__, "python": sys.version.split()[0]},
    "config": {"bits": 4, "group_size": cfg.group_size, "sym": cfg.sym, "desc_act": cfg.desc_act,
               "damp_percent": cfg.damp_percent, "act_group_aware": getattr(cfg, "act_group_aware", None),
               "mse": getattr(cfg, "mse", None), "format": str(cfg.format), "dtype": "float32"},
    "import_s": imported - start, "load_s": loaded - imported, "quantize_s": quantized - loaded,
    "save_s": saved - quantized,
}), flush=True)
"""


# ---- the evaluator's own unpacking (no quantkit code) --------------------------------------


def nibbles(words: torch.Tensor, count: int) -> torch.Tensor:
    """The 4-bit fields of int32 `words` [..., m] along the last dimension, field k of a word in
    bits 4k..4k+3 (lowest first), as int64 0..15 [..., count]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    fields = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [..., m, 8]
    return fields.flatten(-2)[..., :count]


def dequant_pack_quantized(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """compressed-tensors pack-quantized: w = (q - zero_point) * scale, q and zero points signed
    (stored + 8), the zero points packed along the output dimension; [out, in] fp32."""
    out, inp = (int(v) for v in t[f"{name}.weight_shape"])
    q = nibbles(t[f"{name}.weight_packed"], inp) - 8  # [out, in]
    scale = t[f"{name}.weight_scale"].float()  # [out, G]
    groups = scale.shape[1]
    g_idx = t.get(f"{name}.weight_g_idx")
    g_idx = torch.arange(inp) // (inp // groups) if g_idx is None else g_idx.long()
    zp = t.get(f"{name}.weight_zero_point")
    zero = torch.zeros_like(scale) if zp is None else (nibbles(zp.T, out) - 8).T.float()  # [out, G]
    return (q.float() - zero[:, g_idx]) * scale[:, g_idx]


def dequant_gptq_v1(t: dict[str, torch.Tensor], name: str, stats: dict) -> torch.Tensor:
    """GPTQ v1: qweight [in/8, out] (eight input rows per word), qzeros [G, out/8] holding the
    unsigned zero point minus one, scales [G, out], g_idx [in]; w = (q - z) * scale. GPTQModel
    writes v1 by subtracting 0x11111111 from each zero-point word (a zero point of 0 borrows from
    the next field), and reads it back by adding it, so its convention is inverted here per word,
    modulo 2^32; `stats` counts the fields where that differs from adding 1 to each field."""
    qweight, scales = t[f"{name}.qweight"], t[f"{name}.scales"].float()
    groups, out = scales.shape
    inp = qweight.shape[0] * 8
    q = nibbles(qweight.T, inp)  # [out, in], unsigned 0..15
    stored = t[f"{name}.qzeros"].to(torch.int64) & 0xFFFFFFFF
    words = (stored + 0x11111111) & 0xFFFFFFFF
    zero = nibbles(words, out)  # [G, out]
    naive = nibbles(stored, out) + 1
    stats["zero_fields"] = stats.get("zero_fields", 0) + zero.numel()
    stats["borrowed_fields"] = stats.get("borrowed_fields", 0) + int((naive != zero).sum())
    g_idx = t[f"{name}.g_idx"].long()
    plain = torch.arange(inp) // (inp // groups)
    stats["g_idx_reordered"] = stats.get("g_idx_reordered", 0) + int((g_idx != plain).any())
    return (q.float() - zero.T.float()[:, g_idx]) * scales.T[:, g_idx]


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def quantized_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """{module name: dequantized fp32 weight} of a pack-quantized or GPTQ v1 checkpoint."""
    config = json.loads((folder / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    t = read_tensors(folder)
    stats: dict = {}
    if qc.get("quant_method") == "compressed-tensors":
        names = [k.removesuffix(".weight_packed") for k in t if k.endswith(".weight_packed")]
        weights = {n: dequant_pack_quantized(t, n) for n in names}
        stats["layout"] = "pack-quantized"
    elif qc.get("quant_method") == "gptq":
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt != "gptq" or qc.get("bits") != 4:
            raise SystemExit(f"{folder}: GPTQ checkpoint_format {fmt!r}, bits {qc.get('bits')}: only 4-bit v1 is read")
        names = [k.removesuffix(".qweight") for k in t if k.endswith(".qweight")]
        weights = {n: dequant_gptq_v1(t, n, stats) for n in names}
        stats["layout"] = "gptq v1"
    else:
        raise SystemExit(f"{folder}: unknown quantization_config {qc.get('quant_method')!r}")
    return weights, stats


class Evaluator:
    """Perplexity of the float model, or of it with a checkpoint's dequantized linears, on the
    first `windows` non-overlapping `seq_len`-token windows of `wiki`."""

    def __init__(self, model_dir: Path, windows: int, seq_len: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from quantkit.calibration.datasets import load_documents  # the text only

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.float_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        text = "\n\n".join(load_documents("wiki", "eval"))
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < windows * seq_len:
            raise SystemExit(f"wiki has {len(ids)} tokens, fewer than {windows} × {seq_len}")
        self.windows = torch.tensor(ids[: windows * seq_len]).view(windows, seq_len)
        self.text_sha256 = hashlib.sha256(text.encode()).hexdigest()

    @torch.inference_mode()
    def ppl(self, folder: Path | None) -> dict:
        self.model.load_state_dict(self.float_state)
        stats: dict = {}
        if folder is not None:
            weights, stats = quantized_weights(folder)
            params = dict(self.model.named_parameters())
            for name, w in weights.items():
                p = params[f"{name}.weight"]
                if p.shape != w.shape:
                    raise SystemExit(f"{folder}: {name} is {tuple(w.shape)}, the model's {tuple(p.shape)}")
                p.copy_(w)
            stats["quantized_linears"] = len(weights)
        start = time.perf_counter()
        total = 0.0
        for window in self.windows:
            logits = self.model(window[None]).logits[0, :-1].float()
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
        nll = total / (self.windows.shape[0] * (self.windows.shape[1] - 1))
        return {"ppl": math.exp(nll), "nll": nll, "eval_s": round(time.perf_counter() - start, 1), **stats}


# ---- running things ------------------------------------------------------------------------


def timed(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run `cmd` with its output in `log`; wall and CPU (user + sys of the child and its
    children, from its own wait4, so another child finishing meanwhile is not counted) seconds."""
    start = time.perf_counter()
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall, cpu = time.perf_counter() - start, usage.ru_utime + usage.ru_stime
    return {"rc": child.returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def tail(log: Path, lines: int = 6) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return " | ".join(line.strip() for line in text[-lines:])


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--damp", type=float, default=0.05)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--peer-python", default="/tmp/gptqmodel-env/bin/python")
    p.add_argument(
        "--peer-config",
        nargs="*",
        default=[],
        metavar="KEY=JSON",
        help="more GPTQModel QuantizeConfig fields, e.g. act_group_aware=false",
    )
    p.add_argument("--no-peer", action="store_true", help="quantkit's side only")
    p.add_argument("--no-check", action="store_true", help="skip the `quantkit eval` cross-check")
    p.add_argument("--out", type=Path, default=Path("out/gptq-peer"))
    p.add_argument("--fresh", action="store_true", help="forget results.json and the checkpoints")
    return p.parse_args()


class Run:
    """One run's arguments, output folder and results (results.json, saved after every step, so
    an interrupted run resumes); the inputs and the peer's state are set by `main`."""

    def __init__(self, a: argparse.Namespace):
        if a.fresh and a.out.exists():
            shutil.rmtree(a.out)
        a.out.mkdir(parents=True, exist_ok=True)
        self.a, self.out = a, a.out.resolve()
        self.results_path = self.out / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.exists() else {}
        self.qk = str(Path(sys.executable).with_name("quantkit"))
        self.env = dict(os.environ)
        self.model_dir: Path | None = None
        self.calib_path: Path | None = None
        self.peer_missing: str | None = None
        self.evaluator: Evaluator | None = None

    def save(self) -> None:
        self.results_path.write_text(json.dumps(self.results, indent=2))

    def quantkit(self, key: str, cmd: list[str], folder: Path) -> None:
        """Run a quantkit command that writes `folder`, unless results has it already."""
        if key in self.results and folder.is_dir():
            return
        print(f"{key}: {' '.join(cmd)}", flush=True)
        r = timed(cmd, self.out / f"{key.replace('/', '-')}.log", self.env)
        if r["rc"] != 0:
            raise SystemExit(f"{key} failed (rc {r['rc']}): {tail(self.out / (key.replace('/', '-') + '.log'))}")
        prov = json.loads((folder / "quantkit.json").read_text())
        self.results[key] = r | {
            "cmd": cmd,
            "inner_wall_s": prov.get("wall_time_s"),
            "peak_rss_mib": prov.get("peak_rss_mib"),
        }
        self.save()
        print(f"  {r['wall_s']} s wall, {r['cpu_s']} s CPU", flush=True)

    def ppl(self, key: str, folder: Path | None) -> dict:
        """This evaluator's result for `folder` (None: the float model), measured once."""
        a = self.a
        ekey = f"eval {a.windows}x{a.eval_seq_len}/{key}"
        if ekey not in self.results:
            if self.evaluator is None:
                self.evaluator = Evaluator(self.model_dir, a.windows, a.eval_seq_len)
            self.results[ekey] = self.evaluator.ppl(folder) | {"text_sha256": self.evaluator.text_sha256}
            self.save()
            print(f"{ekey}: ppl {self.results[ekey]['ppl']:.4f} ({self.results[ekey]['eval_s']} s)", flush=True)
        return self.results[ekey]


def prepare_inputs(run: Run) -> None:
    """1. The float model's folder and the calibration rows, in OUT/calib.json (written once)."""
    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.models.loading import load_tokenizer, resolve_model

    a = run.a
    run.model_dir = resolve_model(a.model)
    run.calib_path = run.out / "calib.json"
    if not run.calib_path.exists():
        samples = calibration_samples(
            load_tokenizer(run.model_dir), load_documents("news", "calib"), a.samples, a.seq_len, 0
        )
        rows = samples.tolist()
        digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
        run.calib_path.write_text(json.dumps({"dataset": "news", "seed": 0, "sha256": digest, "samples": rows}))
    calib = json.loads(run.calib_path.read_text())
    print(
        f"model {run.model_dir}; calibration news {a.samples} × {a.seq_len}, sha256 {calib['sha256'][:16]}",
        flush=True,
    )


def peer_env(env: dict) -> dict:
    return env | {"GPTQMODEL_CPU_WORKERS": env.get("GPTQMODEL_CPU_WORKERS", "2")}


def why_no_peer(a: argparse.Namespace, env: dict) -> str | None:
    """Why the peer cannot run (None: it can)."""
    peer_python = Path(a.peer_python)
    if a.no_peer:
        return "not run (--no-peer)"
    if not peer_python.exists():
        return f"{peer_python} does not exist (see the docstring for the peer's environment)"
    probe = subprocess.run(
        [str(peer_python), "-c", "import gptqmodel; print(gptqmodel.__version__)"],
        capture_output=True,
        text=True,
        env=peer_env(env),
    )
    if probe.returncode != 0:
        return f"`import gptqmodel` failed: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def quantize(run: Run, scheme: str) -> None:
    """2. RTN and quantkit's GPTQ (quantkit's commands), then GPTQModel's GPTQ, for one scheme."""
    a, out, qk = run.a, run.out, run.qk
    common = ["-m", a.model, "--scheme", scheme, "--group-size", str(a.group_size)]
    folder = out / f"rtn-{scheme}"
    run.quantkit(f"{scheme}/rtn", [qk, "rtn", *common, "-o", str(folder), "--overwrite"], folder)
    folder = out / f"quantkit-gptq-{scheme}"
    calib_args = ["--calib", "news", "--samples", str(a.samples), "--seq-len", str(a.seq_len)]
    run.quantkit(
        f"{scheme}/quantkit-gptq",
        [qk, "gptq", *common, *calib_args, "--damp", str(a.damp), "-o", str(folder), "--overwrite"],
        folder,
    )
    key, folder = f"{scheme}/gptqmodel", out / f"gptqmodel-{scheme}"
    if run.peer_missing is None and not (key in run.results and run.results[key].get("rc") == 0 and folder.is_dir()):
        quantize_peer(run, scheme, key, folder)


def quantize_peer(run: Run, scheme: str, key: str, folder: Path) -> None:
    a = run.a
    shutil.rmtree(folder, ignore_errors=True)
    args = {
        "model": str(run.model_dir),
        "calib": str(run.calib_path),
        "out": str(folder),
        "group_size": a.group_size,
        "sym": scheme == "w4a16",
        "damp": a.damp,
        "extra": {k: json.loads(v) for k, v in (item.split("=", 1) for item in a.peer_config)},
    }
    peer_python = Path(a.peer_python)
    cmd = [str(peer_python), "-c", PEER, json.dumps(args)]
    print(f"{key}: {peer_python} -c PEER {json.dumps(args)}", flush=True)
    log = run.out / f"gptqmodel-{scheme}.log"
    r = timed(cmd, log, peer_env(run.env), cwd=run.out)
    line = next((s for s in log.read_text().splitlines() if s.startswith("PEER_RESULT ")), None)
    if r["rc"] != 0 or line is None or not folder.is_dir():
        run.results[key] = r | {"error": tail(log)}
        run.save()
        print(f"  GPTQModel failed (rc {r['rc']}): {tail(log)}", flush=True)
    else:
        run.results[key] = r | json.loads(line.removeprefix("PEER_RESULT "))
        run.results[key]["max_damp"] = max_damp(folder)
        run.save()
        print(f"  {r['wall_s']} s wall, {r['cpu_s']} s CPU", flush=True)


def evaluate(run: Run) -> tuple[float, list[tuple]]:
    """3. The float model's ppl and a row (scheme, method, ppl or None, its run, note) per checkpoint."""
    out, results = run.out, run.results
    base = run.ppl("float", None)["ppl"]
    rows = []
    for scheme in run.a.schemes:
        rtn = run.ppl(f"{scheme}/rtn", out / f"rtn-{scheme}")["ppl"]
        rows.append((scheme, "RTN", rtn, results[f"{scheme}/rtn"], None))
        qg = run.ppl(f"{scheme}/quantkit-gptq", out / f"quantkit-gptq-{scheme}")
        rows.append((scheme, "quantkit GPTQ", qg["ppl"], results[f"{scheme}/quantkit-gptq"], None))
        peer = results.get(f"{scheme}/gptqmodel")
        if run.peer_missing is not None and not (peer and peer.get("rc") == 0):
            rows.append((scheme, "GPTQModel GPTQ", None, None, f"missing: {run.peer_missing}"))
        elif peer is None or peer.get("rc") != 0:
            rows.append((scheme, "GPTQModel GPTQ", None, None, f"failed: {(peer or {}).get('error')}"))
        else:
            e = run.ppl(f"{scheme}/gptqmodel", out / f"gptqmodel-{scheme}")
            rows.append((scheme, "GPTQModel GPTQ", e["ppl"], peer, None))
    return base, rows


def cross_check(run: Run) -> list[tuple]:
    """4. `quantkit eval` on the symmetric checkpoints: (name, this evaluator's ppl, its result)."""
    a, out, results = run.a, run.out, run.results
    checks = []
    if a.no_check or "w4a16" not in a.schemes:
        return checks
    for name in ("quantkit-gptq", "gptqmodel"):
        folder, key = out / f"{name}-w4a16", f"check {a.windows}/{name}-w4a16"
        ours = results.get(f"eval {a.windows}x{a.eval_seq_len}/w4a16/{name}")
        if ours is None or not folder.is_dir():
            continue
        if key not in results:
            j = out / f"check-{name}.json"
            cmd = [run.qk, "eval", str(folder), "--ppl", "wiki", "--limit", str(a.windows)]
            cmd += ["--seq-len", str(a.eval_seq_len), "--json", str(j)]
            print(f"{key}: {' '.join(cmd)}", flush=True)
            r = timed(cmd, out / f"check-{name}.log", run.env)
            results[key] = r | (
                {"ppl": json.loads(j.read_text())["ppl"]}
                if r["rc"] == 0
                else {"error": tail(out / f"check-{name}.log")}
            )
            run.save()
        checks.append((name, ours["ppl"], results[key]))
    return checks


def print_header(run: Run, base: float, rows: list[tuple]) -> None:
    import transformers

    from quantkit.version import __version__

    a = run.a
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception:
        rev = "?"
    threads = run.env.get("OMP_NUM_THREADS", "unset")
    peer_versions = next((r[3]["versions"] for r in rows if r[3] and "versions" in r[3]), None)
    print()
    print(
        f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}; "
        f"quantkit {__version__} (git {rev}), torch {torch.__version__}, transformers {transformers.__version__}; "
        f"GPTQModel: {json.dumps(peer_versions) if peer_versions else run.peer_missing or 'failed'}"
    )
    print(
        f"float {a.model}: wiki ppl {base:.4f} ({a.windows} × {a.eval_seq_len}, this evaluator); calibration "
        f"news {a.samples} × {a.seq_len}, seed 0; group {a.group_size}; damp {a.damp}\n"
    )


def print_table(base: float, rows: list[tuple]) -> None:
    print("| scheme | method | wiki ppl | Δ vs float | Δ / Δ(RTN) | wall time | CPU time |")
    print("|---|---|---|---|---|---|---|")
    print(f"| | float | {base:.4f} | | | | |")
    for scheme, method, value, run, note in rows:
        if value is None:
            print(f"| {scheme} | {method} | {note} | | | | |")
            continue
        rtn = next(v for s, m, v, *_ in rows if s == scheme and m == "RTN")
        frac = (value - base) / (rtn - base)
        print(
            f"| {scheme} | {method} | {value:.4f} | {value - base:+.4f} | {frac:.2f} | "
            f"{run['wall_s']:.0f} s | {run['cpu_s']:.0f} s |"
        )


def print_details(run: Run, checks: list[tuple]) -> None:
    a, results = run.a, run.results
    for scheme in a.schemes:
        peer = results.get(f"{scheme}/gptqmodel") or {}
        if peer.get("rc") == 0:
            e = results[f"eval {a.windows}x{a.eval_seq_len}/{scheme}/gptqmodel"]
            print(
                f"\nGPTQModel {scheme}: config {json.dumps(peer.get('config'))}; load {peer['load_s']:.0f} s, "
                f"quantize {peer['quantize_s']:.0f} s, save {peer['save_s']:.0f} s; largest damp used "
                f"{peer.get('max_damp')}; zero-point fields with a borrow {e.get('borrowed_fields')} of "
                f"{e.get('zero_fields')}; linears whose g_idx is not i // group: {e.get('g_idx_reordered')}"
            )
    for scheme in a.schemes:
        r = results[f"{scheme}/quantkit-gptq"]
        print(
            f"quantkit GPTQ {scheme}: {r['inner_wall_s']} s inside quantkit (quantkit.json), "
            f"peak RSS {r['peak_rss_mib']} MiB"
        )
    for name, ours, check in checks:
        theirs = f"{check['ppl']:.4f}" if "ppl" in check else f"failed: {check.get('error')}"
        print(f"cross-check {name} w4a16: this evaluator {ours:.4f}, `quantkit eval --limit {a.windows}` {theirs}")


def main() -> None:
    run = Run(parse_args())
    prepare_inputs(run)
    run.peer_missing = why_no_peer(run.a, run.env)
    for scheme in run.a.schemes:
        quantize(run, scheme)
    base, rows = evaluate(run)
    checks = cross_check(run)
    print_header(run, base, rows)
    print_table(base, rows)
    print_details(run, checks)


def max_damp(folder: Path) -> float | None:
    """The largest damping GPTQModel used (it raises it when a Cholesky fails), from quant_log.csv."""
    import csv

    log = folder / "quant_log.csv"
    if not log.exists():
        return None
    with open(log) as f:
        damps = [float(r["damp"]) for r in csv.DictReader(f) if r.get("damp")]
    return max(damps) if damps else None


if __name__ == "__main__":
    main()
