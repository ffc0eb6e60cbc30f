"""Mixed precision under a bit budget.

A *unit* is what gets one format: a fusion group of a block (q/k/v together, gate/up
together, each other linear; in a sparse block every expert's gate/up together and every
down together), which keeps each AWQ mapping on one scheme and lets vLLM fuse what it fuses.

`sensitivity` measures, for every unit and every candidate format (for an int4 scheme int4
per group of 128, 64 or 32 with its symmetry; for a weight-only FP4 scheme, NVFP4A16 or
MXFP4A16, that format; and int8 per channel and float), the mean KL
divergence per token of the model's next-token distribution from the float model's when
only that unit is quantized in that format, on a few calibration windows: rounded to
nearest, or by the method that will quantize the model (AWQ, GPTQ), which runs on a copy
of the unit's block with every other linear left float, calibrated on the same windows
(AWQ's int8 costs are round-to-nearest's, `ROUNDED`: they choose as AWQ's do).
The method matters: AWQ removes much of each unit's rounding error, and unevenly, so the
costs it leaves rank the units differently from round-to-nearest's (with guided Hessians,
GPTQ's loss gradients come from one backward pass over the same windows). The result is
cached on disk by model, settings and estimator.

Two estimators. "exact" reruns the blocks from the unit's one onward from the float model's
cached inputs and takes the KL of the logits: a run of the model's tail per unit and format.
"fisher" (the default) runs only the unit's block: at the float model, where the KL is
least, KL(p ‖ p with the block's output h + δ) ≈ ½·δᵀFδ per token, F = E_y~p[g gᵀ] the
Fisher of the output distribution with respect to h, g = ∇_h log p(y|h); F is estimated
from `FISHER_DRAWS` labels drawn per token from the float model, the gradients at every
block's output coming from one backward pass (`calibration.guided.fisher_gradients`), and
the cost is ½·mean over tokens and draws of (g·δ)².

`choose` picks one candidate per unit minimising the summed costs (additive, the usual
assumption) with the average bits per weight of all units' linears (packed values, scales,
zero points and shape, as `quantkit inspect` counts them; float at the stored dtype's
width) at most the target: a multiple-choice knapsack, solved by dynamic programming.
`mixed_scheme` makes the choice a scheme with one override per format.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantkit.atomic import write_atomic
from quantkit.errors import QuantkitError
from quantkit.formats.stored import linear_bytes
from quantkit.progress import Track, no_progress
from quantkit.scheme import QuantArgs, QuantScheme

FLOAT = "float"
# what `candidates` offers, by name: int4 schemes the int4 groups, FP4 schemes their own format, both int8 and float
FORMATS = ("int4-g128", "int4-g64", "int4-g32", "nvfp4", "mxfp4", "int8", FLOAT)
FP4_CANDIDATES = {"tensor_group": "nvfp4", "group": "mxfp4"}  # a weight-only FP4 scheme's strategy -> its candidate
ESTIMATORS = ("fisher", "exact")  # how `sensitivity` measures a unit's cost; the first is the default
FISHER_DRAWS = 4  # labels drawn per token from the float model for the Fisher estimate
# settings the sensitivity puts in place of the method's own (those the method's options have):
# GPTQ without range search and refinement. On smollm2 (benchmarks/mixed_choice.py, wiki 16
# windows, docs/benchmarks.md "Accuracy features' cost, measured") it cut GPTQ's sensitivity from
# 430 to 163 CPU-s and `--target-bits` from 1.60x to 1.18x the uniform run, changing 9 of 120
# choices: ppl 22.0578 against 22.0067 with the method's own options (uniform: 22.2957).
# AWQ's clip search without its coordinate-descent rounds (`clip_rounds` 0) was tried and not
# shipped: with AWQ's scales searched once per unit (a trial, commit 0603841) `--target-bits` took 1.38x the
# uniform run, but its choice lost the whole gain over the uniform run (wiki 16 windows 22.0882
# against 22.0947; docs/benchmarks.md "AWQ's --target-bits, abridged"). AWQ's scale search on
# every third grid point and then between the best one's neighbours (`grid_stride` 3: 11 of 20)
# with one round of the clip search's coordinate descent chose every group as AWQ's own options
# did on smollm2 (120) and gemma3-270m (72), in 0.68x the CPU time on gemma3
# (benchmarks/sensitivity_choice.py, docs/benchmarks.md "AWQ's --target-bits under 1.5x its uniform run", 2026-12-07)
SENSITIVITY_CHEAPER: dict[str, object] = {"range_search": False, "refine": 0, "grid_stride": 3, "clip_rounds": 1}
# candidates the sensitivity measures by round-to-nearest instead of the method, by method: on
# smollm2 AWQ's int8 costs chose nothing differently from round-to-nearest's (w4a16-asym g64,
# 4.56275 bits: the same 120 choices, benchmarks/sensitivity_choice.py, 2026-12-06)
ROUNDED: dict[str, tuple[str, ...]] = {"awq": ("int8",)}
FORMATS_NEED_BITS = (  # the refusal of target_formats without target_bits (recipe and pipeline)
    "target_formats (--target-formats) goes with target_bits (--target-bits): "
    "it limits the formats mixed precision chooses from."
)


def listing(names: list[str], word: str) -> str:
    """ "a, b {word} c": names for a message."""
    return f"{', '.join(names[:-1])} {word} {names[-1]}" if len(names) > 1 else "".join(names)


def _int_methods(word: str) -> str:
    """The weight methods of the registry that make int4/int8 and FP4 weights (rtn, awq, gptq), for a message."""
    from quantkit.calibration.registry import METHODS

    return listing([m.name for m in METHODS.values() if m.role == "weights" and m.format == "pack-quantized"], word)


def allowed_formats(names) -> tuple[str, ...] | None:
    """The formats `names` (a list, or one comma-separated string) let `--target-bits` choose
    from, "int4" standing for every int4 group size; None (every format) for None."""
    if names is None:
        return None
    names = names.split(",") if isinstance(names, str) else list(names)
    picked = []
    for name in (str(n).strip() for n in names):
        if name == "int4":
            picked += [f for f in FORMATS if f.startswith("int4-")]
        elif name in FORMATS:
            picked.append(name)
        else:
            raise QuantkitError(
                f"{name!r} is not a format --target-bits chooses; use int4 (every group size) or {', '.join(FORMATS)}."
            )
    if all(f == FLOAT for f in picked):
        raise QuantkitError("the formats to choose from need at least one quantized format (e.g. int4 or int8).")
    return tuple(f for f in FORMATS if f in picked)


def candidates(scheme: QuantScheme) -> dict[str, QuantArgs | None]:
    """The formats a unit can get: for an int4 scheme int4 per group of 128 / 64 / 32 (the
    scheme's symmetry and act-order), for a weight-only FP4 scheme (nvfp4a16, mxfp4a16) its
    own format; then int8 per channel (symmetric, w8a16) and float."""
    w = scheme.weights
    fp4 = w is not None and w.is_fp4 and scheme.input_activations is None
    if not fp4 and (w is None or w.type != "int" or w.num_bits != 4):
        raise QuantkitError(
            f"--target-bits mixes int4 or weight-only FP4 schemes; {scheme.name!r} is not one "
            "(use w4a16, w4a16-asym, nvfp4a16 or mxfp4a16)."
        )
    int8 = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="channel", group_size=None, actorder=w.actorder)
    if fp4:
        return {FP4_CANDIDATES[w.strategy]: w, "int8": int8, FLOAT: None}

    def int4(group: int) -> QuantArgs:
        return dataclasses.replace(w, strategy="group", group_size=group)

    return {"int4-g128": int4(128), "int4-g64": int4(64), "int4-g32": int4(32), "int8": int8, FLOAT: None}


@dataclass(frozen=True)
class Unit:
    """One fusion group: its linears' full names and [out, in] shapes."""

    block: int
    linears: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]

    @property
    def params(self) -> int:
        return sum(o * i for o, i in self.shapes)

    @property
    def label(self) -> str:
        if len(self.linears) == 1:
            return self.linears[0]
        prefix = self.linears[0].rsplit(".", 1)[0]
        if len(self.linears) <= 4 and all(n.rsplit(".", 1)[0] == prefix for n in self.linears):
            return f"{prefix}.{'+'.join(n.rsplit('.', 1)[1] for n in self.linears)}"
        return f"{self.linears[0]} (+{len(self.linears) - 1} more)"

    def fits(self, args: QuantArgs | None) -> bool:
        return args is None or args.strategy != "group" or all(i % args.group_size == 0 for _, i in self.shapes)

    def bits(self, args: QuantArgs | None, float_bytes: int) -> float:
        """Bits per weight of the unit's linears in a format, as `quantkit inspect` counts them."""
        if args is None:
            return 8.0 * float_bytes
        args = dataclasses.replace(args, actorder=None)  # act-order indices were never counted: the choices stay
        fmt = QuantScheme("unit", args).format
        stored = sum(linear_bytes(fmt, o, i, args, float_bytes) for o, i in self.shapes)
        return 8 * stored / self.params


def units(model, spec) -> list[Unit]:
    """The fusion groups of every block, in order (`ArchSpec.stages`: one per pass)."""
    from quantkit.models.arch import get_module

    found = []
    for i, block in enumerate(get_module(model, spec.blocks)):
        for stage in spec.for_block(block).stages:
            names = [n for group in stage for n in group]
            mods = [get_module(block, n) for n in names]
            shapes = tuple((m.out_features, m.in_features) for m in mods)
            found.append(Unit(i, tuple(f"{spec.blocks}.{i}.{n}" for n in names), shapes))
    return found


def sensitivity(
    model_name: str,
    scheme: QuantScheme,
    calibration,
    track: Track = no_progress,
    log: Callable[[str], None] | None = None,
    cache: Path | None = None,
    method: str = "rtn",
    options=None,
    estimator: str = ESTIMATORS[0],
) -> dict:
    """Per unit and candidate: the mean KL(float ‖ that unit alone quantized to the candidate
    by `method`, with its `options`, default the method's) per token, in nats, on
    `calibration`'s windows (see the module's docstring): measured by running the model to
    its logits (`estimator` "exact") or estimated to second order from the unit's block alone
    ("fisher"). Returns {"model", "scheme", "method", "estimator", "calibration",
    "float_bytes", "units": [{"label", "block", "linears", "params", "kld": {candidate: nats},
    "bits": {candidate: bits per weight}}]}; a candidate a unit's widths do not fit is left
    out. Cached in `cache` (default: quantkit's cache)."""
    from quantkit.calibration.registry import method as method_entry
    from quantkit.models.loading import resolve_model

    if estimator not in ESTIMATORS:
        raise QuantkitError(f"the sensitivity estimator is one of {', '.join(ESTIMATORS)}, not {estimator!r}.")
    m = method_entry(method)
    if m.format != "pack-quantized":
        raise QuantkitError(f"sensitivity measures int4/int8/FP4 weight formats by {_int_methods('or')}, not {method}.")
    options = _search_options(options if options is not None else m.options())
    path = resolve_model(model_name)
    key = _cache_key(path, scheme, calibration, method, options, estimator)
    file = (cache or _cache_dir()) / f"{key}.json"
    if file.is_file():
        if log:
            log(f"sensitivity of {model_name} from the cache ({file})")
        return json.loads(file.read_text())
    result = _measure(path, scheme, calibration, track, m, options, estimator)
    result["model"] = str(model_name)
    write_atomic(file, json.dumps(result))
    return result


def _cache_dir() -> Path:
    from quantkit import assets

    return assets.cache_dir() / "sensitivity"


def _search_options(options):
    """The method's options without those that read or write a saved search (each unit's
    measurement searches afresh) and with `SENSITIVITY_CHEAPER`'s settings where it has them."""
    names = {f.name for f in dataclasses.fields(options)}
    cheaper = {n: v for n, v in SENSITIVITY_CHEAPER.items() if n in names}
    return dataclasses.replace(options, **{n: None for n in ("save_search", "load_search") if n in names}, **cheaper)


def _cache_key(path: Path, scheme: QuantScheme, calibration, method: str, options, estimator: str) -> str:
    files = {f.name: f.stat().st_size for f in sorted(Path(path).glob("*.safetensors"))}
    what = {
        "model": str(Path(path).resolve()),
        "files": files,
        "candidates": {k: v and dataclasses.asdict(v) for k, v in candidates(scheme).items()},
        "calibration": dataclasses.asdict(calibration),
        "method": method,
        # guided off leaves it and its gradients' rows out: costs measured before they existed stay valid
        "options": {k: v for k, v in dataclasses.asdict(options).items() if k not in _unguided(options)},
        "estimator": estimator,
        **({"draws": FISHER_DRAWS} if estimator == "fisher" else {}),
        # 3: KL without the cancellation of Σ p log p - Σ p log q; 4: GPTQ refines its rounding;
        # 5: the estimator is in the result (and the key); 6: AWQ's int8 by round-to-nearest;
        # 7: the symmetric int searches try the full-range grid
        "version": 7,
        **({"rounded": list(ROUNDED[method])} if ROUNDED.get(method) else {}),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _unguided(options) -> set[str]:
    return set() if getattr(options, "guided", 0) else {"guided", "guided_rows"}


def _measure(path: Path, scheme: QuantScheme, calibration, track: Track, method, options, estimator: str) -> dict:
    import torch

    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.calibration.registry import METHODS
    from quantkit.calibration.runner import BlockInputs, capture_block_inputs
    from quantkit.models.arch import arch_for, get_module
    from quantkit.models.loading import load_float_model

    model, tokenizer, _ = load_float_model(path, owned=True)
    dtype = model.dtype  # the scales' dtype in the checkpoint, as the method rounds them
    float_bytes = dtype.itemsize
    model.float()
    spec = arch_for(model.config)
    c = calibration
    samples = calibration_samples(tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
    found = units(model, spec)
    guides = _guides(model, spec, path, samples, options, found, c.batch_size)
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, spec, samples, c.batch_size, torch.device("cpu"))
        inputs = [hidden]  # inputs[i]: block i's inputs per batch, from the float model
        for i, block in enumerate(get_module(model, spec.blocks)):
            inputs.append(BlockInputs(inputs[i], kwargs[i]).run(block))
    if estimator == "exact":
        cost = _exact_cost(model, spec, inputs, kwargs)
    else:
        cost = _fisher_cost(model, spec, samples, calibration, inputs, track)
    cands = candidates(scheme)
    from quantkit.pipeline import variants as made

    variants = made.shared if method.name in made.SHARED else made.alone
    rounded = ROUNDED.get(method.name, ())  # those candidates by round-to-nearest
    costs, n = {}, len(get_module(model, spec.blocks))
    for i in track(range(n), "sensitivity (blocks)", n):
        mine = [u for u in found if u.block == i]
        wanted = [{n: a for n, a in cands.items() if a is not None and u.fits(a)} for u in mine]
        by_method = [{n: a for n, a in w.items() if n not in rounded} for w in wanted]
        by_rtn = [{n: a for n, a in w.items() if n in rounded} for w in wanted]
        step = variants(model, spec, scheme, method, options, dtype, i, mine, by_method, inputs, kwargs, guides)
        if any(by_rtn):
            rtn = made.shared(model, spec, scheme, METHODS["rtn"], None, dtype, i, mine, by_rtn, inputs, kwargs, None)
            step = itertools.chain(step, rtn)
        with torch.no_grad():  # the variants are made as the loop asks for them
            for unit, name, outs in step:
                costs.setdefault(unit, {FLOAT: 0.0})[name] = cost(i, outs)
    rows = [_row(u, costs[u], {n: u.bits(a, float_bytes) for n, a in cands.items() if n in costs[u]}) for u in found]
    return {
        "scheme": scheme.name,
        "method": method.name,
        "estimator": estimator,
        "calibration": dataclasses.asdict(calibration),
        "float_bytes": float_bytes,
        "units": rows,
    }


def _exact_cost(model, spec, inputs, kwargs):
    """block index, its outputs per batch with one unit quantized -> the mean KL(float ‖ that
    model) per token, running the later blocks (float) to the logits."""
    import torch

    from quantkit.calibration.runner import BlockInputs
    from quantkit.eval.kld import divergence
    from quantkit.kernels.attention import twin as reference
    from quantkit.models.arch import get_module

    blocks = get_module(model, spec.blocks)
    final_norm, lm_head = get_module(model, spec.final_norm), get_module(model, spec.lm_head)
    softcap = getattr(model.config, "final_logit_softcapping", None)

    @torch.no_grad()
    def logits(hs):
        return [reference.cap(lm_head(final_norm(h)).float(), softcap) for h in hs]

    base = [x.log_softmax(-1) for x in logits(inputs[-1])]  # the float model's, once

    @torch.no_grad()
    def cost(i: int, h) -> float:  # Σ p (log p - log q): Σ p log p - Σ p log q lost ~3e-4 nats to cancellation
        for j in range(i + 1, len(blocks)):
            h = BlockInputs(h, kwargs[j]).run(blocks[j])
        return torch.cat([divergence(b, q).flatten() for b, q in zip(base, logits(h))]).mean().item()

    return cost


def _fisher_cost(model, spec, samples, calibration, inputs, track):
    """block index, its outputs per batch with one unit quantized -> ½·mean over tokens and
    draws of (g·δ)², δ the change of the block's output, g = ∇ log p(y|h) at the block's
    output for labels drawn from the float model (`guided.fisher_gradients`): the
    second-order estimate of the KL, ½·δᵀFδ with F the Fisher. Only the unit's block runs."""
    import torch

    from quantkit.calibration import guided

    c = calibration
    grads = guided.fisher_gradients(model, spec, samples, FISHER_DRAWS, c.seed, c.batch_size, track)

    def cost(i: int, outs) -> float:
        total, count = 0.0, 0
        for g, q, f in zip(grads[i], outs, inputs[i + 1]):  # g [draws, b, seq, hidden]; q, f [b, seq, hidden]
            total += torch.einsum("dbth,bth->dbt", g, q - f).square().sum().item()
            count += g[..., 0].numel()
        return 0.5 * total / count

    return cost


def _guides(model, spec, path, samples, options, found: list[Unit], batch_size: int):
    """The loss weights of guided Hessians on the same windows, when the options ask for them."""
    if not getattr(options, "guided", 0):
        return None
    from quantkit.calibration import guided

    guided.check_dense(spec, path)
    linears = [n for unit in found for n in unit.linears]
    rows = guided.gradient_rows(len(samples), options.guided_rows)
    return guided.loss_gradients(model, spec, samples[:rows], options.guided, linears, batch_size)


def _row(unit: Unit, kld: dict, bits: dict) -> dict:
    return {
        "label": unit.label,
        "block": unit.block,
        "linears": list(unit.linears),
        "params": unit.params,
        "kld": kld,
        "bits": bits,
    }


def check_budget(rows: list[dict], target_bits: float, formats: tuple[str, ...] | None = None) -> float:
    """The fewest bits the units (`sensitivity`'s rows, or `shape_rows`' before measuring) can
    take among `formats` (None: all); a `QuantkitError` when a unit can take none of them or
    `target_bits` is below that least."""
    total, least = sum(r["params"] for r in rows), 0.0
    for r in rows:
        offered = r["kld"] or r["bits"]  # the measured candidates; before measuring, all that fit
        bits = [r["bits"][c] for c in offered if c in (formats or offered)]
        if not bits:
            raise QuantkitError(
                f"none of the formats {', '.join(formats)} fits {r['label']} (it takes {', '.join(offered)}); "
                "allow one of those."
            )
        least += min(bits) * r["params"]
    if least > target_bits * total * (1 + 1e-9):
        raise QuantkitError(
            f"--target-bits {target_bits:g} is below what the smallest formats take "
            f"({least / total:.3f} bits per weight); ask for at least that."
        )
    return least


def shape_rows(model_name, scheme: QuantScheme) -> list[dict]:
    """Each unit's bits per weight in every candidate its widths fit (no "kld"), from the
    model's config.json alone (the family's shapes; no model is built): what `check_budget`
    needs before any sensitivity is measured."""
    import torch

    from quantkit.models.arch import arch_for, block_shapes, num_experts, sparse_layers
    from quantkit.models.loading import read_config, resolve_model

    config = read_config(resolve_model(model_name))
    spec = arch_for(config)
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    float_bytes = getattr(torch, dtype).itemsize
    cands, rows = candidates(scheme), []
    for i, sparse in enumerate(sparse_layers(config)):
        block = spec.sparse(num_experts(config)) if sparse else spec.replace(moe=None)
        shapes = block_shapes(spec, config, sparse)
        for stage in block.stages:
            names = [n for group in stage for n in group]
            unit = Unit(i, tuple(f"{spec.blocks}.{i}.{n}" for n in names), tuple(shapes[n] for n in names))
            rows.append(_row(unit, {}, {n: unit.bits(a, float_bytes) for n, a in cands.items() if unit.fits(a)}))
    return rows


def choose(
    rows: list[dict], target_bits: float, formats: tuple[str, ...] | None = None, resolution: int = 20000
) -> dict[str, str]:
    """label -> candidate for each unit (`sensitivity`'s rows), among `formats` (None: all, see
    `allowed_formats`), minimising the summed KL costs
    with the average bits per weight over all units at most `target_bits`: the multiple-choice
    knapsack, solved by dynamic programming over the bits left once every unit has its
    smallest format, cut into `resolution` steps. Each choice's extra bits are rounded up to
    a step, so the answer always fits; it is the best among the choices that still fit with
    one step per unit to spare."""
    import torch

    budget = target_bits * sum(r["params"] for r in rows)
    options = [
        [(c, r["kld"][c], r["bits"][c] * r["params"]) for c in r["kld"] if c in (formats or r["kld"])] for r in rows
    ]
    least = check_budget(rows, target_bits, formats)
    # bits above each unit's smallest format, against the budget left once every unit has that
    floor = [min(b for _, _, b in opts) for opts in options]
    spare = budget - least
    if spare <= 0:  # only the smallest formats fit: the cheapest of those per unit
        return {
            r["label"]: min((o for o in opts if o[2] == f), key=lambda o: o[1])[0]
            for r, opts, f in zip(rows, options, floor)
        }
    step = spare / resolution
    inf = float("inf")
    best = torch.zeros(resolution + 1, dtype=torch.float64)  # best[b]: least cost of the units so far within b steps
    picks, weights = [], []
    for opts, f in zip(options, floor):
        w = [math.ceil((bits - f) / step - 1e-9) for _, _, bits in opts]
        new = torch.full_like(best, inf)
        pick = torch.zeros(resolution + 1, dtype=torch.int64)
        for k, (_, cost, _) in enumerate(opts):
            if w[k] > resolution:
                continue
            shifted = torch.full_like(best, inf)
            shifted[w[k] :] = best[: resolution + 1 - w[k]] + cost
            better = shifted < new
            new = torch.where(better, shifted, new)
            pick = torch.where(better, torch.tensor(k), pick)
        best = new
        picks.append(pick)
        weights.append(w)
    choice, b = [], resolution
    for opts, pick, w in zip(reversed(options), reversed(picks), reversed(weights)):
        k = int(pick[b])
        choice.append(opts[k][0])
        b -= w[k]
    return {r["label"]: c for r, c in zip(rows, reversed(choice))}


def mixed_scheme(scheme: QuantScheme, rows: list[dict], choice: dict[str, str]) -> QuantScheme:
    """`scheme` with each unit's chosen format: one override per quantized format (targets:
    the unit's linears by name), float units in `ignore`. The format most weights get becomes
    the scheme's own, so the config lists the fewest names."""
    cands = candidates(scheme)
    members: dict[str, list[str]] = {}
    weights: dict[str, int] = {}
    for r in rows:
        c = choice[r["label"]]
        members.setdefault(c, []).extend(r["linears"])
        weights[c] = weights.get(c, 0) + r["params"]
    ints = [c for c in members if c != FLOAT]
    if not ints:
        raise QuantkitError("the choice keeps every layer in float; ask for fewer --target-bits.")
    main = max(ints, key=lambda c: weights[c])
    overrides = tuple(
        QuantScheme(f"{scheme.name}:{c}", cands[c], targets=tuple(members[c])) for c in cands if c in ints and c != main
    )
    ignore = scheme.ignore + tuple(members.get(FLOAT, ()))
    return scheme.replace(
        name=f"{scheme.name}-mixed", weights=cands[main], overrides=overrides, ignore=ignore, auto_group_size=False
    )


def achieved_bits(rows: list[dict], choice: dict[str, str]) -> float:
    """The average bits per weight of all units' linears under `choice`."""
    return sum(r["bits"][choice[r["label"]]] * r["params"] for r in rows) / sum(r["params"] for r in rows)


SENSITIVITY_WINDOWS = (8, 256)  # calibration rows × tokens that --target-bits measures sensitivity on


def for_target_bits(
    model_name, method, options, scheme: QuantScheme, calibration, target_bits, formats, track, log, estimator="fisher"
):
    """(the mixed scheme, what the provenance records of it) for `--target-bits`: the costs are
    measured with the method that quantizes the model (its registry entry, with `options`),
    by `estimator` (see `sensitivity`)."""
    if method.format != "pack-quantized":
        raise QuantkitError(
            f"--target-bits chooses int4/int8/FP4 formats for {_int_methods('and')}, not {method.name}."
        )
    if scheme.input_activations is not None:
        raise QuantkitError(
            f"--target-bits mixes weight-only formats; it does not take {scheme.name!r}, "
            "whose activations are quantized too."
        )
    if scheme.overrides:
        raise QuantkitError("--target-bits chooses the per-layer formats itself; drop the scheme's overrides.")
    check_budget(shape_rows(model_name, scheme), target_bits, formats)  # an impossible budget, before measuring
    rows_n, seq_len = SENSITIVITY_WINDOWS
    windows = dataclasses.replace(calibration, samples=rows_n, seq_len=seq_len)
    sens = sensitivity(
        model_name, scheme, windows, track, log, method=method.name, options=options, estimator=estimator
    )
    choice = choose(sens["units"], target_bits, formats)
    achieved = achieved_bits(sens["units"], choice)
    if log:
        counts = collections.Counter(choice.values())
        log(
            f"mixed precision at {achieved:.3f} bits per weight (target {target_bits:g}): "
            + ", ".join(f"{n} × {c}" for c, n in counts.items())
        )
    record = {
        "target_bits": target_bits,
        **({"formats": list(formats)} if formats is not None else {}),
        "bits_per_weight": achieved,
        "sensitivity": {k: sens[k] for k in ("calibration", "scheme", "method", "estimator")},
        "choice": choice,
        "kld_sum": sum(r["kld"][choice[r["label"]]] for r in sens["units"]),
    }
    return mixed_scheme(scheme, sens["units"], choice), record


def plot(result: dict, path) -> Path:
    """A PNG of every unit's KL cost per candidate format, block by block (log scale)."""
    from quantkit import figures

    rows = result["units"]
    fig = figures.figure(figsize=(12, 4.5))
    ax = fig.subplots()
    names = [c for c in dict.fromkeys(c for r in rows for c in r["kld"]) if c != FLOAT]
    for c in names:
        points = [(i, r["kld"][c]) for i, r in enumerate(rows) if c in r["kld"]]
        ax.plot([i for i, _ in points], [max(k, 1e-9) for _, k in points], marker=".", label=c)
    ax.set(yscale="log", xlabel="fusion group (in model order)", ylabel="mean KL per token (nats)")
    ax.set_title(f"sensitivity of {result['model']}: each group alone, quantized by {result.get('method', 'rtn')}")
    ax.legend()
    return figures.save(fig, path)
