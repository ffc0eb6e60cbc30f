"""Peak memory of calibration against the float weights, on random Llamas saved to disk.

    python benchmarks/memory.py [--algorithm gptq] [--out /tmp/qk-memory] [--layers 22 6] [--moe]

Builds (once) a random Llama of TinyLlama-1.1B's shapes (hidden 2048, intermediate 5632,
32 heads / 4 KV heads, vocab 32000) per --layers count, or with --moe a random Mixtral
(hidden 1024, 8 experts of width 2816, 2 per token, 16 heads / 4 KV heads, vocab 32000),
in fp32 with a tiny tokenizer,
then quantizes each (w4a16 group 128; GPTQ with act-order static) in a fresh process,
calibrated on `news` 16 × 256 tokens, while this process samples that one's resident
memory every 0.2 s from /proc. Prints per model the float weights' size, the peak RSS and
when it happened, and the RSS over time (about 40 samples), so growth from block to block
shows; then the peaks side by side, as ratios to the smallest model's. Calibration streams
the weights, so the peak should not grow with the number of layers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

QUANTIZE = """
import dataclasses, sys
from quantkit.pipeline.quantize import Calibration, quantize
from quantkit.scheme import preset
scheme = preset("w4a16").with_group_size(128)
scheme = scheme.replace(weights=dataclasses.replace(scheme.weights, actorder="static"))
quantize(sys.argv[1], scheme, sys.argv[2], sys.argv[3], Calibration("news", 16, 256, 0, 8), overwrite=True)
"""


def build(path: Path, layers: int, moe: bool = False) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    shape = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4}
    if moe:
        shape = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4}
        shape |= {"num_local_experts": 8, "num_experts_per_tok": 2}
    cfg = AutoConfig.for_model(
        "mixtral" if moe else "llama",
        vocab_size=32000,
        num_hidden_layers=layers,
        max_position_embeddings=2048,
        **shape,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        ["calibration text for a random model"] * 4,
        trainers.BpeTrainer(
            vocab_size=300,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<eos>"],
            show_progress=False,
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def rss_gib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20
    except (FileNotFoundError, StopIteration):
        return None


def measure(model: Path, out: Path, algorithm: str) -> tuple[float, float, float]:
    """(float weights GiB, peak RSS GiB, wall s) of quantizing `model` in a fresh process."""
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30
    proc = subprocess.Popen([sys.executable, "-c", QUANTIZE, str(model), str(out), algorithm])
    start, samples = time.time(), []
    while proc.poll() is None:
        if (r := rss_gib(proc.pid)) is not None:
            samples.append((time.time() - start, r))
        time.sleep(0.2)
    if proc.returncode or not samples:
        sys.exit(f"the {algorithm} run on {model.name} failed (exit {proc.returncode}).")
    t, peak = max(samples, key=lambda s: s[1])
    print(
        f"{model.name}: float weights {weights:.2f} GiB; {algorithm}: peak RSS {peak:.2f} GiB at {t:.0f} s "
        f"of {samples[-1][0]:.0f} s"
    )
    print("  RSS over time (s:GiB): " + " ".join(f"{t:.0f}:{r:.2f}" for t, r in samples[:: max(1, len(samples) // 40)]))
    return weights, peak, samples[-1][0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algorithm", default="gptq", choices=["gptq", "awq", "rtn"])
    p.add_argument("--out", type=Path, default=Path("/tmp/qk-memory"))
    p.add_argument("--layers", type=int, nargs="+", default=[22, 6])
    p.add_argument("--moe", action="store_true", help="A random Mixtral instead of a Llama.")
    a = p.parse_args()
    rows = []
    for layers in a.layers:
        model = a.out / f"{'mixtral' if a.moe else 'llama'}-{layers}-layers"
        if not (model / "config.json").exists():
            build(model, layers, a.moe)  # in this process: its memory is not the one measured
        rows.append((layers, *measure(model, a.out / f"{a.algorithm}-{layers}", a.algorithm)))
    base = min(rows)  # the fewest layers
    print(f"\n| layers | float weights | {a.algorithm} peak RSS | peak / {base[0]}-layer peak | wall |")
    print("| --- | --- | --- | --- | --- |")
    for layers, weights, peak, wall in rows:
        print(f"| {layers} | {weights:.2f} GiB | {peak:.2f} GiB | {peak / base[2]:.2f} | {wall:.0f} s |")


if __name__ == "__main__":
    main()
