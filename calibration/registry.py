"""The calibration methods, one entry each: its options (a frozen dataclass whose fields,
declared with `option`, are the recipe keys and the CLI flags), the on-disk format its
weights get, whether it needs calibration text, whether it folds scales into other
modules, and where its runner step lives. The recipe validator, the quantize pipeline and
the CLI read these entries, so each default exists once. Adding a method is its module
(math and runner step) plus an entry here; docs/methods.md walks through one. No torch
here: the CLI reads this table at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.calibration.method import Method, option
from quantkit.errors import QuantkitError

KV_DTYPES = ("fp8", "int8")
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")


@dataclass(frozen=True)
class RTNOptions:
    """Round-to-nearest has no options."""


GUIDED_HELP = (
    "Weight GPTQ's Hessians by the float model's loss gradients (GuidedQuant): this many groups of "
    "output channels per linear, each quantized under its own Hessian; one backward pass over the "
    "calibration text first (dense models). 0: plain Hessians."
)
GUIDED_ROWS_HELP = (
    "Calibration rows the loss gradients are taken on (the first N; 0: all): the other rows' tokens count "
    "in the guided Hessians at weight 1, the mean, so the gradient pass and the weighted products cost N rows."
)
GUIDED_ROWS = 8  # the default: see docs/benchmarks.md, "--guided 4 from 8 rows' gradients"


@dataclass(frozen=True)
class AWQOptions:
    grid: int = option(20, "Points of the scale-exponent grid in [0, 1).", min=1)
    grid_stride: int = option(
        1,
        "Score every Nth grid point first, then those between the best one's neighbours (1: every point; 3: 11 of 20).",
        min=1,
    )
    duo: bool = option(False, "Blend weight magnitudes into the scales (duo scaling).")
    clip: bool = option(True, "Search per-group clipping ranges (else round to nearest).")
    clip_rounds: int = option(
        2, "Rounds of the asymmetric clip search's coordinate descent (each end alone) after both ends shrink.", min=0
    )
    gptq: bool = option(
        False,
        "Round with GPTQ's error feedback after the scales are folded (Hessian of the scaled inputs, "
        "act-order static, GPTQ's damping and refinement passes; the group ranges searched under it "
        "when --clip) instead of rounding each group alone.",
    )
    guided: int = option(0, "With --gptq: " + GUIDED_HELP[0].lower() + GUIDED_HELP[1:], min=0)
    guided_rows: int = option(GUIDED_ROWS, GUIDED_ROWS_HELP, min=0)
    module_loss: bool = option(
        False,
        "Score q,k,v scales on the attention output and gate,up on the MLP output "
        "(slower) instead of the linears' own outputs.",
    )
    save_search: str | None = option(None, "Write the found scales and clips to this file (safetensors).", kind="text")
    load_search: str | None = option(None, "Apply a saved search instead of calibrating.", kind="text")


HESSIAN_BYTES = 1 << 30  # GPTQ: Hessians gathered in one pass over a block's experts, at most about


@dataclass(frozen=True)
class GPTQOptions:
    damp: float = option(0.05, "Hessian dampening, as a fraction of its mean diagonal.", min=0)
    block_size: int = option(128, "Columns per lazy-update block.", min=1)
    range_search: bool = option(
        True,
        "Search each group's range for the least output error under the Hessian when the group starts (else min-max).",
    )
    refine: int = option(
        2,
        "Passes of coordinate descent over the rounded weights after the column loop: each column "
        "rounded again to the grid point with the least output error given the others (qparams kept).",
        min=0,
    )
    guided: int = option(0, GUIDED_HELP, min=0)
    guided_rows: int = option(GUIDED_ROWS, GUIDED_ROWS_HELP, min=0)
    float_targets: bool = option(
        False,
        "Fit each linear to the float model's outputs rather than its own (GPTAQ): its weights first move "
        "to the least-squares fit of the float model's outputs from the quantized model's inputs, then GPTQ "
        "rounds them (dense models; the float model's activations are carried beside the quantized ones).",
    )


AUTOROUND_GRIDS = ("full", "minmax")


@dataclass(frozen=True)
class AutoRoundOptions:
    iters: int = option(200, "Signed-gradient steps per block (0: round to nearest).", min=0)
    lr: float | None = option(
        None, "Step size of the rounding offsets, decayed linearly to 0 (default 1/iters).", kind="float", min=0
    )
    clip_lr: float | None = option(None, "Step size of the clip factors (default: --lr).", kind="float", min=0)
    batch: int = option(8, "Calibration rows per step (drawn from all rows, reshuffled each pass).", min=1)
    grid: str = option(
        "full",
        "Symmetric int grid: full (the reference's and llama.cpp Q4_0's: scale = the group's signed "
        "largest-magnitude value / -2^(bits-1), so that value lands on the lowest code) or minmax "
        "(compressed-tensors' and quantkit rtn's: scale = max|W| / 7.5 at 4 bits).",
        choices=AUTOROUND_GRIDS,
    )


@dataclass(frozen=True)
class FP8Options:
    """FP8 has no options of its own (smoothing is the `smooth` method, run before it)."""


@dataclass(frozen=True)
class SmoothOptions:
    grid: int = option(10, "Points of the α grid in [0, 1] (s = 1, no smoothing, is always tried).", min=1)


ROTATIONS = ("hadamard", "random-hadamard")


@dataclass(frozen=True)
class RotateOptions:
    kind: str = option(
        "hadamard",
        "The orthogonal matrices: normalized Hadamard (Sylvester/Paley Kronecker products), or with random "
        "signs per row drawn from seed.",
        choices=ROTATIONS,
    )
    seed: int = option(
        0, "Seed of random-hadamard's signs (and of a random orthogonal factor an odd size needs).", min=0
    )


@dataclass(frozen=True)
class KVOptions:
    dtype: str = option("fp8", "KV-cache type.", choices=KV_DTYPES)
    per_head: bool = option(False, "One scale per KV head instead of per layer.")


def static_activations(scheme, options=None) -> bool:
    """Whether the scheme's activation scales are calibrated (fp8; NVFP4's global scale, dynamic
    "local") rather than taken per token at run time."""
    acts = scheme.input_activations
    return acts is not None and acts.dynamic is not True


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "rtn",
            "Round-to-nearest INT4 (or INT8, W8A8; NVFP4, MXFP4, MXFP8) weights: the baseline for AWQ and GPTQ "
            "(calibration text is read only for smoothing, KV-cache scales and NVFP4 activations' global scales).",
            RTNOptions,
            "weights",
            "quantkit.calibration.rtn:rtn_step",
            "pack-quantized",
            formats=("int-quantized", *FP4_FORMATS, "mxfp8-quantized"),
            needs_data=static_activations,
            default_scheme="w4a16",
        ),
        Method(
            "awq",
            "AWQ INT4, NVFP4 or MXFP4 (Lin et al.): activation-aware scales folded into the previous op, then "
            "per-group clipping.",
            AWQOptions,
            "weights",
            "quantkit.calibration.awq:awq_step",
            "pack-quantized",
            formats=FP4_FORMATS,
            needs_data=lambda scheme, o: o.load_search is None or o.gptq,
            folds_scales=True,
            default_scheme="w4a16",
            plan="quantkit.calibration.awq:plan_cost",
        ),
        Method(
            "gptq",
            "GPTQ INT4 or INT8, NVFP4 / MXFP4, FP8 block-wise or MXFP8 (Frantar et al.): Hessian-based error "
            "feedback, true-sequential, act-order.",
            GPTQOptions,
            "weights",
            "quantkit.calibration.gptq:gptq_step",
            "pack-quantized",
            formats=("int-quantized", *FP4_FORMATS, "float-quantized", "mxfp8-quantized"),
            default_scheme="w4a16",
            actorder=True,
            default_actorder="static",
            plan="quantkit.calibration.gptq:plan_cost",
        ),
        Method(
            "autoround",
            "AutoRound INT4, NVFP4 or MXFP4 (Cheng et al.): per block, learn each weight's rounding and each "
            "group's clipping by signed gradient descent on the block's output error.",
            AutoRoundOptions,
            "weights",
            "quantkit.calibration.autoround:autoround_step",
            "pack-quantized",
            formats=FP4_FORMATS,
            default_scheme="w4a16",
            plan="quantkit.calibration.autoround:plan_cost",
        ),
        Method(
            "fp8",
            "FP8 e4m3 weights and activations (static activation scales are calibrated): per channel, tensor, "
            "128x128 block (fp8-block) or MX group of 32 (mxfp8).",
            FP8Options,
            "weights",
            "quantkit.calibration.fp8:fp8_step",
            "float-quantized",
            formats=("mxfp8-quantized",),
            needs_data=static_activations,
            default_scheme="fp8-dynamic",
        ),
        Method(
            "smooth",
            "SmoothQuant (Xiao et al.): migrate activation outliers into the weights before quantizing.",
            SmoothOptions,
            "transform",
            "quantkit.calibration.smooth:smooth_step",
            folds_scales=True,
            needs_activations=True,
            before=("fp8", "rtn", "gptq"),
        ),
        Method(
            "rotate",
            "Rotations fused into the weights (QuaRot; SpinQuant's R1 and R2): the residual stream and each "
            "head's values rotated by Hadamard matrices, the norms folded, a tied LM head untied; the float "
            "function is unchanged and outliers spread out.",
            RotateOptions,
            "transform",
            needs_data=lambda scheme, o: False,
            before=("rtn", "awq", "gptq", "fp8"),
            reads="quantkit.calibration.rotate:rotated_weights",
            flag="kind",
        ),
        Method(
            "kv",
            "KV-cache scales (fp8 or int8), calibrated on the keys and values the model computes.",
            KVOptions,
            "kv",
        ),
    )
}


def method(name: str) -> Method:
    """The entry called `name`, or a `QuantkitError` naming the known ones."""
    if name not in METHODS:
        raise QuantkitError(f"method {name!r} is unknown; use one of {', '.join(METHODS)}.")
    return METHODS[name]


def weight_methods() -> list[str]:
    return [m.name for m in METHODS.values() if m.role == "weights"]
