"""Quantization schemes in the compressed-tensors vocabulary, so vLLM reads them.

A `QuantScheme` says how the weights, input activations and KV cache of the targeted
modules are quantized; `to_quantization_config` / `from_quantization_config` turn it
into and out of the `quantization_config` JSON that lives in `config.json`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError

STRATEGIES = ("tensor", "channel", "group", "token", "attn_head", "tensor_group", "block")
ACTORDERS = (None, "static", "weight", "group")
# the dtype a float format's scales are stored in: fp8 e4m3 (NVFP4's group scales), uint8 (MX's e8m0 exponents)
SCALE_DTYPES = (None, "float8_e4m3fn", "uint8")
FP4_GROUPS = {16: "nvfp4-pack-quantized", 32: "mxfp4-pack-quantized"}  # fp4 weights: group size -> format


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor is quantized (names as in compressed-tensors `QuantizationArgs`)."""

    num_bits: int = 4
    type: str = "int"  # "int" | "float"
    symmetric: bool = True
    strategy: str = "group"  # tensor | channel | group | token | attn_head
    group_size: int | None = 128
    dynamic: bool = False
    actorder: str | None = None  # GPTQ activation order: None | "static"/"weight" | "group"
    # dynamic may also be "local": NVFP4 activations, a static global scale and group scales taken at run time
    block_structure: tuple[int, int] | None = None  # strategy "block": [rows, columns] of each scale's block
    scale_dtype: str | None = None  # one of SCALE_DTYPES: how a float format stores its scales

    def __post_init__(self):
        if self.type not in ("int", "float"):
            raise QuantkitError(f"quantization type {self.type!r} is unknown; use 'int' or 'float'.")
        if self.strategy not in STRATEGIES:
            raise QuantkitError(f"strategy {self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}.")
        if self.strategy in ("group", "tensor_group") and not (self.group_size and self.group_size > 0):
            raise QuantkitError(f"the {self.strategy} strategy needs a positive group size.")
        if (self.strategy == "block") != (self.block_structure is not None):
            raise QuantkitError("the block strategy and a block_structure [rows, columns] go together; give both.")
        if self.type == "float" and (self.num_bits not in (4, 8) or not self.symmetric):
            raise QuantkitError("float quantization is fp8 e4m3 or fp4 e2m1: 8 or 4 bits, symmetric.")
        fp4 = (self.strategy, self.group_size, self.scale_dtype)
        if self.is_fp4 and fp4 not in (("tensor_group", 16, "float8_e4m3fn"), ("group", 32, "uint8")):
            raise QuantkitError(
                "fp4 takes groups of 16 (NVFP4: strategy tensor_group, float8_e4m3fn scales) or 32 "
                "(MXFP4: strategy group, uint8 scales); use the nvfp4 or mxfp4 presets."
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise QuantkitError(f"scale dtype {self.scale_dtype!r} is unknown; use float8_e4m3fn or uint8.")
        if self.dynamic not in (True, False, "local"):
            raise QuantkitError(f"dynamic {self.dynamic!r} is unknown; use true, false or local.")
        if self.actorder not in ACTORDERS:
            raise QuantkitError(f"actorder {self.actorder!r} is unknown; use static, group or none.")

    @property
    def is_fp4(self) -> bool:
        return self.type == "float" and self.num_bits == 4

    @property
    def is_mx(self) -> bool:
        """An MX format (OCP microscaling): groups of 32 with power-of-two (e8m0) scales."""
        return self.type == "float" and self.scale_dtype == "uint8"

    @property
    def grid_max(self) -> float:
        """The largest magnitude of the format's grid (int: qmax's side, fp8 e4m3 448, fp4 e2m1 6)."""
        if self.type == "float":
            return 6.0 if self.num_bits == 4 else 448.0
        return ((1 << self.num_bits) - 1) / 2

    @property
    def qmin(self) -> int | float:
        """The grid's smallest value (float grids: -`grid_max`, a float)."""
        return -self.grid_max if self.type == "float" else -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int | float:
        """The grid's largest value (float grids: `grid_max`, a float: 6.0 fp4 e2m1, 448.0 fp8 e4m3)."""
        return self.grid_max if self.type == "float" else (1 << (self.num_bits - 1)) - 1

    def to_dict(self) -> dict:
        d = {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "group_size": self.group_size if self.strategy in ("group", "tensor_group") else None,
            "dynamic": self.dynamic,
            "actorder": self.actorder,
            "block_structure": list(self.block_structure) if self.block_structure else None,
            "observer": "static_minmax" if self.dynamic == "local" else None if self.dynamic else "minmax",
            "observer_kwargs": {},
        }
        if self.scale_dtype is not None:  # as compressed-tensors writes it: only when set
            d["scale_dtype"] = f"torch.{self.scale_dtype}"
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> QuantArgs | None:
        if d is None:
            return None
        strategy = d.get("strategy") or ("group" if d.get("group_size") else "tensor")
        dynamic = d.get("dynamic", False)
        actorder = d.get("actorder")
        block, scale_dtype = d.get("block_structure"), d.get("scale_dtype")
        return cls(
            num_bits=int(d.get("num_bits", 8)),
            type=d.get("type", "int"),
            symmetric=bool(d.get("symmetric", True)),
            strategy=strategy,
            group_size=d.get("group_size") if strategy in ("group", "tensor_group") else None,
            dynamic=dynamic if isinstance(dynamic, bool) or dynamic == "local" else dynamic == "true",
            actorder=actorder if actorder not in (False, "dynamic") else None,
            block_structure=tuple(block) if block and strategy == "block" else None,
            scale_dtype=scale_dtype.removeprefix("torch.") if scale_dtype else None,
        )


@dataclass(frozen=True)
class QuantScheme:
    """Weights / input activations of the targeted modules, plus the KV cache."""

    name: str
    weights: QuantArgs | None
    input_activations: QuantArgs | None = None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache: QuantArgs | None = None
    overrides: tuple[QuantScheme, ...] = ()  # per-module schemes, targets by regex ("re:...")
    # group_size is a ceiling, fitted to the model's input widths before quantizing (`fit_group_size`)
    auto_group_size: bool = False

    @property
    def format(self) -> str:
        """The compressed-tensors on-disk format of the weights."""
        if self.weights is None:
            return "dense"
        if self.weights.is_fp4:
            return FP4_GROUPS[self.weights.group_size]
        if self.weights.is_mx:
            return "mxfp8-quantized"
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is None or self.input_activations.type == "float":
            # int weights on fp8 activations (w4afp8): packed, as vLLM's W4A8Fp8 reads them
            # (compressed-tensors 0.20.1 would infer int-quantized, one int8 per weight)
            return "pack-quantized"
        return "int-quantized"

    def replace(self, **changes) -> QuantScheme:
        return dataclasses.replace(self, **changes)

    def with_group_size(self, group_size: int | None) -> QuantScheme:
        if group_size is None or self.weights is None:
            return self
        if self.weights.strategy != "group":
            raise QuantkitError(f"scheme {self.name!r} has no groups; drop --group-size.")
        return self.replace(weights=dataclasses.replace(self.weights, group_size=group_size))

    def is_ignored(self, module_name: str) -> bool:
        return any(_matches(pattern, module_name) for pattern in self.ignore)

    def scheme_for(self, module_name: str) -> QuantScheme | None:
        """The scheme this module is quantized with: None if ignored, else the one override
        whose targets match it, else this scheme."""
        if self.is_ignored(module_name):
            return None
        hits = [o for o in self.overrides if any(_matches(t, module_name) for t in o.targets)]
        if len(hits) > 1:
            raise QuantkitError(
                f"{module_name} is matched by the overrides {hits[0].targets[0]!r} and "
                f"{hits[1].targets[0]!r}; make their targets disjoint."
            )
        return hits[0] if hits else self


def fit_group_size(scheme: QuantScheme, widths: dict[str, int]) -> tuple[QuantScheme, list[str]]:
    """Resolve automatic group sizes: each (sub)scheme marked `auto_group_size` gets the
    largest power of two up to its group_size that divides the input width of every
    module it quantizes (`widths`: module name -> in_features). Returns the scheme and a
    line for each group size that had to shrink."""
    notes = []

    def fit(s: QuantScheme, names: list[str]) -> QuantScheme:
        if not s.auto_group_size or s.weights is None or s.weights.strategy != "group":
            return s.replace(auto_group_size=False)
        group, first = s.weights.group_size, s.weights.group_size
        misfit = None
        while group > 1 and any(widths[n] % group for n in names):
            misfit = misfit or next(n for n in names if widths[n] % group)
            group //= 2
        if misfit:
            note = f"group size {group}: {first} does not divide the input width {widths[misfit]} of {misfit}."
            if s.input_activations is not None and s.input_activations.type == "float":  # w4afp8
                note += " vLLM's W4A8Fp8 kernel takes group 128 only: vLLM will not load this checkpoint."
            notes.append(note)
        return s.replace(weights=dataclasses.replace(s.weights, group_size=group), auto_group_size=False)

    parts = {id(s): [] for s in (scheme, *scheme.overrides)}
    for name in widths:
        chosen = scheme.scheme_for(name)
        if chosen is not None:
            parts[id(chosen)].append(name)
    overrides = tuple(fit(o, parts[id(o)]) for o in scheme.overrides)
    return fit(scheme, parts[id(scheme)]).replace(overrides=overrides), notes


def with_actorder(scheme: QuantScheme, actorder: str | None) -> QuantScheme:
    """`scheme` with its own and every override's weights visiting columns in `actorder`."""

    def one(s: QuantScheme) -> QuantScheme:
        return s if s.weights is None else s.replace(weights=dataclasses.replace(s.weights, actorder=actorder))

    return one(scheme).replace(overrides=tuple(one(o) for o in scheme.overrides))


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


_W4 = QuantArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
_FP8_CHANNEL = QuantArgs(num_bits=8, type="float", strategy="channel", group_size=None)
_FP8_TENSOR = QuantArgs(num_bits=8, type="float", strategy="tensor", group_size=None)

_FP8_TOKEN = QuantArgs(num_bits=8, type="float", strategy="token", group_size=None, dynamic=True)
_FP8_BLOCK = QuantArgs(8, "float", strategy="block", group_size=None, block_structure=(128, 128))
_NVFP4 = QuantArgs(4, "float", strategy="tensor_group", group_size=16, scale_dtype="float8_e4m3fn")
_MXFP4 = QuantArgs(4, "float", strategy="group", group_size=32, scale_dtype="uint8")
_MXFP8 = QuantArgs(8, "float", strategy="group", group_size=32, scale_dtype="uint8")

PRESETS: dict[str, QuantScheme] = {
    "w4a16": QuantScheme("w4a16", _W4),
    "w4a16-asym": QuantScheme("w4a16-asym", dataclasses.replace(_W4, symmetric=False)),
    "w3a16": QuantScheme("w3a16", dataclasses.replace(_W4, num_bits=3)),
    "w8a16": QuantScheme(
        "w8a16", QuantArgs(num_bits=8, type="int", symmetric=True, strategy="channel", group_size=None)
    ),
    "w8a8": QuantScheme(
        "w8a8",
        QuantArgs(num_bits=8, type="int", symmetric=True, strategy="channel", group_size=None),
        input_activations=QuantArgs(num_bits=8, type="int", strategy="token", group_size=None, dynamic=True),
    ),
    "fp8-dynamic": QuantScheme(
        "fp8-dynamic",
        _FP8_CHANNEL,
        input_activations=_FP8_TOKEN,
    ),
    "fp8": QuantScheme("fp8", _FP8_TENSOR, input_activations=_FP8_TENSOR),
    "fp8-block": QuantScheme(
        "fp8-block",
        _FP8_BLOCK,
        input_activations=QuantArgs(8, "float", strategy="group", group_size=128, dynamic=True),
    ),
    "nvfp4a16": QuantScheme("nvfp4a16", _NVFP4),
    "nvfp4": QuantScheme("nvfp4", _NVFP4, input_activations=dataclasses.replace(_NVFP4, dynamic="local")),
    "mxfp4a16": QuantScheme("mxfp4a16", _MXFP4),
    "mxfp4": QuantScheme("mxfp4", _MXFP4, input_activations=dataclasses.replace(_MXFP4, dynamic=True)),
    "w4afp8": QuantScheme("w4afp8", _W4, input_activations=_FP8_TOKEN),
    "mxfp8": QuantScheme("mxfp8", _MXFP8, input_activations=dataclasses.replace(_MXFP8, dynamic=True)),
    "kv-fp8": QuantScheme("kv-fp8", None, kv_cache=_FP8_TENSOR),
    "kv-int8": QuantScheme(
        "kv-int8", None, kv_cache=QuantArgs(num_bits=8, type="int", strategy="tensor", group_size=None)
    ),
}


def preset(name: str) -> QuantScheme:
    """The named preset, or a `QuantkitError` listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise QuantkitError(f"unknown scheme {name!r}; use one of: {', '.join(PRESETS)}.") from None


def to_quantization_config(scheme: QuantScheme) -> dict:
    """The `quantization_config` dict that goes into `config.json`."""
    groups = {}
    if scheme.weights is not None:
        groups["group_0"] = {
            "targets": list(scheme.targets),
            "weights": scheme.weights.to_dict(),
            "input_activations": scheme.input_activations.to_dict() if scheme.input_activations else None,
            "output_activations": None,
            "format": scheme.format,
        }
    for i, o in enumerate(scheme.overrides, 1):  # regex targets win over "Linear" (compressed-tensors order)
        groups[f"group_{i}"] = {
            "targets": list(o.targets),
            "weights": o.weights.to_dict(),
            "input_activations": o.input_activations.to_dict() if o.input_activations else None,
            "output_activations": None,
            "format": o.format,
        }
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        # several formats (mixed precision over FP4 and int8): each group names its own, as compressed-tensors writes
        "format": "mixed-precision" if len(formats) > 1 else scheme.format,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(scheme.ignore),
        "kv_cache_scheme": scheme.kv_cache.to_dict() if scheme.kv_cache else None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


@dataclass(frozen=True)
class CheckpointConfig:
    """A parsed compressed-tensors `quantization_config`: one scheme per config group."""

    format: str
    schemes: tuple[QuantScheme, ...] = field(default_factory=tuple)
    ignore: tuple[str, ...] = ()
    kv_cache: QuantArgs | None = None

    def scheme_for(self, module_name: str, module_type: str = "Linear") -> QuantScheme | None:
        """The scheme whose targets match this module (None if it is ignored or untargeted); a
        name or regex target wins over a module-type target such as "Linear", as in
        compressed-tensors and vLLM."""
        if any(_matches(p, module_name) for p in self.ignore):
            return None
        by_name = (s for s in self.schemes if any(_matches(t, module_name) for t in s.targets))
        by_type = (s for s in self.schemes if module_type in s.targets)
        return next(by_name, None) or next(by_type, None)


def from_quantization_config(qc: dict) -> CheckpointConfig:
    """Parse a compressed-tensors `quantization_config` (ours or another tool's)."""
    if qc.get("quant_method") != "compressed-tensors":
        raise QuantkitError(
            f"quantization_config has quant_method {qc.get('quant_method')!r}; "
            "quantkit reads compressed-tensors checkpoints."
        )
    top_format = qc.get("format", "dense")
    ignore = tuple(qc.get("ignore") or ())
    schemes = []
    for gname, g in (qc.get("config_groups") or {}).items():
        if isinstance(g, list):  # a bare target list (no quantization args)
            continue
        schemes.append(
            QuantScheme(
                name=gname,
                weights=QuantArgs.from_dict(g.get("weights")),
                input_activations=QuantArgs.from_dict(g.get("input_activations")),
                targets=tuple(g.get("targets") or ("Linear",)),
                ignore=ignore,
            )
        )
        if g.get("format") and g["format"] != top_format and top_format != "mixed-precision":
            raise QuantkitError(
                f"config group {gname} has format {g['format']!r} unlike the checkpoint's {top_format!r}."
            )
    return CheckpointConfig(top_format, tuple(schemes), ignore, QuantArgs.from_dict(qc.get("kv_cache_scheme")))
