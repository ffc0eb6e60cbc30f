"""What the pipeline, the recipe validator and the CLI know of calibration without running
it (no torch here, so the CLI starts fast): a `Method` entry (see `registry.py`) names its
options dataclass, the on-disk format its weights get, whether it needs calibration text
and whether it folds scales into other modules; `Calibration` says which text and how
much; `QParams` is what a method's runner step records for each linear it quantizes."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KINDS = ("bool", "int", "float", "text", "choice")


def option(
    default, help: str, *, kind: str | None = None, min: float | None = None, choices: tuple = (), cli: bool = True
):
    """A field of a method's options dataclass: the default, the help text (recipe docs and
    CLI flag), what values it takes (`kind`, read from the default when not given; `min`;
    `choices`), and whether the method's command has a flag for it."""
    kind = kind or (
        "choice"
        if choices
        else "bool"
        if isinstance(default, bool)
        else "int"
        if isinstance(default, int)
        else "float"
        if isinstance(default, float)
        else "text"
    )
    if kind not in KINDS:
        raise ValueError(f"option kind {kind!r} is not one of {KINDS}")
    meta = {"help": help, "kind": kind, "min": min, "choices": tuple(choices), "cli": cli}
    return dataclasses.field(default=default, metadata=meta)


def describe(options: type) -> dict[str, dict]:
    """name -> {default, help, kind, min, choices, cli} of an options dataclass."""
    return {f.name: {"default": f.default, **f.metadata} for f in dataclasses.fields(options)}


@dataclass
class QParams:
    """The quantization parameters a method chose for one linear."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None  # static fp8 activations (NVFP4: the input global scale)
    global_scale: torch.Tensor | None = None  # NVFP4: the weight global scale (shared by a fused group)


@dataclass(frozen=True)
class Calibration:
    """Which text to calibrate on and how to cut it (see `datasets.calibration_samples`)."""

    dataset: str = option(
        "news", "Calibration text: news, wiki, c4, wikitext2, pileval or a .txt/.jsonl/.parquet file."
    )
    samples: int = option(128, "Calibration rows.", min=1)
    seq_len: int = option(512, "Tokens per calibration row.", min=1)
    seed: int = option(0, "Seed of the calibration document order.", min=0)
    batch_size: int = option(8, "Rows per forward pass through a block.", min=1, cli=False)
    min_expert_tokens: int = option(
        512,
        "Mixture-of-experts models: an expert routed fewer calibration tokens is calibrated on all of "
        "them (its statistics only; the block's output keeps the real routing).",
        min=0,
    )


@dataclass(frozen=True)
class Method:
    """One calibration method, as everything above `calibration/` sees it.

    `step` names ("module:function", imported on first use) the factory
    `make_step(spec, scheme, options, results, scale_dtype, log)` of the runner step
    (`runner.Step`) that quantizes (or transforms) one block in place and records a
    `QParams` per quantized linear in `results`. `role` is "weights" (one per run: it
    quantizes the weights into `format`), "transform" (runs on each block before the
    weight method, or with `reads` on the float weights as they are read: `before` names the
    weight methods it may precede) or "kv" (the
    KV-cache scales, observed on the calibration pass; no step of its own)."""

    name: str
    summary: str
    options: type
    role: str
    step: str | None = None
    format: str | None = None  # "pack-quantized" (int weights), "float-quantized" (fp8)
    formats: tuple[str, ...] = ()  # further formats, for schemes that ask for them ("int-quantized": W8A8)
    needs_data: Callable[[object, object], bool] = lambda scheme, options: True  # (scheme, options)
    folds_scales: bool = False  # scales go into the op before a group of linears (no per-module args)
    default_scheme: str | None = None
    actorder: bool = False  # takes act-order schemes
    default_actorder: str | None = None  # the act-order its command and `quantkit.quantize` use unless told
    needs_activations: bool = False  # only for schemes that quantize activations
    before: tuple[str, ...] = ()
    plan: str | None = None  # "module:function": its cost model for `quantkit plan --calibrate` (None: not planned)
    # a transform applied to the float weights as they are read, instead of a runner step:
    # "module:function" of `reads(model, spec, weights, options) -> (weights, how)` (rotate)
    reads: str | None = None
    flag: str | None = None  # the option its commands' --NAME VALUE flag sets (None: a plain switch)

    def makes(self, fmt: str) -> bool:
        """Whether the method's weights can take the on-disk format `fmt` (a scheme's `format`)."""
        return fmt == self.format or fmt in self.formats

    @property
    def make_step(self) -> Callable:
        return _imported(self.step)

    @property
    def make_reader(self) -> Callable:
        return _imported(self.reads)


def _imported(where: str) -> Callable:
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)
