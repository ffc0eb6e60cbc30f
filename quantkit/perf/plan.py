"""Capacity planning from a model's config.json alone (no weights): weight and KV-cache
memory per scheme, how many sequences fit on a GPU, and the memory-bandwidth lower
bounds on decode latency, throughput and cost. Bounds, not measurements: real engines
land above these latencies (`quantkit bench` measures them). And what calibrating a model
will take (`calibration_plan`).

The shapes come from the family's description (`models/arch.py`), the bytes of a
quantized linear from its format (`formats/stored.py`), and a method's calibration cost
from the method's own module (its registry entry's `plan`)."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from fractions import Fraction

from quantkit.calibration.registry import METHODS
from quantkit.errors import QuantkitError
from quantkit.formats.stored import linear_bytes
from quantkit.models.arch import ARCHS, LLAMA, ArchSpec, block_shapes, dimensions, num_experts, sparse_layers
from quantkit.scheme import PRESETS, QuantArgs

FLOAT_BYTES = 2  # serving dtype (bf16/fp16) of everything left unquantized
KV_BYTES = {None: 2, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
FLOAT_SCHEMES = ("bf16", "fp16")


@dataclass(frozen=True)
class GPU:
    """Public spec-sheet numbers (dense TFLOP/s). `usd_per_hour` is an illustrative cloud
    price, not a quote: pass `cost_per_hour` for your own."""

    memory: float  # bytes
    bandwidth: float  # bytes/s
    bf16_tflops: float
    fp8_tflops: float | None  # None: no fp8 tensor cores (fp8 runs weight-only, bf16 math)
    usd_per_hour: float


GB = 1e9
GPUS: dict[str, GPU] = {
    "h100-80gb": GPU(80 * GB, 3.35e12, 989, 1979, 2.99),
    "a100-80gb": GPU(80 * GB, 2.0e12, 312, None, 1.79),
    "h200": GPU(141 * GB, 4.8e12, 989, 1979, 3.79),
    "l40s": GPU(48 * GB, 864 * GB, 362, 733, 1.29),
    "l4": GPU(24 * GB, 300 * GB, 121, 242, 0.80),
    "rtx4090": GPU(24 * GB, 1.0e12, 165, 330, 0.69),
    "cpu": GPU(24 * GB, 22 * GB, 0.2, None, 0.10),  # a small cloud VM, roughly
}


def _arch(config: dict) -> ArchSpec:
    """The family's description (`models/arch.py`); a model type quantkit does not know is
    planned as Llama-shaped."""
    return ARCHS.get(config.get("model_type"), LLAMA)


def _moe(config: dict) -> dict | None:
    """A mixture-of-experts config's experts (Mixtral, Qwen2-MoE, Qwen3-MoE): how many, how
    many a token uses, their width, the shared expert's width (0: none) and how many layers
    are sparse (`arch.sparse_layers`); None: dense."""
    experts = num_experts(config)
    if not experts:
        return None
    dims = dimensions(config)
    return {
        "experts": experts,
        "top_k": config["num_experts_per_tok"],
        "width": dims["expert"],
        "shared": dims["shared"],
        "layers": sum(sparse_layers(config)),
    }


def _share(spec: ArchSpec, name: str, moe: dict | None) -> Fraction:
    """The share of the tokens the block linear `name` reads: an expert its top-k share."""
    routed = spec.moe is not None and spec.moe.is_expert(name)
    return Fraction(moe["top_k"], moe["experts"]) if routed else Fraction(1)


def block_linears(config: dict) -> list[tuple[int, int, int, int]]:
    """(out, in, how many the model has, how many one token reads) of every shape of block
    linear, from the family's description (`arch.block_shapes`): attention and dense MLPs
    in every layer that has them, and in sparse layers every expert (top-k read per token)
    and the shared expert."""
    spec, moe = _arch(config), _moe(config)
    sparse = moe["layers"] if moe else 0
    rows: dict[tuple[int, int], list] = {}
    for is_sparse, layers in ((False, config["num_hidden_layers"] - sparse), (True, sparse)):
        if not layers:
            continue
        for name, shape in block_shapes(spec, config, is_sparse).items():
            row = rows.setdefault(shape, [0, Fraction(0)])
            row[0] += layers
            row[1] += layers * _share(spec, name, moe)
    return [(o, i, n, int(active)) for (o, i), (n, active) in rows.items()]


def _float_params(config: dict) -> int:
    """Parameters that stay in float: embeddings, lm_head, the norms the family's blocks have
    (per-head q/k norms too), biases, routers."""
    h, vocab, spec, dims = config["hidden_size"], config["vocab_size"], _arch(config), dimensions(config)
    shapes = {name.rsplit(".", 1)[1]: s for name, s in block_shapes(spec, config).items()}
    biased = set()
    if config.get("attention_bias") or config.get("qkv_bias") or config.get("model_type") == "qwen2":
        biased |= {"q_proj", "k_proj", "v_proj"} | ({"o_proj"} if config.get("attention_bias") else set())
    if config.get("mlp_bias"):
        biased |= {"gate_proj", "up_proj", "down_proj"}
    norms = (spec.input_norm, spec.pre_mlp_norm, spec.post_attention_norm, spec.post_mlp_norm)
    per_block = h * sum(n is not None for n in norms) + dims["head_dim"] * sum(
        n is not None for n in (spec.q_norm, spec.k_norm)
    )
    per_block += sum(shapes[n][0] for n in biased if n in shapes)
    heads = 1 if config.get("tie_word_embeddings", False) else 2
    moe = _moe(config)
    routers = moe["layers"] * (moe["experts"] + (1 if moe["shared"] else 0)) * h if moe else 0  # and shared gates
    return config["num_hidden_layers"] * per_block + h + heads * vocab * h + routers


def param_count(config: dict, active: bool = False) -> int:
    """All parameters of the model described by `config` (HF config.json dict); with
    `active`, those one token reads (a mixture of experts' top-k experts, not all)."""
    return sum(o * i * (a if active else n) for o, i, n, a in block_linears(config)) + _float_params(config)


def weight_bytes(config: dict, scheme: str, active: bool = False) -> float:
    """Bytes of all weights with the block linears quantized per `scheme` (stored as its
    format stores them, `formats/stored.py`); with `active`, of those one token reads."""
    fmt, args, static_input = _scheme_args(scheme)
    linears = sum(
        linear_bytes(fmt, o, i, args, FLOAT_BYTES, static_input) * (a if active else n)
        for o, i, n, a in block_linears(config)
    )
    return linears + _float_params(config) * FLOAT_BYTES


def kv_bytes_per_token(config: dict, kv_cache: str | None = None) -> int:
    """2 (K and V) × layers × KV heads × head_dim × bytes per element."""
    if kv_cache not in KV_BYTES:
        raise QuantkitError(f"unknown KV-cache type {kv_cache!r}; use one of: bf16, fp16, fp8, int8.")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * hd * KV_BYTES[kv_cache]


def _scheme_args(scheme: str) -> tuple[str | None, QuantArgs | None, bool]:
    """(format, weight args, static activation scales) of a scheme name."""
    if scheme in FLOAT_SCHEMES:
        return None, None, False
    known = [n for n, p in PRESETS.items() if p.weights is not None]
    if scheme not in known:
        options = ", ".join(FLOAT_SCHEMES + tuple(known))
        raise QuantkitError(f"unknown scheme {scheme!r} for planning; use one of: {options}.")
    p = PRESETS[scheme]
    return p.format, p.weights, p.input_activations is not None and not p.input_activations.dynamic


def gpu_spec(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise QuantkitError(f"unknown GPU {name!r}; use one of: {', '.join(GPUS)}.") from None


def plan(
    config: dict,
    schemes: list[str] = ("bf16", "w4a16", "fp8-dynamic"),
    kv_cache: str | None = None,
    gpu: str = "h100-80gb",
    context: int = 4096,
    cost_per_hour: float | None = None,
    *,
    memory: float | None = None,
    bandwidth: float | None = None,
    memory_utilization: float = 0.9,
    max_num_seqs: int | None = None,
) -> list[dict]:
    """One row per scheme: memory, sequences of `context` tokens that fit in
    `memory_utilization` of the GPU, and lower bounds on decode TPOT (the weights a token
    reads at batch 1: a mixture of experts' top-k experts; all weights, and all KV, at full
    batch), throughput and cost per 1K output tokens at full batch; `prefill_ms` is the
    compute bound on one `context`-token prompt.
    `memory` (bytes) and `bandwidth` (bytes/s) override the GPU table; `max_num_seqs`
    caps the batch as an engine's scheduler would."""
    config = {**config, **(config.get("text_config") or {})}
    spec = gpu_spec(gpu)
    if context < 1 or not 0 < memory_utilization <= 1:
        raise QuantkitError(f"need context >= 1 and 0 < memory utilization <= 1, got {context}, {memory_utilization}.")
    try:
        params, kv_token = param_count(config), kv_bytes_per_token(config, kv_cache)
        active = param_count(config, active=True)
    except KeyError as e:
        raise QuantkitError(f"config.json lacks {e.args[0]!r}; planning needs a decoder-only LM config.") from None
    memory, bandwidth = memory or spec.memory, bandwidth or spec.bandwidth
    price = spec.usd_per_hour if cost_per_hour is None else cost_per_hour
    rows = []
    for scheme in schemes:
        weights = weight_bytes(config, scheme)
        seqs = max(0, int((memory * memory_utilization - weights) // (kv_token * context)))
        seqs = min(seqs, max_num_seqs) if max_num_seqs else seqs
        _, args, _ = _scheme_args(scheme)
        fp8_math = args is not None and args.type == "float" and spec.fp8_tflops is not None
        attention = 2 * config["num_hidden_layers"] * context**2 * dimensions(config)["q"]  # causal QK, PV
        flops = 2 * active * context + attention
        tpot_full = (weights + seqs * context * kv_token) / bandwidth if seqs else None
        tokens_s = seqs / tpot_full if seqs else None
        rows.append(
            {
                "scheme": scheme,
                "gpu": gpu,
                "context": context,
                "kv_cache": kv_cache or "bf16",
                "params": params,
                "active_params": active,
                "weight_bytes": weights,
                "kv_bytes_per_token": kv_token,
                "kv_bytes_per_seq": kv_token * context,
                "max_seqs": seqs,
                "fits": seqs > 0,
                "weights_fit": weights <= memory * memory_utilization,
                "tpot_ms_batch1": weight_bytes(config, scheme, active=True) / bandwidth * 1e3,
                "tpot_ms_full": tpot_full * 1e3 if seqs else None,
                "tokens_per_s_full": tokens_s,
                "prefill_ms": flops / ((spec.fp8_tflops if fp8_math else spec.bf16_tflops) * 1e12) * 1e3,
                "cost_per_hour": price,
                "usd_per_1k_output_tokens": price / 3600 / tokens_s * 1000 if seqs else None,
            }
        )
    return rows


def model_config(name_or_path: str) -> dict:
    """config.json of a local folder, a built-in model or a hub id (fetches only config.json)."""
    from pathlib import Path

    from quantkit.models.loading import BUILTIN_MODELS, read_config, resolve_model

    if (
        name_or_path in BUILTIN_MODELS
        or Path(name_or_path).expanduser().exists()
        or str(name_or_path).startswith((".", "/", "~"))
    ):
        return read_config(resolve_model(name_or_path))
    from huggingface_hub import hf_hub_download

    from quantkit.hub import hub_reachable

    for offline in (True, False):
        if not offline and not hub_reachable():
            break
        try:
            return read_config(Path(hf_hub_download(name_or_path, "config.json", local_files_only=offline)).parent)
        except QuantkitError:
            raise
        except Exception:
            continue
    raise QuantkitError(
        f"could not get config.json of {name_or_path!r} (not a local folder, not cached, "
        "and the hub is unreachable or has no such model); check the name."
    )


# --- calibration: memory and time of `quantkit awq|gptq` on a model, from its config ---

LIBRARY_BYTES = 0.45 * 2**30  # python, torch, transformers and quantkit loaded (measured: 443 MiB RSS)
BATCH = 8  # rows per forward
FP32_TFLOPS = {"h100-80gb": 67, "a100-80gb": 19.5, "h200": 67, "l40s": 91.6, "l4": 30.3, "rtx4090": 82.6}
_FILE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _cost_model(method: str):
    """The method's planning cost (its registry entry's `plan`, "module:function")."""
    planned = [m.name for m in METHODS.values() if m.plan]
    if method not in planned:
        raise QuantkitError(f"--calibrate {method!r} is not planned; use {' or '.join(planned)}.")
    module, _, name = METHODS[method].plan.partition(":")
    return getattr(importlib.import_module(module), name)


def _calibrated_block(config: dict) -> dict:
    """The block calibration holds (a sparse one, all its experts, in a mixture of experts):
    per group of linears that share an input (the family's sequential groups), (in, out
    summed, share of the tokens it sees); its parameters (norms and router too); the
    attention width; the MLP width a token computes."""
    spec, moe, dims = _arch(config), _moe(config), dimensions(config)
    block = spec.sparse(moe["experts"]) if moe else spec
    shapes = block_shapes(spec, config, moe is not None)
    groups = []
    for group in block.sequential:
        share = moe["top_k"] / moe["experts"] if _share(spec, group[0], moe) != 1 else 1.0
        groups.append((shapes[group[0]][1], sum(shapes[n][0] for n in group), share))
    h = dims["hidden"]
    return {
        "groups": groups,
        "sizes": [len(group) for group in block.sequential],  # linears per group
        "params": sum(i * o for i, o, _ in groups) + 2 * h + (moe["experts"] * h if moe else 0),
        "attention": dims["q"],
        "mlp": moe["top_k"] * moe["width"] + moe["shared"] if moe else dims["mlp"],
        "sparse_input": h if moe else 0,  # a sparse MLP's own input, which every expert reads from
    }


def calibration_plan(
    config: dict,
    method: str = "gptq",
    samples: int = 128,
    seq_len: int = 512,
    device: str = "cpu",
    gflops: float = 100.0,
    group_size: int = 128,
) -> dict:
    """Peak host and device memory and wall time of calibrating the model `config`
    describes, as the streaming pipeline runs it: libraries + one block's float weights in
    fp32 + the calibration activations (a block's inputs and outputs) + the method's
    working set, or the embeddings while block 0's inputs are captured, whichever is
    larger; never the whole model. `gflops` is the device's fp32 matmul rate. Also the
    checkpoint's size on disk (w4a16, `group_size`). In a mixture of experts the block is a
    sparse one (all its experts) and each expert sees its top-k share of the tokens. The
    method's working set and matmuls come from its own cost model (`plan_cost` in its
    module, named by its registry entry)."""
    cost_model = _cost_model(method)
    if samples < 1 or seq_len < 1 or gflops <= 0:
        raise QuantkitError(f"need samples, seq-len and gflops > 0, got {samples}, {seq_len}, {gflops}.")
    config = {**config, **(config.get("text_config") or {})}
    try:
        h, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
        b = _calibrated_block(config)
    except KeyError as e:
        raise QuantkitError(f"config.json lacks {e.args[0]!r}; planning needs a decoder-only LM config.") from None
    file_bytes = _FILE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "float32"), 4)
    read_copy = file_bytes * b["params"] if file_bytes != 4 else 0  # the block as read, beside its fp32 copy
    tokens, groups = samples * seq_len, b["groups"]
    cost = cost_model(groups, tokens, group_size, b["sparse_input"])
    block = 4 * b["params"] + read_copy
    activations = 2 * tokens * h * 4  # the block's inputs and outputs, fp32
    forward = BATCH * seq_len * (3 * b["mlp"] + 4 * h) * 4  # one batch's intermediates inside the block
    forward += BATCH * config["num_attention_heads"] * seq_len**2 * 4  # and its attention scores
    embed = vocab * h * (4 + (file_bytes if file_bytes != 4 else 0))
    capture = embed + tokens * h * 4
    block_phase = block + activations + cost["working_set"] + forward
    on_device = device != "cpu"
    host = LIBRARY_BYTES + (max(block, tokens * h * 4) if on_device else max(capture, block_phase))
    device_peak = max(capture, block_phase - read_copy) if on_device else 0
    # time: two forwards through the block and every matmul of the method, at its fraction of the device's rate
    block_forward = 2 * tokens * sum(o * i * share for i, o, share in groups) + 2 * tokens * seq_len * b["attention"]
    per_block = 2 * block_forward + cost["flops"]
    args = QuantArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    output = sum(linear_bytes("pack-quantized", o, i, args, file_bytes) * n for o, i, n, _ in block_linears(config))
    seconds = layers * per_block / (gflops * 1e9 * cost["efficiency"])
    extra = _extra_passes(config, b, cost_model, tokens, seq_len, group_size, block_forward, gflops)
    if method == "gptq" and not b["sparse_input"]:  # dense models only, as the option
        extra["float_targets"] = _float_targets(b, tokens, h, layers, block_forward, gflops * 1e9 * cost["efficiency"])
    return {
        "method": method,
        "samples": samples,
        "seq_len": seq_len,
        "device": device,
        "layers": layers,
        "float_weights_bytes": param_count(config) * file_bytes,
        "host_peak_bytes": host,
        "device_peak_bytes": device_peak,
        "seconds": seconds,
        "output_bytes": output + _float_params(config) * file_bytes,
        "resume": _resume_writes(layers, seconds, tokens * h * 4),
        **extra,
        "breakdown": {
            "libraries": LIBRARY_BYTES,
            "block_weights": block,
            "activations": activations,
            "working_set": cost["working_set"],
            "forward": forward,
            "embeddings": embed,
        },
    }


def _resume_writes(layers: int, seconds: float, per_commit: int) -> dict:
    """What the resume state writes (`pipeline.stream`): a block's inputs per commit, a commit
    at most once per COMMIT_SECONDS of calibration (none after the last block: the
    checkpoint is complete), against one after every block before 2026-12-03."""
    from quantkit.pipeline.stream import COMMIT_SECONDS

    between = layers - 1  # commits that save inputs: after every block but the last
    commits = between if COMMIT_SECONDS <= 0 else min(between, math.ceil(seconds / COMMIT_SECONDS))
    return {
        "commit_bytes": per_commit,
        "commits": commits,
        "bytes": commits * per_commit,
        "every_block": between * per_commit,
    }


GUIDED_GROUPS = 4  # the --guided the plan counts (the docs' setting)


def _extra_passes(config, b, cost_model, tokens, seq_len, group_size, block_forward, gflops) -> dict:
    """What `--guided` and `--target-bits` add: the float model's gradient pass (forward,
    then each block run again and back; the blocks' inputs spilled to disk) on the first
    GUIDED_ROWS rows (the option's default), and guided Hessians (GUIDED_GROUPS per group of
    linears that share an input on those rows, and the plain one of all rows split at them,
    each the products of its blocks on and above the diagonal, `guided.GRAM_BLOCKS`, in
    place of the plain Hessian); the sensitivity (`pipeline.mixed`, on its
    SENSITIVITY_WINDOWS: the float pass, the Fisher pass with FISHER_DRAWS labels (the head's
    forward and one product its draws share, `guided._sampled_gradient`), and per
    block each unit × format quantized by the method and the block run once more; AWQ's
    int8, measured by round-to-nearest, `mixed.ROUNDED`, is counted as AWQ's: an upper bound)."""
    from quantkit.calibration.guided import GRAM_BLOCKS, gradient_rows
    from quantkit.calibration.registry import GUIDED_ROWS
    from quantkit.pipeline.mixed import FISHER_DRAWS, SENSITIVITY_WINDOWS

    layers, h, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    rate = gflops * 1e9 * cost_model(b["groups"], tokens, group_size, b["sparse_input"])["efficiency"]
    head = 2 * tokens * h * vocab
    part = gradient_rows(tokens // seq_len, GUIDED_ROWS) * seq_len / tokens  # of the tokens with gradients
    share = (GRAM_BLOCKS + 1) / (2 * GRAM_BLOCKS)  # of a guided Hessian's products
    plain = share if part < 1 else 0  # the subset's plain Hessian and the rest's: one more over all tokens
    hessians = sum(2 * tokens * t * i * i * (GUIDED_GROUPS * share * part + plain - 1) for i, _, t in b["groups"])
    gradient = layers * (4 * block_forward / 2 * part + hessians) + 2 * head * part  # the head: forward, input gradient
    rows, seq = SENSITIVITY_WINDOWS
    few = rows * seq
    small = block_forward * few / tokens / 2  # one forward of a block on the sensitivity's windows
    formats = 4  # int4 g128 / g64 / g32 and int8, where the widths fit
    method = cost_model(b["groups"], few, group_size, b["sparse_input"])["flops"] * formats
    units = len(b["groups"])
    sensitivity = layers * (small * (2 + 2 * FISHER_DRAWS + formats * units) + method) + 2 * head * few / tokens
    return {
        "gradient_pass": {
            "seconds": gradient / rate,
            "spill_bytes": round(layers * tokens * part) * h * 4,
            "groups": GUIDED_GROUPS,
            "rows": round(tokens * part) // seq_len,
        },
        "sensitivity": {"seconds": sensitivity / rate, "tokens": few},
    }


def _float_targets(b: dict, tokens: int, h: int, layers: int, block_forward: float, rate: float) -> dict:
    """What GPTQ's `--float-targets` adds (`calibration.targets`): per block, the float copy
    run as far as each group of linears (about one forward) and once whole for the next
    block's float inputs, D = (X̃ − X)·Xᵀ beside each H and the solve for W* per group; a float
    copy of the block and the float stream's hidden states in memory; the float stream saved
    with every commit of the resume state (measured on smollm2-135m: 1.65× plain GPTQ's CPU time)."""
    flops = 2 * block_forward + sum(2 * tokens * t * i * i + i**3 + 2 * o * i * i for i, o, t in b["groups"])
    return {
        "seconds": layers * flops / rate,
        "host_bytes": 4 * b["params"] + tokens * h * 4,
        "commit_bytes": tokens * h * 4,
    }


def measure_gflops(device: str = "cpu", seconds: float = 0.5) -> float:
    """This machine's fp32 matmul rate (GFLOP/s) on `device`, measured for about `seconds`."""
    import time

    import torch

    n = 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b  # warm up
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        a @ b
        count += 1
        if device != "cpu":
            torch.cuda.synchronize()
    return 2 * n**3 * count / elapsed / 1e9


def draft_plan(target: dict, draft: dict, draft_scheme: str = "bf16", kv_cache: str | None = None) -> dict:
    """What a speculative-decoding draft model adds to serving `target` (`runtime/draft.py`): its
    weights in `draft_scheme`, and KV bytes per token, which the engine spends for every token
    of the target's cache (the draft's KV lives in the same blocks); `kv_ratio` is that over
    the target's own KV per token."""
    target = {**target, **(target.get("text_config") or {})}
    draft = {**draft, **(draft.get("text_config") or {})}
    if draft.get("vocab_size") != target.get("vocab_size"):
        raise QuantkitError(
            f"the draft has {draft.get('vocab_size')} logits per token and the target {target.get('vocab_size')}; "
            "a draft must share the target's vocabulary."
        )
    kv = kv_bytes_per_token(draft, kv_cache)
    return {
        "draft_scheme": draft_scheme,
        "draft_weight_bytes": weight_bytes(draft, draft_scheme),
        "draft_kv_bytes_per_token": kv,
        "kv_ratio": kv / kv_bytes_per_token(target, kv_cache),
    }
