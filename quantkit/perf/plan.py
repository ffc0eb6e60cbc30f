"""Capacity planning from a model's config.json alone (no weights): weight and KV-cache
memory per scheme, how many sequences fit on a GPU, and the memory-bandwidth lower
bounds on decode latency, throughput and cost. Bounds, not measurements: real engines
land above these latencies (`quantkit bench` measures them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.calibration.registry import HESSIAN_BYTES
from quantkit.errors import QuantkitError
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


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of the linears of one decoder block (Llama/Mistral/Qwen2 layout)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    return {
        "q_proj": (heads * hd, h),
        "k_proj": (kv_heads * hd, h),
        "v_proj": (kv_heads * hd, h),
        "o_proj": (h, heads * hd),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def _moe(config: dict) -> dict | None:
    """A mixture-of-experts config's experts (Mixtral, Qwen2-MoE, Qwen3-MoE): how many, how
    many a token uses, their width, the shared expert's width (0: none) and how many layers
    are sparse (Qwen's mlp_only_layers and decoder_sparse_step leave some dense); None: dense."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        return None
    layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    return {
        "experts": experts,
        "top_k": config["num_experts_per_tok"],
        "width": config.get("moe_intermediate_size") or config["intermediate_size"],
        "shared": config.get("shared_expert_intermediate_size") or 0,
        "layers": sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0),
    }


def block_linears(config: dict) -> list[tuple[int, int, int, int]]:
    """(out, in, how many the model has, how many one token reads) of every kind of block
    linear: attention, dense MLPs, and in sparse layers every expert (top-k read per token)
    and the shared expert."""
    h, layers, shapes = config["hidden_size"], config["num_hidden_layers"], linear_shapes(config)
    moe = _moe(config)
    sparse = moe["layers"] if moe else 0
    rows = [(*shapes[n], layers, layers) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    rows += [(*shapes[n], layers - sparse, layers - sparse) for n in ("gate_proj", "up_proj", "down_proj")]
    if moe:
        e, k, w, s = moe["experts"], moe["top_k"], moe["width"], moe["shared"]
        rows += [(o, i, sparse * e, sparse * k) for o, i in ((w, h), (w, h), (h, w))]
        rows += [(o, i, sparse, sparse) for o, i in ((s, h), (s, h), (h, s)) if s]
    return [r for r in rows if r[2]]


def _float_params(config: dict) -> int:
    """Parameters that stay in float: embeddings, lm_head, norms, biases, routers."""
    h, vocab, shapes = config["hidden_size"], config["vocab_size"], linear_shapes(config)
    biased = set()
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        biased |= {"q_proj", "k_proj", "v_proj"} | ({"o_proj"} if config.get("attention_bias") else set())
    if config.get("mlp_bias"):
        biased |= {"gate_proj", "up_proj", "down_proj"}
    per_block = 2 * h + sum(shapes[n][0] for n in biased)  # two norms + biases
    heads = 1 if config.get("tie_word_embeddings", False) else 2
    moe = _moe(config)
    routers = moe["layers"] * (moe["experts"] + (1 if moe["shared"] else 0)) * h if moe else 0  # and shared gates
    return config["num_hidden_layers"] * per_block + h + heads * vocab * h + routers


def param_count(config: dict, active: bool = False) -> int:
    """All parameters of the model described by `config` (HF config.json dict); with
    `active`, those one token reads (a mixture of experts' top-k experts, not all)."""
    return sum(o * i * (a if active else n) for o, i, n, a in block_linears(config)) + _float_params(config)


def linear_bytes(
    out: int, inp: int, args: QuantArgs | None, static_input: bool = False, float_bytes: int = FLOAT_BYTES
) -> float:
    """Bytes of one [out, in] linear in memory: values, scales (and zero points)."""
    if args is None:
        return out * inp * float_bytes
    scale_bytes = 4 if args.type == "float" else float_bytes  # fp8 scales are fp32, int scales model dtype
    scales = {"group": out * math.ceil(inp / (args.group_size or inp)), "channel": out}.get(args.strategy, 1)
    total = out * inp * args.num_bits / 8 + scales * scale_bytes + (4 if static_input else 0)
    if not args.symmetric:  # zero points, packed like the weights
        total += scales * args.num_bits / 8
    return total


def weight_bytes(config: dict, scheme: str, active: bool = False) -> float:
    """Bytes of all weights with the block linears quantized per `scheme`; with `active`,
    of those one token reads."""
    args, static_input = _scheme_args(scheme)
    linears = sum(linear_bytes(o, i, args, static_input) * (a if active else n) for o, i, n, a in block_linears(config))
    return linears + _float_params(config) * FLOAT_BYTES


def kv_bytes_per_token(config: dict, kv_cache: str | None = None) -> int:
    """2 (K and V) × layers × KV heads × head_dim × bytes per element."""
    if kv_cache not in KV_BYTES:
        raise QuantkitError(f"unknown KV-cache type {kv_cache!r}; use one of: bf16, fp16, fp8, int8.")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * hd * KV_BYTES[kv_cache]


def _scheme_args(scheme: str) -> tuple[QuantArgs | None, bool]:
    if scheme in FLOAT_SCHEMES:
        return None, False
    known = [n for n, p in PRESETS.items() if p.weights is not None]
    if scheme not in known:
        options = ", ".join(FLOAT_SCHEMES + tuple(known))
        raise QuantkitError(f"unknown scheme {scheme!r} for planning; use one of: {options}.")
    p = PRESETS[scheme]
    return p.weights, p.input_activations is not None and not p.input_activations.dynamic


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
        args, _ = _scheme_args(scheme)
        fp8_math = args is not None and args.type == "float" and spec.fp8_tflops is not None
        attention = 2 * config["num_hidden_layers"] * context**2 * linear_shapes(config)["q_proj"][0]  # causal QK, PV
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
SEARCH_TOKENS, BATCH = 16384, 8  # AWQ scores scales on at most this many tokens; rows per forward
FP32_TFLOPS = {"h100-80gb": 67, "a100-80gb": 19.5, "h200": 67, "l40s": 91.6, "l4": 30.3, "rtx4090": 82.6}
# Calibration reaches this fraction of the device's fp32 matmul rate: its passes are many
# small forwards, rounding, searches and GPTQ's column loop. Fitted on smollm2 (64 × 512,
# 2026-12-01: AWQ 300 s, GPTQ with range search 317 s, against a measured 120 GFLOP/s).
EFFICIENCY = {"gptq": 0.58, "awq": 0.63}
_FILE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    sparse one (all its experts), each expert sees its top-k share of the tokens, and GPTQ
    holds up to HESSIAN_BYTES of expert Hessians at once."""
    if method not in EFFICIENCY:
        raise QuantkitError(f"--calibrate {method!r} is not planned; use awq or gptq.")
    if samples < 1 or seq_len < 1 or gflops <= 0:
        raise QuantkitError(f"need samples, seq-len and gflops > 0, got {samples}, {seq_len}, {gflops}.")
    config = {**config, **(config.get("text_config") or {})}
    try:
        h, inter, vocab, layers = (
            config["hidden_size"],
            config["intermediate_size"],
            config["vocab_size"],
            config["num_hidden_layers"],
        )
        shapes = linear_shapes(config)
    except KeyError as e:
        raise QuantkitError(f"config.json lacks {e.args[0]!r}; planning needs a decoder-only LM config.") from None
    file_bytes = _FILE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "float32"), 4)
    tokens = samples * seq_len
    attn_width = shapes["o_proj"][1]
    # per group of linears that share an input: (in, out summed, share of the tokens it sees)
    groups = [(h, shapes["q_proj"][0] + shapes["k_proj"][0] + shapes["v_proj"][0], 1.0), (attn_width, h, 1.0)]
    moe = _moe(config)
    if moe:
        e, w, s, share = moe["experts"], moe["width"], moe["shared"], moe["top_k"] / moe["experts"]
        groups += [(h, 2 * w, share)] * e + [(w, h, share)] * e + ([(h, 2 * s, 1.0), (s, h, 1.0)] if s else [])
        inter = moe["top_k"] * w + s  # intermediate width a token computes
    else:
        groups += [(h, 2 * inter, 1.0), (inter, h, 1.0)]
    block_params = sum(i * o for i, o, _ in groups) + 2 * h + (moe["experts"] * h if moe else 0)
    block = 4 * block_params + (file_bytes * block_params if file_bytes != 4 else 0)  # fp32, plus the read copy
    activations = 2 * tokens * h * 4  # the block's inputs and outputs, fp32
    heads = config["num_attention_heads"]
    forward = BATCH * seq_len * (3 * inter + 4 * h) * 4  # one batch's intermediates inside the block
    forward += BATCH * heads * seq_len**2 * 4  # and its attention scores
    if method == "gptq":
        widest = max(i for i, _, _ in groups)  # the largest Hessian: down_proj's
        out_rows = max(o for i, o, _ in groups if i == widest)
        held = sum(1 for i, _, _ in groups if i == widest)  # a pass over experts keeps one Hessian each
        held = min(held, max(1, HESSIAN_BYTES // (4 * widest**2)))
        # H, its act-order permuted copy and two factors; the stacked weights, permuted, Q and the error
        working = (3 + held) * widest**2 * 4 + 4 * out_rows * widest * 4
    else:
        kept = min(tokens, SEARCH_TOKENS)
        # every group's input of the block (and a sparse MLP's own), kept for the search
        working = kept * (sum(i * share for i, _, share in groups) + (h if moe else 0)) * 4
        working += 2 * kept * max(o for _, o, _ in groups) * 4  # one candidate's outputs and reference
    embed = vocab * h * (4 + (file_bytes if file_bytes != 4 else 0))
    capture = embed + tokens * h * 4
    block_phase = block + activations + working + forward
    on_device = device != "cpu"
    host = LIBRARY_BYTES + (max(block, tokens * h * 4) if on_device else max(capture, block_phase))
    device_peak = max(capture, block_phase - (file_bytes * block_params if file_bytes != 4 else 0)) if on_device else 0
    # time: every matmul the method runs, at `EFFICIENCY` of the device's rate. Per group of
    # linears that share an input: GPTQ accumulates XᵀX, factors it and runs its column
    # loop; AWQ forms XᵀX once and scores `grid` scale candidates with it, then scores
    # clipping ranges per group from second moments.
    block_forward = 2 * tokens * sum(o * i * share for i, o, share in groups) + 2 * tokens * seq_len * attn_width
    if method == "gptq":
        per_block = 2 * block_forward + sum(2 * tokens * t * i * i + i**3 / 3 + 2 * o * i * i for i, o, t in groups)
    else:
        kept = min(tokens, SEARCH_TOKENS)
        per_block = 2 * block_forward + sum(2 * kept * t * i * i + 20 * 2 * o * i * i for i, o, t in groups)
        per_block += sum(2 * kept * t * i * group_size + 40 * o * i * group_size for i, o, t in groups)
    seconds = layers * per_block / (gflops * 1e9 * EFFICIENCY[method])
    args = QuantArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    output = sum(linear_bytes(o, i, args, float_bytes=file_bytes) * n for o, i, n, _ in block_linears(config))
    output += _float_params(config) * file_bytes
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
        "output_bytes": output,
        "breakdown": {
            "libraries": LIBRARY_BYTES,
            "block_weights": block,
            "activations": activations,
            "working_set": working,
            "forward": forward,
            "embeddings": embed,
        },
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
