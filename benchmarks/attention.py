"""CPU paged attention: the C++ kernels (`kernels/cpu_ext.py`) against the torch path
(`cpu_attention.torch_paged_attention` / `torch_paged_prefill`: gathered blocks + SDPA), in
one process, runs interleaved, medians and their ratio.

    OMP_NUM_THREADS=1 python benchmarks/attention.py [--threads 1] [--repeats 7] [--part decode prefill]

decode: one engine step of smollm2-135m's attention (30 layers, 9 query heads, 3 KV heads,
head_dim 64, block_size 16), 64 sequences of 40-700 cached tokens (seeded), block tables
shuffled, one cache per layer (~0.5 GB in bf16, so K/V come from memory as in the engine),
bf16 queries; caches bf16, fp8 e4m3 and int8 with per-tensor scales. Fresh block_tables and
seq_lens tensors each step, as the runner passes them, so the torch path plans once per step.

prefill: the same model's attention over one 2048-token prefill chunk made of prompts of n
tokens each (n = 32-2048), all 30 layers: whole prompts (no cached prefix), then the last n/4
tokens of each prompt after a cached prefix of 3n/4 (chunked prefill, prefix caching).
`--block-size` sets the cache's block size (16 by default; the engine's CPU default is 64).

decode-fp32: the step of a CPU without native bf16 (fp32 queries and cache, blocks of 64, as the
engine runs an fp32 model there): 64 sequences of 52-532 tokens, the same caches once as
torch.zeros allocates them (4 KB pages) and once as the engine does (`kernels.cpu.zeros`: 2 MB
pages where Linux allows), interleaved; the header says how many MB of K and V a step reads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.kernels import cpu, cpu_ext
from quantkit.kernels.attention import cpu as cpu_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def make_caches(lens: list[int], dtype: torch.dtype, seed: int = 0, block: int = BLOCK):
    """Per layer (k_cache, v_cache) holding len(lens) sequences in shuffled blocks, the block
    table int32 [n, max_blocks], and the scales (per tensor) for fp8/int8."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // block) for n in lens]
    num_blocks = sum(used) + 8
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(used), dtype=torch.int32)
    at = 0
    for i, n in enumerate(used):
        tables[i, :n] = order[at : at + n]
        at += n
    shape = (num_blocks, block, KV_HEADS, HEAD_DIM)
    caches = []
    for _ in range(LAYERS):
        k, v = (torch.randn(shape, generator=g) for _ in range(2))
        if dtype == torch.int8:
            k, v = ((x * 30).round().clamp(-128, 127).to(dtype) for x in (k, v))
        else:
            k, v = k.to(dtype), v.to(dtype)
        caches.append((k, v))
    scales = (torch.tensor([0.05]), torch.tensor([0.03])) if dtype.itemsize == 1 else (None, None)
    return caches, tables, scales


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of fn(); with one thread the CPU time ignores what other processes take."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(label: str, impls: dict, repeats: int) -> None:
    """Each impl once per round, rounds interleaved; prints the median wall and CPU ms of each
    and the first one's over each other's (CPU)."""
    for fn in impls.values():  # warm-up (and the build)
        fn()
    times = {name: [] for name in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            times[name].append(timed(fn))
    wall = {name: statistics.median(w for w, _ in t) * 1e3 for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) * 1e3 for name, t in times.items()}
    first = next(iter(impls))
    cells = [f"{name} {wall[name]:7.1f} / {cpu[name]:7.1f} ms" for name in impls]
    ratios = [f"{first}/{name} {cpu[first] / cpu[name]:5.2f}x" for name in impls if name != first]
    print(f"{label:<38} " + "   ".join(cells + ratios), flush=True)


def decode(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(40, 701, (64,), generator=g).tolist()
    q = torch.randn(64, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ext = cpu_ext.load().paged_attention
    print(f"decode: 64 sequences of {min(lens)}-{max(lens)} tokens (mean {sum(lens) / 64:.0f}), 30 layers; wall / CPU")
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.int8):
        caches, tables, (ks, vs) = make_caches(lens, dtype)

        def step(attend, caches=caches, tables=tables, ks=ks, vs=vs):
            t, n = tables.clone(), seq_lens.clone()  # new tensors each step, as the runner's
            for k, v in caches:
                attend(q, k, v, t, n, SCALE, ks, vs)

        compare(
            f"decode step, {str(dtype).removeprefix('torch.')} cache",
            {
                "torch": lambda: step(cpu_attention.torch_paged_attention),
                "ext": lambda: step(lambda *a: ext(*a, 0, 0.0)),
            },
            repeats,
        )


def decode_fp32(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(52, 533, (64,), generator=g).tolist()
    q = torch.randn(64, HEADS, HEAD_DIM, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ext = cpu_ext.load().paged_attention
    caches, tables, _ = make_caches(lens, torch.float32, block=64)
    placed = [tuple(cpu.zeros(t.shape, t.dtype).copy_(t) for t in kv) for kv in caches]  # as the engine's
    nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS
    span = f"{min(lens)}-{max(lens)}"
    print(f"decode, fp32: 64 sequences of {span} tokens, 30 layers, blocks of 64, {nbytes / 1e6:.0f} MB of K and V")

    def step(caches):
        t, n = tables.clone(), seq_lens.clone()
        for k, v in caches:
            ext(q, k, v, t, n, SCALE, None, None, 0, 0.0)

    compare("decode step, fp32 cache", {"2MB pages": lambda: step(placed), "4KB pages": lambda: step(caches)}, repeats)


def prefill(repeats: int, block: int = BLOCK) -> None:
    g = torch.Generator().manual_seed(0)
    ext = cpu_ext.load().paged_prefill
    print(f"prefill: one 2048-token chunk of prompts of n tokens, 30 layers, bf16 cache, blocks of {block}; wall / CPU")
    print("  torch: gather + SDPA per sequence; ext: the C++ kernel for all (AMX where it can);")
    print("  auto: cpu_attention.paged_prefill")
    for n in (32, 64, 128, 256, 512, 1024, 2048):
        count = 2048 // n
        caches, tables, _ = make_caches([n] * count, torch.bfloat16, block=block)
        seq_lens = torch.full((count,), n, dtype=torch.int32)
        for q_len in (n, n // 4):
            query_lens = torch.full((count,), q_len, dtype=torch.int32)
            q = torch.randn(count * q_len, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)

            def step(attend, caches=caches, tables=tables, seq_lens=seq_lens, query_lens=query_lens, q=q):
                for k, v in caches:
                    attend(q, k, v, tables, seq_lens, query_lens, SCALE)

            what = "whole prompts" if q_len == n else f"last {q_len} after {n - q_len}"
            compare(
                f"prefill {count:2} x {what}",
                {
                    "torch": lambda: step(cpu_attention.torch_paged_prefill),
                    "ext": lambda: step(lambda *a: ext(*a, None, None, 0, 0.0, cpu_attention.PREFILL_TILE, 0)),
                    "auto": lambda: step(cpu_attention.paged_prefill),
                },
                repeats,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parts = ["decode", "decode-fp32", "prefill"]
    parser.add_argument("--part", nargs="+", default=["decode", "prefill"], choices=parts)
    parser.add_argument("--block-size", type=int, default=BLOCK, help="the prefill caches' block size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_ext.load() is None:
        raise SystemExit(f"the C++ kernels are unavailable: {cpu_ext.reason()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    with torch.inference_mode():
        for part in args.part:
            if part == "decode":
                decode(args.repeats)
            elif part == "decode-fp32":
                decode_fp32(args.repeats)
            else:
                prefill(args.repeats, args.block_size)


if __name__ == "__main__":
    main()
