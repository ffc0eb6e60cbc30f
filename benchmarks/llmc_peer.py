"""quantkit's FP8 block-wise / NVFP4 / MXFP4 / MXFP8 checkpoints against llm-compressor's, side by side.

    OMP_NUM_THREADS=1 python benchmarks/llmc_peer.py [--cases fp8-block/rtn nvfp4a16/rtn ...]
        [--out out/llmc-peer] [--peer-python /tmp/llmc-env/bin/python] [--peer-dtype float32] [--no-peer]

One run, in this order:
1. the inputs, once: the built-in smollm2-135m float folder and the calibration rows exactly as
   `quantkit rtn|gptq --calib news --samples 64 --seq-len 512` draws them (`calibration_samples`,
   seed 0), written to OUT/calib.json for the peer (used by the cases that calibrate: NVFP4's
   input global scales, GPTQ);
2. for each case (scheme/method): quantkit's checkpoint (`quantkit rtn`, `quantkit fp8` for
   fp8-block, `quantkit gptq`, their defaults) and llm-compressor's (its own virtual environment,
   run as a subprocess: `oneshot` with `QuantizationModifier(targets="Linear", scheme=PRESET,
   ignore=["lm_head"])` or `GPTQModifier` with the same arguments and its defaults, for the awq cases
   its `AWQModifier()` (default mappings and grid) before either, the model loaded in --peer-dtype,
   saved with `save_compressed=True`); quantkit's awq-gptq is `quantkit awq --gptq`. Wall time of
   each; --no-quantkit makes llm-compressor's side only;
3. the two folders compared tensor by tensor (safetensors): names only one side has, and per kind
   of tensor (weight_packed, weight_scale, ...) dtype and shape agreement and the exact-equality
   count (bytes); then each linear's weight dequantized by the decoder below (no quantkit code:
   e2m1 codes, e4m3 / e8m0 / block scales, docs/formats.md) and compared: linears bit-identical,
   elements that differ, max |Δ|;
4. `quantkit eval DIR --ppl wiki --limit WINDOWS --baseline MODEL --json ...` on every checkpoint of
   both tools (quantkit's loader reads both): perplexity of the first WINDOWS 2048-token windows of
   the built-in wiki text, KL divergence and top-1 agreement against the float model on the same
   positions. A checkpoint quantkit cannot load is reported with its error.

Prints markdown tables; keeps results.json in OUT, so an interrupted run resumes (--fresh starts
over). The peer is never a quantkit dependency. Its environment:

    python3 -m venv /tmp/llmc-env
    /tmp/llmc-env/bin/pip install llmcompressor==0.14.0.1 torch==2.13.0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_peer import cpu_model, read_tensors, tail, timed  # noqa: E402

# case: (quantkit scheme, method, llm-compressor preset, calibrates)
CASES = {
    "fp8-block/rtn": ("fp8-block", "rtn", "FP8_BLOCK", False),
    "nvfp4a16/rtn": ("nvfp4a16", "rtn", "NVFP4A16", False),
    "mxfp4a16/rtn": ("mxfp4a16", "rtn", "MXFP4A16", False),
    "nvfp4/rtn": ("nvfp4", "rtn", "NVFP4", True),
    "mxfp8/rtn": ("mxfp8", "rtn", "MXFP8", False),
    "nvfp4a16/gptq": ("nvfp4a16", "gptq", "NVFP4A16", True),
    "nvfp4a16/awq": ("nvfp4a16", "awq", "NVFP4A16", True),
    "nvfp4a16/awq-gptq": ("nvfp4a16", "awq-gptq", "NVFP4A16", True),
    "mxfp4/rtn": ("mxfp4", "rtn", "MXFP4", False),
    "w4afp8/rtn": ("w4afp8", "rtn", "W4AFP8", False),
    **{
        f"{scheme}/gptq": (scheme, "gptq", preset, True)
        for scheme, preset in (
            ("fp8-block", "FP8_BLOCK"),
            ("mxfp8", "MXFP8"),
            ("nvfp4", "NVFP4"),
            ("mxfp4a16", "MXFP4A16"),
            ("mxfp4", "MXFP4"),
            ("w4afp8", "W4AFP8"),
        )
    },
}
# quantkit's command line for a method: awq-gptq is AWQ's scales with GPTQ's rounding (`quantkit awq --gptq`),
# llm-compressor's AWQModifier (a transform since 0.14) before its GPTQModifier
COMMANDS = {"awq-gptq": ["awq", "--gptq"]}
DEFAULT_CASES = ("fp8-block/rtn", "nvfp4a16/rtn", "mxfp4a16/rtn", "nvfp4/rtn", "mxfp8/rtn", "nvfp4a16/gptq")

# Runs in the peer's environment: quantize with llm-compressor, save compressed, print one line
# "PEER_RESULT {json}".
PEER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
start = time.perf_counter()
import torch, transformers, llmcompressor, compressed_tensors
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
dtype = "auto" if args["dtype"] == "auto" else getattr(torch, args["dtype"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=dtype)
tokenizer = AutoTokenizer.from_pretrained(args["model"])
method = args["method"]
cls = GPTQModifier if method.endswith("gptq") else QuantizationModifier
recipe = cls(targets="Linear", scheme=args["preset"], ignore=["lm_head"])
if method.startswith("awq"):
    from llmcompressor.modifiers.transform import AWQModifier
    from llmcompressor.pipelines import cache
    # 0.14's AWQ pins its cached activations for GPU copies, which a CPU-only torch refuses: no-op here
    if not torch.cuda.is_available():
        cache.IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    recipe = [AWQModifier(), recipe]
kwargs = {}
if args["calib"]:
    from datasets import Dataset
    rows = json.loads(open(args["calib"]).read())["samples"]
    ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    kwargs = dict(dataset=ds, num_calibration_samples=len(rows), max_seq_length=len(rows[0]))
loaded = time.perf_counter()
oneshot(model=model, recipe=recipe, **kwargs)
quantized = time.perf_counter()
model.save_pretrained(args["out"], save_compressed=True)
tokenizer.save_pretrained(args["out"])
try:
    settings = {type(m).__name__ + "." + k: str(v) for m in (recipe if isinstance(recipe, list) else [recipe])
                for k, v in m.model_dump().items() if k not in ("targets", "ignore")}
except Exception as e:
    settings = {"error": repr(e)}
print("PEER_RESULT " + json.dumps({
    "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                 "torch": torch.__version__, "transformers": transformers.__version__},
    "modifier": "+".join(type(m).__name__ for m in (recipe if isinstance(recipe, list) else [recipe])),
    "settings": settings, "dtype": str(model.dtype),
    "load_s": loaded - start, "quantize_s": quantized - loaded, "save_s": time.perf_counter() - quantized,
}), flush=True)
"""

# ---- the comparison's own decoder (no quantkit code) ---------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2], column 2j in the low nibble of byte j, code = sign << 3 | index: fp32 [out, in]."""
    b = packed.to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [out, in]
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).float()
    return sign * E2M1[codes & 7]


def expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A scale per block [R, C] spread over [rows, cols] (blocks of ceil(rows/R) x ceil(cols/C), last ones partial)."""
    br, bc = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def dequantize(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Module `name`'s weight as fp32 [out, in], from whichever layout it is stored in."""
    scale = t.get(f"{name}.weight_scale")
    if f"{name}.weight_packed" in t:  # NVFP4 (fp8 scales, global scale) or MXFP4 (e8m0 bytes)
        q = e2m1(t[f"{name}.weight_packed"])
        if f"{name}.weight_global_scale" in t:
            s = scale.float() / t[f"{name}.weight_global_scale"].float()
        else:
            s = torch.exp2(scale.to(torch.int64).float() - 127)
        return q * expand(s, *q.shape)
    w = t[f"{name}.weight"]
    if scale is None:
        return w.float()
    s = torch.exp2(scale.to(torch.int64).float() - 127) if scale.dtype == torch.uint8 else scale.float()
    return w.float() * expand(s, *w.shape)


def linears(t: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k.rsplit(".", 1)[0] for k in t if k.endswith(".weight_scale"))


def kind(name: str, t: torch.Tensor) -> str:
    last = name.rsplit(".", 1)[-1]
    if last != "weight":
        return last
    return "weight (fp8)" if t.dtype == torch.float8_e4m3fn else "unquantized float"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(equal elements, elements) of two tensors of one dtype and shape, compared as bytes."""
    x, y = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    width = a.element_size()
    eq = (x.view(-1, width) == y.view(-1, width)).all(-1) if width > 1 else (x == y).view(-1)
    return int(eq.sum()), a.numel()


def compare(ours: Path, theirs: Path) -> dict:
    """Tensor by tensor: names, dtype/shape/byte equality per kind, dequantized weights per linear."""
    a, b = read_tensors(ours), read_tensors(theirs)
    kinds: dict[str, dict] = {}
    for name in sorted(set(a) & set(b)):
        k = kinds.setdefault(kind(name, a[name]), {"tensors": 0, "identical": 0, "equal": 0, "elements": 0})
        k["tensors"] += 1
        x, y = a[name], b[name]
        k.setdefault("dtypes", set()).add(f"{x.dtype}/{y.dtype}".replace("torch.", ""))
        if x.shape != y.shape:
            k.setdefault("shape_mismatch", []).append(f"{name}: {tuple(x.shape)} vs {tuple(y.shape)}")
            continue
        if x.dtype != y.dtype:
            x, y = x.float(), y.float()
        eq, n = same_bytes(x, y)
        if name.endswith(".weight_packed") and eq != n:
            codes = [torch.stack([v.long() & 0xF, v.long() >> 4], -1) for v in (x, y)]
            diff = codes[0] != codes[1]
            k["codes_differ"] = k.get("codes_differ", 0) + int(diff.sum())
            k["signed_zeros"] = k.get("signed_zeros", 0) + int((diff & ((codes[0] | codes[1]) & 7 == 0)).sum())
        k["equal"] += eq
        k["elements"] += n
        k["identical"] += eq == n
    for k in kinds.values():
        k["dtypes"] = sorted(k["dtypes"])
    deq = {"linears": 0, "identical": 0, "differ": 0, "elements": 0, "max_abs": 0.0, "worst": None}
    for name in sorted(set(linears(a)) & set(linears(b))):
        x, y = dequantize(a, name), dequantize(b, name)
        if x.shape != y.shape:
            deq.setdefault("shape_mismatch", []).append(name)
            continue
        d = (x - y).abs()
        deq["linears"] += 1
        deq["identical"] += bool((d == 0).all())
        deq["differ"] += int((d != 0).sum())
        deq["elements"] += d.numel()
        if float(d.max()) > deq["max_abs"]:
            deq["max_abs"], deq["worst"] = float(d.max()), name
    qc = [json.loads((f / "config.json").read_text()).get("quantization_config", {}) for f in (ours, theirs)]
    return {
        "only_quantkit": sorted(set(a) - set(b)),
        "only_llmc": sorted(set(b) - set(a)),
        "kinds": kinds,
        "dequantized": deq,
        "config_differs": config_diff(*qc),
    }


def same_model(c: dict) -> bool:
    """Both checkpoints hold the same tensors up to the sign of e2m1 zeros (same names, every
    dequantized weight and every other tensor equal)."""
    d = c["dequantized"]
    rest = all(k["equal"] == k["elements"] for name, k in c["kinds"].items() if name != "weight_packed")
    packed = c["kinds"].get("weight_packed", {})
    zeros_only = packed.get("codes_differ", 0) == packed.get("signed_zeros", 0)
    names = not c["only_quantkit"] and not c["only_llmc"]
    return names and rest and zeros_only and d["identical"] == d["linears"] and not d.get("shape_mismatch")


def config_diff(x: dict, y: dict, path: str = "") -> list[str]:
    """The leaves of two quantization_config dicts that differ (quantkit's value, then llm-compressor's)."""
    out = []
    for key in sorted(set(x) | set(y)):
        u, v = x.get(key), y.get(key)
        if isinstance(u, dict) and isinstance(v, dict):
            out += config_diff(u, v, f"{path}{key}.")
        elif u != v:
            out.append(f"{path}{key}: {json.dumps(u)} vs {json.dumps(v)}")
    return out


# ---- running things ------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--peer-python", default="/tmp/llmc-env/bin/python")
    p.add_argument("--peer-dtype", default="float32", help="the peer's model dtype: float32, bfloat16 or auto")
    p.add_argument("--no-peer", action="store_true", help="quantkit's side only")
    p.add_argument("--no-quantkit", action="store_true", help="llm-compressor's side only (no comparison)")
    p.add_argument("--no-eval", action="store_true", help="skip `quantkit eval`")
    p.add_argument(
        "--eval-both", action="store_true", help="evaluate quantkit's checkpoint even when it equals the peer's"
    )
    p.add_argument("--out", type=Path, default=Path("out/llmc-peer"))
    p.add_argument("--fresh", action="store_true", help="forget results.json and the checkpoints")
    return p.parse_args()


class Run:
    def __init__(self, a: argparse.Namespace):
        if a.fresh and a.out.exists():
            import shutil

            shutil.rmtree(a.out)
        a.out.mkdir(parents=True, exist_ok=True)
        self.a, self.out = a, a.out.resolve()
        self.results_path = self.out / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.exists() else {}
        self.qk = str(Path(sys.executable).with_name("quantkit"))
        self.model_dir: Path | None = None
        self.calib_path: Path | None = None

    def save(self) -> None:
        """Merged into what is on disk, so runs on other cases in the same OUT can go side by side."""
        disk = json.loads(self.results_path.read_text()) if self.results_path.exists() else {}
        self.results = disk | self.results
        tmp = self.results_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.results, indent=2))
        tmp.replace(self.results_path)

    def folder(self, tool: str, case: str) -> Path:
        return self.out / f"{tool}-{case.replace('/', '-')}"


def prepare_inputs(run: Run) -> None:
    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.models.loading import load_tokenizer, resolve_model

    a = run.a
    run.model_dir = resolve_model(a.model)
    run.calib_path = run.out / "calib.json"
    if not run.calib_path.exists():
        rows = calibration_samples(
            load_tokenizer(run.model_dir), load_documents("news", "calib"), a.samples, a.seq_len, 0
        ).tolist()
        run.calib_path.write_text(json.dumps({"dataset": "news", "seed": 0, "samples": rows}))
    print(f"model {run.model_dir}; calibration news {a.samples} x {a.seq_len}, seed 0", flush=True)


def quantize_quantkit(run: Run, case: str) -> None:
    scheme, method, _, _ = CASES[case]
    key, folder = f"{case}/quantkit", run.folder("quantkit", case)
    if key in run.results and folder.is_dir():
        return
    command = ["fp8"] if (scheme, method) == ("fp8-block", "rtn") else COMMANDS.get(method, [method])
    cmd = [run.qk, *command, "-m", run.a.model, "--scheme", scheme, "-o", str(folder), "--overwrite"]
    cmd += ["--calib", "news", "--samples", str(run.a.samples), "--seq-len", str(run.a.seq_len)]
    print(f"{key}: {' '.join(cmd)}", flush=True)
    log = run.out / f"{key.replace('/', '-')}.log"
    r = timed(cmd, log, dict(os.environ))
    if r["rc"] != 0:
        raise SystemExit(f"{key} failed (rc {r['rc']}): {tail(log)}")
    run.results[key] = r | {"cmd": cmd}
    run.save()
    print(f"  {r['wall_s']} s wall", flush=True)


def quantize_peer(run: Run, case: str) -> None:
    _, method, preset, calibrates = CASES[case]
    key, folder = f"{case}/llmc", run.folder("llmc", case)
    if key in run.results and run.results[key].get("rc") == 0 and folder.is_dir():
        return
    args = {
        "model": str(run.model_dir),
        "out": str(folder),
        "method": method,
        "preset": preset,
        "dtype": run.a.peer_dtype,
        "calib": str(run.calib_path) if calibrates else None,
    }
    print(f"{key}: {run.a.peer_python} -c PEER {json.dumps(args)}", flush=True)
    log = run.out / f"{key.replace('/', '-')}.log"
    r = timed([run.a.peer_python, "-c", PEER, json.dumps(args)], log, dict(os.environ), cwd=run.out)
    line = next((s for s in log.read_text().splitlines() if s.startswith("PEER_RESULT ")), None)
    if r["rc"] != 0 or line is None:
        run.results[key] = r | {"error": tail(log, 3)}
        print(f"  llm-compressor failed (rc {r['rc']}): {tail(log, 3)}", flush=True)
    else:
        run.results[key] = r | json.loads(line.removeprefix("PEER_RESULT "))
        print(f"  {r['wall_s']} s wall", flush=True)
    run.save()


def evaluate(run: Run, key: str, folder: Path) -> dict:
    """`quantkit eval` of one checkpoint against the float model: ppl, kld, top-1 (or the error)."""
    ekey = f"eval {run.a.windows}/{key}"
    if ekey in run.results:
        return run.results[ekey]
    j = run.out / f"eval-{key.replace('/', '-')}.json"
    cmd = [run.qk, "eval", str(folder), "--ppl", "wiki", "--limit", str(run.a.windows)]
    cmd += ["--baseline", run.a.model, "--json", str(j)]
    print(f"{ekey}: {' '.join(cmd)}", flush=True)
    log = run.out / f"eval-{key.replace('/', '-')}.log"
    r = timed(cmd, log, dict(os.environ))
    if r["rc"] != 0:
        res = {"error": tail(log, 2), "wall_s": r["wall_s"]}
    else:
        rows = {row["metric"]: row for row in json.loads(j.read_text())["rows"]}
        res = {
            "float_ppl": rows["ppl"]["baseline"],
            "ppl": rows["ppl"]["candidate"],
            "kld": rows["kld"]["candidate"],
            "top1": rows["top1_agreement"]["candidate"],
            "wall_s": r["wall_s"],
        }
    run.results[ekey] = res
    run.save()
    return res


def print_comparison(run: Run, case: str) -> None:
    c = run.results.get(f"compare/{case}")
    if c is None:
        return
    print(f"\n**{case}** (quantkit vs llm-compressor)")
    if c["only_quantkit"] or c["only_llmc"]:
        print(f"- only quantkit: {c['only_quantkit'][:4]} ({len(c['only_quantkit'])})")
        print(f"- only llm-compressor: {c['only_llmc'][:4]} ({len(c['only_llmc'])})")
    for name, k in c["kinds"].items():
        mism = f"; shape differs: {k['shape_mismatch'][:2]}" if k.get("shape_mismatch") else ""
        if k.get("codes_differ"):
            mism += f"; e2m1 codes differ: {k['codes_differ']}, of which +0 vs -0: {k['signed_zeros']}"
        frac = k["equal"] / k["elements"] if k["elements"] else float("nan")
        print(
            f"- {name}: {k['tensors']} tensors, dtype {', '.join(k['dtypes'])}; {k['identical']} identical; "
            f"elements equal {k['equal']} / {k['elements']} ({frac:.4%}){mism}"
        )
    d = c["dequantized"]
    print(
        f"- dequantized weights: {d['identical']} of {d['linears']} linears identical; {d['differ']} of "
        f"{d['elements']} elements differ; max |Δ| {d['max_abs']:.3g} ({d['worst']})"
    )
    for line in c["config_differs"]:
        print(f"- config: {line}")


def print_table(run: Run) -> None:
    base = next((v["float_ppl"] for k, v in run.results.items() if k.startswith("eval ") and "float_ppl" in v), None)
    print(f"\nwiki, first {run.a.windows} windows of 2048 tokens; float ppl {base}\n")
    print("| scheme | method | tool | wiki ppl | KL (nats/token) | top-1 agreement | quantize wall |")
    print("|---|---|---|---|---|---|---|")
    for case in run.a.cases:
        scheme, method, *_ = CASES[case]
        for tool, label in (("quantkit", "quantkit"), ("llmc", "llm-compressor")):
            q = run.results.get(f"{case}/{tool}") or {}
            e = run.results.get(f"eval {run.a.windows}/{case}/{tool}")
            c = run.results.get(f"compare/{case}")
            if e is None and tool == "quantkit" and c and same_model(c):
                e, label = run.results.get(f"eval {run.a.windows}/{case}/llmc"), "quantkit (same tensors)"
            if q.get("rc", 1) != 0:
                cell = f"not made: {q.get('error', 'not run')}"
                print(f"| {scheme} | {method} | {label} | {cell} | | | |")
            elif e is None or "error" in e:
                cell = f"eval failed: {(e or {}).get('error', 'not run')}"
                print(f"| {scheme} | {method} | {label} | {cell} | | | {q['wall_s']:.0f} s |")
            else:
                print(
                    f"| {scheme} | {method} | {label} | {e['ppl']:.4f} | {e['kld']:.4f} | {e['top1']:.4f} "
                    f"| {q['wall_s']:.0f} s |"
                )


def main() -> None:
    run = Run(parse_args())
    prepare_inputs(run)
    a = run.a
    for case in a.cases:
        if not a.no_quantkit:
            quantize_quantkit(run, case)
        if not a.no_peer:
            quantize_peer(run, case)
        ours, theirs = run.folder("quantkit", case), run.folder("llmc", case)
        done = run.results.get(f"{case}/llmc", {}).get("rc") == 0 and f"{case}/quantkit" in run.results
        if done and f"compare/{case}" not in run.results:
            run.results[f"compare/{case}"] = compare(ours, theirs)
            run.save()
            print_comparison(run, case)
    for case in [] if a.no_eval else a.cases:
        if run.results.get(f"{case}/llmc", {}).get("rc") == 0:
            evaluate(run, f"{case}/llmc", run.folder("llmc", case))
            compared = run.results.get(f"compare/{case}")
            if compared and same_model(compared) and not a.eval_both:
                continue  # quantkit's loader builds the same model from both: the same numbers
        if f"{case}/quantkit" in run.results:
            evaluate(run, f"{case}/quantkit", run.folder("quantkit", case))
    peer = next((v for k, v in run.results.items() if k.endswith("/llmc") and "versions" in v), None)
    print(
        f"\n{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch {torch.__version__}; "
        f"peer {json.dumps(peer['versions']) if peer else 'not run'}, dtype {peer['dtype'] if peer else '-'}"
    )
    for case in a.cases:
        s = run.results.get(f"{case}/llmc", {}).get("settings")
        if s:
            print(f"llm-compressor {case}: {json.dumps(s)}")
    for case in a.cases:
        print_comparison(run, case)
    print_table(run)


if __name__ == "__main__":
    main()
