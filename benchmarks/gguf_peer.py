"""quantkit's calibrated GGUF files against llama.cpp's own quantizer, measured by llama.cpp.

For one model: the f32 GGUF (quantkit's export at f32), then at each type quantkit's export
(--method gptq on the calibration text, AWQ's scales folded first unless --options say
otherwise) and `llama-quantize` of that f32 file without and with an importance matrix
from `llama-imatrix` on the same calibration rows (decoded to text). `llama-perplexity`
scores every file on the same wiki windows: perplexity, and the KL divergence from the f32
file's logits (--kl-divergence-base / --kl-divergence).

    QUANTKIT_LLAMA_CPP=/work/peers/llama.cpp-build/bin OMP_NUM_THREADS=1 \\
        python benchmarks/gguf_peer.py smollm2-135m --types q4_k_m,q4_0,q8_0 --samples 64 --chunks 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# run as a script, this file's folder comes first on sys.path and its name would shadow the
# `gguf` package that quantkit's GGUF code imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from quantkit.calibration.datasets import calibration_samples, load_documents  # noqa: E402
from quantkit.calibration.gguf import GGUFOptions  # noqa: E402
from quantkit.calibration.method import Calibration  # noqa: E402
from quantkit.models.loading import load_tokenizer, resolve_model  # noqa: E402
from quantkit.pipeline.gguf import export_gguf  # noqa: E402

QUANTIZE_NAMES = {
    "q4_k_m": "Q4_K_M",
    "q4_0": "Q4_0",
    "q8_0": "Q8_0",
    "q4_1": "Q4_1",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
}


def tool(name: str) -> str:
    folder = os.environ.get("QUANTKIT_LLAMA_CPP")
    if not folder or not (Path(folder) / name).is_file():
        raise SystemExit(f"set QUANTKIT_LLAMA_CPP to the folder of llama.cpp's {name}")
    return str(Path(folder) / name)


def run(cmd: list[str], log: Path) -> str:
    t = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}); see {log}")
    print(f"  {Path(cmd[0]).name} {time.time() - t:.0f}s", flush=True)
    return done.stdout + done.stderr


def texts(model: str, c: Calibration, out: Path) -> tuple[Path, Path]:
    """The calibration rows decoded to text (what llama-imatrix reads) and the wiki eval text."""
    tok = load_tokenizer(resolve_model(model))
    rows = calibration_samples(tok, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
    calib = out / "calib.txt"
    calib.write_text("".join(tok.decode(r) for r in rows))
    wiki = out / "wiki.txt"
    wiki.write_text("\n\n".join(load_documents("wiki", "eval")))
    return calib, wiki


def score(gguf: Path, wiki: Path, base: Path, args, first: bool) -> dict:
    cmd = [
        tool("llama-perplexity"),
        "-m",
        str(gguf),
        "-f",
        str(wiki),
        "-c",
        str(args.ctx),
        "--chunks",
        str(args.chunks),
    ]
    cmd += ["-t", str(args.threads), "-b", str(args.ctx)]
    cmd += ["--kl-divergence-base", str(base)] + ([] if first else ["--kl-divergence"])
    text = run(cmd, gguf.with_suffix(".ppl.log"))
    if first:
        # the running estimate after the last chunk: the "Final estimate" line is not always flushed
        return {"ppl": float(re.findall(r"\[\d+\]([\d.]+),", text)[-1]), "kld": 0.0}
    ppl = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", text)
    kld = re.search(r"Mean\s+KLD:\s*([\d.]+)", text)
    top = re.search(r"Same top p:\s*([\d.]+)", text)
    return {"ppl": float(ppl.group(1)), "kld": float(kld.group(1)), "top1": float(top.group(1)) if top else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--types", default="q4_k_m,q4_0,q8_0")
    p.add_argument("--calib", default="news")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("/tmp/quantkit-gguf-bench"))
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--options", default="{}", help="GGUFOptions of quantkit's export as JSON, e.g. '{\"static\": true}'"
    )
    args = p.parse_args()
    out = args.out / args.model.replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    c = Calibration(dataset=args.calib, samples=args.samples, seq_len=args.seq_len)
    options = GGUFOptions(**json.loads(args.options))
    changed = {k: v for k, v in dataclasses.asdict(options).items() if v != getattr(GGUFOptions(), k)}
    how = "gptq after AWQ's scales" if options.awq else "gptq"
    how += "".join(f", {k}={v}" for k, v in changed.items() if k != "awq")
    calib, wiki = texts(args.model, c, out)
    f32 = out / "f32.gguf"
    if not f32.exists():
        export_gguf(args.model, f32, "f32", method="rtn")
    base = out / "f32.kld"
    results = {"f32": dict(score(f32, wiki, base, args, first=True), mib=f32.stat().st_size / 2**20)}
    imatrix = out / "imatrix.gguf"
    if not imatrix.exists():
        cmd = [tool("llama-imatrix"), "-m", str(f32), "-f", str(calib), "-o", str(imatrix), "-c", str(args.seq_len)]
        run(cmd + ["--chunks", str(args.samples), "-t", str(args.threads)], out / "imatrix.log")
    for t in args.types.split(","):
        files = {
            f"llama-quantize {t}": (out / f"lq-{t}.gguf", []),
            f"llama-quantize {t} + imatrix": (out / f"lqi-{t}.gguf", ["--imatrix", str(imatrix)]),
            f"quantkit {t} ({how})": (out / f"qk-{t}.gguf", None),
        }
        for label, (path, extra) in files.items():
            print(label, flush=True)
            if not path.exists():
                if extra is None:
                    export_gguf(args.model, path, t, method="gptq", calibration=c, options=options)
                else:
                    cmd = [tool("llama-quantize"), *extra, str(f32), str(path), QUANTIZE_NAMES[t], str(args.threads)]
                    run(cmd, path.with_suffix(".log"))
            results[label] = dict(score(path, wiki, base, args, first=False), mib=path.stat().st_size / 2**20)
            print(f"  {results[label]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print("| file | MiB | PPL | KL from f32 | same top-1 |\n|---|---|---|---|---|")
    for label, r in results.items():
        top = f"{r['top1']:.2f}%" if r.get("top1") is not None else "—"
        print(f"| {label} | {r.get('mib', 0):.1f} | {r['ppl']:.3f} | {r['kld']:.5f} | {top} |")


if __name__ == "__main__":
    main()
