"""Recipes: one YAML file that says how a checkpoint is made (model, scheme, ordered
steps, calibration, eval gates), run by `quantkit run` and printed by every quantizing
command's `--print-recipe`, and stored in the checkpoint's `quantkit.json`.

    model: smollm2-135m
    scheme:                       # a preset name, or a mapping:
      preset: w4a16-asym          #   optional base (w4a16, w4a16-asym, w8a16, w8a8, fp8-dynamic, fp8)
      group_size: 64              #   weight args over the preset's (num_bits, type, ...); group_size
                                  #   absent or auto: the preset's, halved until it divides every width
      ignore: [lm_head]
      overrides:                  #   per-module args (or ignore: true), targets by regex
        - {targets: "re:.*down_proj$", group_size: 32}
    steps:                        # [transforms], one weight step (rtn, awq, ...: the registry's), [kv]; or kv alone
      - awq: {grid: 20}
      - kv: {dtype: fp8}
    calibration: {dataset: news, samples: 64, seq_len: 512, seed: 0}
    eval: {ppl: wiki, limit: 8, max_ppl_increase: 0.05}
    output: out/smollm2-awq
    target_bits: 4.56             # optional: mixed precision, a format per layer under this average
    target_formats: [int4, float] # optional, with target_bits: the formats to choose from (default: all)
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quantkit.calibration.method import Calibration, describe
from quantkit.calibration.registry import METHODS, weight_methods
from quantkit.errors import QuantkitError
from quantkit.pipeline import options as run_options
from quantkit.progress import Track, no_progress
from quantkit.scheme import ACTORDERS, PRESETS, QuantArgs, QuantScheme, preset

Kind = tuple[Callable[[object], bool], str]  # (accepts the value?, what is allowed, in words)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


POSITIVE: Kind = (lambda v: _is_int(v) and v > 0, "a positive integer")
NATURAL: Kind = (lambda v: _is_int(v) and v >= 0, "an integer ≥ 0")
NUMBER: Kind = (lambda v: (_is_int(v) or isinstance(v, float)) and v >= 0, "a number ≥ 0")
FRACTION: Kind = (lambda v: (_is_int(v) or isinstance(v, float)) and v > 0, "a number above 0, e.g. 0.98")
BOOL: Kind = (lambda v: isinstance(v, bool), "true or false")
TEXT: Kind = (lambda v: isinstance(v, str) and v != "", "a non-empty string")


def _optional(kind: Kind) -> Kind:
    return (lambda v: v is None or kind[0](v), f"{kind[1]} or null")


def _choice(*values) -> Kind:
    words = ["null" if v is None else str(v) for v in values]
    return (
        lambda v: v in values and not isinstance(v, bool),
        words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}",
    )


WEIGHT_ARGS: dict[str, Kind] = {
    "num_bits": _choice(4, 8),
    "type": _choice("int", "float"),
    "symmetric": BOOL,
    "strategy": _choice("tensor", "channel", "group"),
    "group_size": (
        lambda v: v is None or v == "auto" or POSITIVE[0](v),
        "a positive integer, auto (the largest power of two up to the preset's that divides every input width) or null",
    ),
    "dynamic": BOOL,
    "actorder": _choice(*ACTORDERS),
}
ACTIVATION_ARGS: dict[str, Kind] = {
    "num_bits": _choice(8),
    "type": _choice("int", "float"),
    "symmetric": BOOL,
    "strategy": _choice("tensor", "token"),
    "dynamic": BOOL,
}


def _kind(meta: dict) -> Kind:
    """The recipe check of an option declared with `calibration.method.option` (null allowed
    when the default is None)."""
    kind, low = meta["kind"], meta["min"]
    if meta["default"] is None and kind != "text":
        return _optional(_kind({**meta, "default": 0}))
    if kind == "choice":
        return _choice(*meta["choices"])
    if kind == "bool":
        return BOOL
    if kind == "text":
        return _optional(TEXT) if meta["default"] is None else TEXT
    if kind == "int":
        return POSITIVE if low == 1 else NATURAL if low == 0 else (lambda v: _is_int(v), "an integer")
    return NUMBER


def _table(options: type) -> dict[str, tuple[object, Kind]]:
    return {name: (meta["default"], _kind(meta)) for name, meta in describe(options).items()}


def _step_options() -> dict[str, dict[str, tuple[object, Kind]]]:
    """name -> option -> (default, kind), of each method registered when called."""
    return {name: _table(m.options) for name, m in METHODS.items()}


CALIBRATION: dict[str, tuple[object, Kind]] = _table(Calibration)
EVAL: dict[str, tuple[object, Kind]] = {  # the keyword arguments of quantkit.eval.gates.evaluate_gates
    "ppl": ("wiki", _optional(TEXT)),
    "tasks": (
        (),
        (lambda v: isinstance(v, (list, tuple)) and all(isinstance(t, str) for t in v), "a list of task names"),
    ),
    "limit": (None, _optional(POSITIVE)),
    "seq_len": (None, _optional(POSITIVE)),
    "num_fewshot": (None, _optional(NATURAL)),
    "include_path": (None, _optional(TEXT)),
    "max_ppl_increase": (None, _optional(NUMBER)),
    "min_recovery": (None, _optional(FRACTION)),
    "max_kld": (None, _optional(NUMBER)),
    "min_top1": (None, _optional((lambda v: FRACTION[0](v) and v <= 1, "a fraction in (0, 1], e.g. 0.9"))),
}


def _transforms() -> list[str]:
    return [name for name, m in METHODS.items() if m.role == "transform"]


def _top() -> tuple[str, ...]:
    return ("model", "scheme", "steps", "calibration", "eval", "output", *run_options.recipe_keys())


@dataclass(frozen=True)
class Override:
    """Other weight args (or none at all: `ignore`) for the modules the regexes match."""

    targets: tuple[str, ...]
    ignore: bool = False
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SchemeSpec:
    """A preset and/or explicit args, as written in the recipe (`build_scheme` makes the QuantScheme)."""

    preset: str | None = None
    weights: dict = field(default_factory=dict)  # weight args over the preset's
    input_activations: dict | None = None  # activation args over the preset's
    ignore: tuple[str, ...] | None = None  # None: the preset's (lm_head)
    overrides: tuple[Override, ...] = ()


@dataclass(frozen=True)
class Step:
    name: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; `from_dict(r.to_dict()) == r`."""

    model: str
    steps: tuple[Step, ...]
    scheme: SchemeSpec | None = None
    calibration: Calibration = Calibration()
    eval: dict | None = None  # evaluate_gates keyword arguments, defaults filled in
    output: str | None = None
    run: run_options.RunOptions = run_options.RunOptions()  # its recipe keys; kv_cache, overwrite, ... unused

    def __getattr__(self, name: str):
        """`recipe.device`, `recipe.max_shard_size`, ...: the run options it holds."""
        if name != "run" and name in run_options.recipe_keys():
            return getattr(self.run, name)
        raise AttributeError(name)

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = {"model": self.model}
        if self.scheme is not None:
            d["scheme"] = _scheme_dict(self.scheme)
        d["steps"] = [{s.name: dict(s.options)} for s in self.steps]
        d["calibration"] = dataclasses.asdict(self.calibration)
        if self.eval is not None:
            d["eval"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.eval.items()}
        d["output"] = self.output
        for key in run_options.recipe_keys():
            value = getattr(self.run, key)
            if value is not None:
                d[key] = list(value) if isinstance(value, tuple) else value
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def _bad(path: str, value, allowed: str) -> QuantkitError:
    return QuantkitError(f"{path}: {value!r} is not allowed; use {allowed}.")


def _check(path: str, value, kind: Kind):
    if not kind[0](value):
        raise _bad(path, value, kind[1])
    return value


def _mapping(path: str, value, allowed) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(path, value, f"a mapping of {', '.join(allowed)}")
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise QuantkitError(f"{path}: unknown key {unknown[0]!r}; allowed keys are {', '.join(allowed)}.")
    return value


def _options(path: str, value, table: dict[str, tuple[object, Kind]]) -> dict:
    given = _mapping(path, value, table)
    return {k: _check(f"{path}.{k}", given.get(k, default), kind) for k, (default, kind) in table.items()}


def _args(path: str, value, table: dict[str, Kind]) -> dict:
    return {k: _check(f"{path}.{k}", v, table[k]) for k, v in _mapping(path, value, table).items()}


def _targets(path: str, value) -> tuple[str, ...]:
    targets = (value,) if isinstance(value, str) else value
    if not isinstance(targets, (list, tuple)) or not targets:
        raise _bad(path, value, "a regex such as 're:.*down_proj$' or a list of them")
    for t in targets:
        if not isinstance(t, str) or not t.startswith("re:"):
            raise _bad(path, t, "a regex over module names, written 're:PATTERN' (e.g. 're:.*down_proj$')")
        try:
            re.compile(t[3:])
        except re.error as e:
            raise QuantkitError(f"{path}: {t!r} is not a valid regex ({e}).") from None
    return tuple(targets)


def _override(path: str, value) -> Override:
    d = _mapping(path, value, ("targets", "ignore", *WEIGHT_ARGS))
    if "targets" not in d:
        raise QuantkitError(f"{path}: targets is missing; name the modules with a regex such as 're:.*down_proj$'.")
    ignore = _check(f"{path}.ignore", d.get("ignore", False), BOOL)
    args = _args(path, {k: v for k, v in d.items() if k not in ("targets", "ignore")}, WEIGHT_ARGS)
    if ignore == bool(args):
        raise QuantkitError(f"{path}: give either weight args ({', '.join(WEIGHT_ARGS)}) or ignore: true.")
    return Override(_targets(f"{path}.targets", d["targets"]), ignore, args)


def _scheme(value) -> SchemeSpec:
    d = (
        {"preset": value}
        if isinstance(value, str)
        else _mapping("scheme", value, ("preset", *WEIGHT_ARGS, "input_activations", "ignore", "overrides"))
    )
    name = d.get("preset")
    if name is not None and (not isinstance(name, str) or name not in PRESETS):
        raise QuantkitError(f"scheme: unknown scheme {name!r}; use one of: {', '.join(PRESETS)}.")
    ignore = d.get("ignore")
    if ignore is not None and not (isinstance(ignore, list) and all(isinstance(i, str) for i in ignore)):
        raise _bad("scheme.ignore", ignore, "a list of module names or 're:' regexes")
    overrides = d.get("overrides") or []
    if not isinstance(overrides, list):
        raise _bad("scheme.overrides", overrides, "a list of {targets: 're:...', <weight args> or ignore: true}")
    acts = d.get("input_activations")
    return SchemeSpec(
        name,
        _args("scheme", {k: v for k, v in d.items() if k in WEIGHT_ARGS}, WEIGHT_ARGS),
        None if acts is None else _args("scheme.input_activations", acts, ACTIVATION_ARGS),
        None if ignore is None else tuple(ignore),
        tuple(_override(f"scheme.overrides[{i}]", o) for i, o in enumerate(overrides)),
    )


def _scheme_dict(s: SchemeSpec):
    d = ({"preset": s.preset} if s.preset else {}) | s.weights
    if s.input_activations is not None:
        d["input_activations"] = dict(s.input_activations)
    if s.ignore is not None:
        d["ignore"] = list(s.ignore)
    if s.overrides:
        d["overrides"] = [
            {"targets": list(o.targets)} | ({"ignore": True} if o.ignore else o.args) for o in s.overrides
        ]
    return d["preset"] if list(d) == ["preset"] else d


def _merge(path: str, base: QuantArgs | None, changes: dict) -> QuantArgs:
    changes = {k: v for k, v in changes.items() if not (k == "group_size" and v == "auto")}
    d = dataclasses.asdict(base or QuantArgs()) | changes
    if d["strategy"] not in ("group", "tensor_group") and "group_size" not in changes:
        d["group_size"] = None
    try:
        return QuantArgs(**d)
    except QuantkitError as e:
        raise QuantkitError(f"{path}: {e}") from None


def build_scheme(spec: SchemeSpec, kv: QuantArgs | None = None) -> QuantScheme:
    """The QuantScheme a recipe's scheme section means (plus the kv step's KV-cache args)."""
    base = preset(spec.preset) if spec.preset else QuantScheme("custom", QuantArgs())
    weights = _merge("scheme", base.weights, spec.weights)
    acts = (
        base.input_activations
        if spec.input_activations is None
        else _merge("scheme.input_activations", base.input_activations, spec.input_activations)
    )
    ignore = base.ignore if spec.ignore is None else spec.ignore
    auto = spec.weights.get("group_size", "auto") == "auto"  # unless a number is given
    overrides = tuple(
        QuantScheme(
            f"override_{i}",
            _merge(f"scheme.overrides[{i}]", weights, o.args),
            acts,
            o.targets,
            ignore=(),
            auto_group_size=o.args.get("group_size", "auto" if auto else None) == "auto",
        )
        for i, o in enumerate(spec.overrides)
        if not o.ignore
    )
    ignore += tuple(t for o in spec.overrides if o.ignore for t in o.targets)
    return QuantScheme(base.name, weights, acts, ignore=ignore, kv_cache=kv, overrides=overrides, auto_group_size=auto)


def _step(path: str, value) -> Step:
    d = {value: None} if isinstance(value, str) else value
    name = next(iter(d)) if isinstance(d, dict) and len(d) == 1 else value
    table = _step_options()
    if not isinstance(name, str) or name not in table:
        raise _bad(path, name, f"one of {', '.join(table)}, alone or with its options ({{awq: {{grid: 20}}}})")
    return Step(name, _options(f"{path}.{name}", d[name], table[name]))


def _steps(value) -> tuple[Step, ...]:
    """Transforms (smooth), then one weight step, then optionally kv; or kv alone."""
    if not isinstance(value, list) or not value:
        raise _bad("steps", value, f"a list of steps ({', '.join(METHODS)}), e.g. [awq] or [gptq, kv]")
    steps = tuple(_step(f"steps[{i}]", s) for i, s in enumerate(value))
    roles = "".join({"transform": "t", "weights": "w", "kv": "k"}[METHODS[s.name].role] for s in steps)
    if not re.fullmatch(r"t*wk?|k", roles):
        raise QuantkitError(
            f"steps: [{', '.join(s.name for s in steps)}] cannot run; a recipe has one weight step "
            f"({', '.join(weight_methods())}), optionally after {' or '.join(_transforms())} and before kv, "
            "or kv alone."
        )
    return steps


def _check_fit(steps: tuple[Step, ...], spec: SchemeSpec | None) -> None:
    from quantkit.pipeline.quantize import check_method

    *transforms, weights = [s for s in steps if s.name != "kv"] or [None]
    if weights is None:
        if spec is not None:
            raise QuantkitError("scheme: a recipe whose only step is kv keeps the model's weights; drop scheme.")
        return
    method = METHODS[weights.name]
    if spec is None:
        raise QuantkitError(f"scheme is missing; the {method.name} step needs one, e.g. {method.default_scheme}.")
    check_method(method, build_scheme(spec), [(METHODS[t.name], t.options) for t in transforms], path="scheme")


def _eval(value) -> dict:
    gates = _options("eval", value, EVAL)
    if not gates["ppl"] and not gates["tasks"]:
        raise QuantkitError("eval: nothing to evaluate; give ppl (a text such as wiki) or tasks, or drop eval.")
    return gates | {"tasks": tuple(gates["tasks"])}


def from_dict(d) -> Recipe:
    """Validate a recipe mapping; a mistake is one sentence naming the key and what is allowed."""
    if not isinstance(d, dict):
        raise _bad("recipe", d, f"a mapping of {', '.join(_top())}")
    d = _mapping("recipe", d, _top())
    if not d.get("model"):
        raise QuantkitError("model is missing; name a built-in model, a local folder or a hub id.")
    steps = _steps(d.get("steps"))
    scheme = None if d.get("scheme") is None else _scheme(d["scheme"])
    _check_fit(steps, scheme)
    return Recipe(
        model=str(_check("model", d["model"], TEXT)),
        steps=steps,
        scheme=scheme,
        calibration=Calibration(**_options("calibration", d.get("calibration"), CALIBRATION)),
        eval=None if d.get("eval") is None else _eval(d["eval"]),
        output=None if d.get("output") is None else str(_check("output", d["output"], TEXT)),
        run=_run(d, steps),
    )


def _run(d: dict, steps: tuple[Step, ...]) -> run_options.RunOptions:
    """The recipe's run options: each checked by its kind, unless it has rules of its own."""
    own = {
        "max_shard_size": _shard_size,
        "target_bits": lambda v: _target_bits(v, steps),
        "target_formats": lambda v: _target_formats(v, d.get("target_bits")),
        "target_estimate": lambda v: _target_estimate(v, d.get("target_bits")),
    }
    table = _table(run_options.RunOptions)
    values = {}
    for key in run_options.recipe_keys():
        if key in own:
            values[key] = own[key](d.get(key, table[key][0]))
        elif key in d:
            values[key] = _check(key, d[key], table[key][1])
    return run_options.RunOptions(**values)


def _target_bits(value, steps) -> float | None:
    if value is None:
        return None
    _check("target_bits", value, (FRACTION[0], "a number of bits per weight, e.g. 4.5"))
    weights = [s.name for s in steps if METHODS[s.name].role == "weights"]
    if weights and not run_options.applies("target_bits", METHODS[weights[0]]):
        mixed = ", ".join(m for m in weight_methods() if run_options.applies("target_bits", METHODS[m]))
        raise _bad("target_bits", value, f"null with the {weights[0]} step (it mixes int4/int8/FP4 for {mixed})")
    return float(value)


def _target_formats(value, target_bits) -> tuple[str, ...] | None:
    from quantkit.pipeline.mixed import FORMATS, FORMATS_NEED_BITS, allowed_formats

    if value is None:
        return None
    if target_bits is None:
        raise QuantkitError(FORMATS_NEED_BITS)
    if not isinstance(value, (str, list)) or isinstance(value, list) and not all(isinstance(v, str) for v in value):
        raise _bad("target_formats", value, f"a list of formats: int4 (every group size), {', '.join(FORMATS)}")
    try:
        return allowed_formats(value)
    except QuantkitError as e:
        raise QuantkitError(f"target_formats: {e}") from None


def _target_estimate(value, target_bits) -> str | None:
    from quantkit.pipeline.mixed import ESTIMATORS

    if value is None:
        return None
    if value not in ESTIMATORS:
        raise _bad("target_estimate", value, " or ".join(ESTIMATORS))
    if target_bits is None:
        raise QuantkitError("target_estimate (--target-estimate) goes with target_bits (--target-bits); give both.")
    return value


def _shard_size(value) -> str:
    from quantkit.formats.checkpoint import parse_size

    try:
        parse_size(value)
    except QuantkitError:
        raise _bad("max_shard_size", value, "a size such as 5GB, 500MB or 2GiB") from None
    return str(value)


def _canonical(d: dict) -> dict:
    """The same recipe with shorthands spelled out (scheme: NAME, steps: [NAME]), so
    `--set scheme.group_size=64` and `--set steps.0.awq.grid=10` have somewhere to go."""
    d = copy.deepcopy(d)
    if isinstance(d.get("scheme"), str):
        d["scheme"] = {"preset": d["scheme"]}
    if isinstance(d.get("steps"), list):
        d["steps"] = [
            {s: {}}
            if isinstance(s, str)
            else {k: v if v is not None else {} for k, v in s.items()}
            if isinstance(s, dict)
            else s
            for s in d["steps"]
        ]
    return d


def apply_set(d: dict, assignment: str) -> dict:
    """A copy of the raw recipe `d` with `KEY.PATH=VALUE` applied (VALUE read as YAML, so
    4 is a number, true a bool, null removes a section; list entries by index: steps.0)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key or "" in key.split("."):
        raise QuantkitError(f"--set {assignment!r} needs the form key.path=value, e.g. calibration.samples=16.")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    d = _canonical(d)
    node, parts = d, key.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[:i]) or "the recipe"
        last = i == len(parts) - 1
        if isinstance(node, dict):
            if last:
                node[part] = value
            elif node.get(part) is None:
                node[part] = {}
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            if last:
                node[int(part)] = value
            node = node[int(part)]
        else:
            has = f"has {len(node)} entries" if isinstance(node, list) else f"is {node!r}"
            raise QuantkitError(f"--set {key}: {here} {has}, so it has no {part!r}.")
    return d


def load_recipe(path: str | Path, sets: tuple[str, ...] | list[str] = ()) -> Recipe:
    """Read and validate a recipe file, with `--set KEY.PATH=VALUE` overrides applied first."""
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"recipe {path} does not exist; pass a .yaml file such as recipes/w4a16-awq.yaml.")
    try:
        d = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise QuantkitError(f"recipe {path} is not valid YAML ({where}{getattr(e, 'problem', e)}).") from None
    for assignment in sets if isinstance(d, dict) else ():
        d = apply_set(d, assignment)
    return from_dict(d)


def run_recipe(
    recipe: Recipe,
    output: str | Path | None = None,
    overwrite: bool = False,
    track: Track = no_progress,
    log: Callable[[str], None] | None = None,
    resume: bool = False,
) -> dict:
    """Carry out `recipe`, writing the checkpoint to `output` (default: the recipe's): the
    transforms, the weight step and a following kv step in one `quantize` call, a lone kv
    step through `add_kv_scales`. Eval gates run after the checkpoint is written; their
    report is returned as `provenance["gates"]` (`["failures"]` lists the failed ones).
    `resume` continues an interrupted run of the same recipe (see `quantize`). Returns the
    provenance, which records the recipe."""
    from quantkit.calibration.kv import kv_args
    from quantkit.pipeline.kv import add_kv_scales
    from quantkit.pipeline.quantize import quantize

    out = output if output is not None else recipe.output
    if out is None:
        raise QuantkitError("the recipe names no output folder; pass -o OUT or set output in the recipe.")
    recipe = recipe.replace(output=str(out))
    if recipe.eval is not None and recipe.eval["tasks"] and importlib.util.find_spec("lm_eval") is None:
        raise QuantkitError("eval.tasks needs lm-eval, which is not installed; install it or drop eval.tasks.")
    kv = next((kv_args(s.options["dtype"], s.options["per_head"]) for s in recipe.steps if s.name == "kv"), None)
    *transforms, weights = [s for s in recipe.steps if s.name != "kv"] or [None]
    if weights is None:
        if resume:
            raise QuantkitError("--resume continues weight quantization; a lone kv step runs in one go without it.")
        prov = add_kv_scales(recipe.model, kv, Path(out), recipe.calibration, overwrite, track, recipe=recipe.to_dict())
    else:
        prov = quantize(
            recipe.model,
            build_scheme(recipe.scheme, kv),
            Path(out),
            weights.name,
            recipe.calibration,
            dict(weights.options),
            overwrite,
            recipe.run.device,
            track,
            log,
            recipe=recipe.to_dict(),
            transforms=[(t.name, dict(t.options)) for t in transforms],
            resume=resume,
            max_shard_size=recipe.run.max_shard_size,
            target_bits=recipe.run.target_bits,
            target_formats=recipe.run.target_formats,
            target_estimate=recipe.run.target_estimate,
            lm_head=recipe.run.lm_head,
            tune_scales=recipe.run.tune_scales,
        )
    if recipe.eval is not None:
        from quantkit.eval.gates import evaluate_gates

        gates = {k: list(v) if isinstance(v, tuple) else v for k, v in recipe.eval.items()}
        prov = prov | {"gates": evaluate_gates(str(out), recipe.model, **gates, track=track)}
    return prov
