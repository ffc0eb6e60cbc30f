"""The quantization pipeline: load the float model, run a method (after any transforms,
such as smoothing) block by block through the calibration runner, pack the result and
write the checkpoint. What a method needs and makes comes from its registry entry."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import resource
import shutil
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from quantkit.calibration.datasets import Calibration, calibration_samples, load_documents
from quantkit.calibration.method import Method, QParams
from quantkit.calibration.registry import METHODS
from quantkit.calibration.registry import method as method_entry
from quantkit.calibration.runner import InMemory, run_blocks
from quantkit.errors import QuantkitError
from quantkit.formats import float_quantized, int_quantized, pack_quantized
from quantkit.formats.checkpoint import SHARD_BYTES, check_disk, check_output, parse_size
from quantkit.models import kv_cache
from quantkit.models.arch import ArchSpec, arch_for, get_module
from quantkit.models.loading import load_weights, open_float_model, release_weights
from quantkit.perf.plan import linear_bytes
from quantkit.pipeline.stream import PartialRun
from quantkit.primitives import check_group_size
from quantkit.progress import Track, no_progress
from quantkit.scheme import PRESETS, QuantScheme, fit_group_size, to_quantization_config
from quantkit.version import __version__

__all__ = ["Calibration", "quantize", "pack_model", "quantized_linears", "check_method"]


def quantized_linears(model: nn.Module, spec: ArchSpec, scheme: QuantScheme) -> dict[str, nn.Linear]:
    """Full name -> module of every block linear the scheme quantizes, group sizes checked."""
    found = {}
    for i, block in enumerate(get_module(model, spec.blocks)):
        for name in spec.for_block(block).linears:
            full = f"{spec.blocks}.{i}.{name}"
            args = scheme.scheme_for(full)
            if args is None:
                continue
            linear = get_module(block, name)
            if args.weights.strategy == "group":
                check_group_size(full, linear.in_features, args.weights.group_size)
            found[full] = linear
    return found


def pack_model(
    model: nn.Module, scheme: QuantScheme, results: dict[str, QParams], dtype: torch.dtype, release: bool = False
) -> dict:
    """The checkpoint's tensors: packed quantized linears, everything else in `dtype`. With
    `release` the model is spent: each quantized linear's float weight is dropped as soon as
    it is packed, so packing needs little memory beyond the packed tensors themselves."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {}
    for key in list(state):
        tensors.update(pack_tensor(key, state.pop(key), scheme, results, dtype))
        if release and key.rsplit(".", 1)[0] in results:
            get_module(model, key.rsplit(".", 1)[0]).weight = None
    return tensors


def pack_tensor(key: str, t: torch.Tensor, scheme: QuantScheme, results: dict[str, QParams], dtype) -> dict:
    """What the checkpoint holds for the state entry `key`: a quantized linear's weight
    packed (its name's tensors), anything else in `dtype` (KV-cache scales stay fp32)."""
    module = key.rsplit(".", 1)[0]
    if module in results and key.endswith(".weight"):
        p, args = results[module], scheme.scheme_for(module).weights
        if scheme.format == "float-quantized":
            packed = float_quantized.compress(t, p.scale, args, p.input_scale)
        elif scheme.format == "int-quantized":
            packed = int_quantized.compress(t, p.scale, args)
        else:
            packed = pack_quantized.compress(t, p.scale, p.zero_point, args, p.g_idx)
        return {f"{module}.{k}": v for k, v in packed.items()}
    keep = not t.is_floating_point() or key.endswith("_scale")
    return {key: t if keep else t.to(dtype)}


def checkpoint_config(model: nn.Module, scheme: QuantScheme, quantized, dtype) -> dict:
    """config.json of the quantized model: the float config plus `quantization_config`
    (`quantized`: the names of the quantized linears). The ignore list names every linear
    left in float, and the routers of a mixture-of-experts model."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    linears += routers(model)
    ignore = tuple(n for n in linears if n not in quantized)
    config = model.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["quantization_config"] = to_quantization_config(scheme.replace(ignore=ignore))
    return config


def routers(model: nn.Module) -> list[str]:
    """The full names of the routers of a mixture-of-experts model (none in a dense one)."""
    spec = arch_for(model.config)
    blocks = get_module(model, spec.blocks)
    return [f"{spec.blocks}.{i}.{s.moe.router}" for i, b in enumerate(blocks) if (s := spec.for_block(b)).moe]


def vllm_moe_note(scheme: QuantScheme) -> str | None:
    """Why vLLM's fused-MoE kernels may refuse a mixture of experts quantized with `scheme`
    (their int4 path takes symmetric weights per group, without act-order groups), or None."""
    w = scheme.weights
    if w is None or w.type != "int":
        return None
    problems = [
        what
        for what, bad in (
            ("asymmetric weights", not w.symmetric),
            (f"per-{w.strategy} scales", w.strategy != "group"),
            ("act-order groups (g_idx)", w.actorder == "group"),
        )
        if bad
    ]
    if not problems:
        return None
    return (
        f"the experts get {' and '.join(problems)}: quantkit and transformers run that, but vLLM's fused-MoE "
        "int4 kernels take symmetric per-group weights without act-order groups (use w4a16 to serve it on vLLM)"
    )


def _observe_kv_after(step, spec: ArchSpec):
    """Record K/V maxima only in the runner's pass over the quantized block, not in the
    algorithm's own forwards."""

    def wrapped(index, prefix, block, inputs):
        state = getattr(get_module(block, spec.attention), kv_cache.STATE_ATTR)
        state.recording = False
        step(index, prefix, block, inputs)
        state.recording = True

    return wrapped


def check_scaled_together(model: nn.Module, spec: ArchSpec, scheme: QuantScheme, linears: list[str]) -> None:
    """AWQ and SmoothQuant fold one scale into the op before each mapping's linears and
    compensate only the quantized ones, and search it for one grid, so a mapping must be
    quantized whole or not at all, and with one set of weight args."""
    for i, block in enumerate(get_module(model, spec.blocks)):
        for m in spec.for_block(block).awq:
            names = [f"{spec.blocks}.{i}.{n}" for n in m.linears]
            left_out = [n for n in names if n not in linears]
            if left_out and len(left_out) < len(names):
                raise QuantkitError(
                    f"{left_out[0]} is ignored but shares the scales folded into "
                    f"{spec.blocks}.{i}.{m.prev} with {', '.join(m.linears)}; with awq or "
                    "smoothing ignore all of them or none."
                )
            args = [scheme.scheme_for(n).weights for n in names if n in linears]
            if any(a != args[0] for a in args):
                other = next(n for n, a in zip(names, args) if a != args[0])
                raise QuantkitError(
                    f"{other} gets other weight args than {names[0]} but shares the scales folded into "
                    f"{spec.blocks}.{i}.{m.prev} with it; with awq or smoothing give a mapping's "
                    f"linears ({', '.join(m.linears)}) one scheme."
                )


def check_method(
    method: Method, scheme: QuantScheme, transforms: list[tuple[Method, object]] = (), path: str | None = None
) -> None:
    """A `QuantkitError` when the scheme (or a per-module override) does not fit the weight
    method or a transform run before it; `path` (a recipe key) names where the mistake is."""
    where = path or "scheme"
    for p, s in [(where, scheme)] + [(f"{where}.overrides[{i}]", o) for i, o in enumerate(scheme.overrides)]:
        if s.weights is None or not method.makes(s.format):
            fits = " or ".join(name for name, ps in PRESETS.items() if ps.weights and method.makes(ps.format))
            makers = [m.name for m in METHODS.values() if m.role == "weights" and m.makes(s.format)]
            fits += f" (or {' or '.join(makers)} for {s.format})" if makers else ""
            raise QuantkitError(
                f"{p}: the {method.name} step cannot make {s.format} weights; use {fits}."
                if path
                else f"scheme {scheme.name!r} does not fit {method.name}; use {fits}."
            )
        if s.weights.actorder and not method.actorder:
            raise QuantkitError(
                f"{p}.actorder: {s.weights.actorder!r} is not allowed; use null with the "
                f"{method.name} step (act-order is GPTQ's)."
            )
        if s.format == "int-quantized" and (why := int_quantized.unsupported(s)):
            raise QuantkitError(f"{p}: {why}; use w8a8 (per-channel int8 weights, per-token int8 activations).")
    for t, _ in transforms:
        if method.name not in t.before:
            before = " or ".join([", ".join(t.before[:-1]), t.before[-1]] if len(t.before) > 1 else t.before)
            raise QuantkitError(f"steps: {t.name} runs before {before}, not before {method.name}.")
        if t.needs_activations and scheme.input_activations is None:
            fits = " or ".join(n for n, ps in PRESETS.items() if ps.input_activations and method.makes(ps.format))
            raise QuantkitError(
                f"{where}: {t.name} balances activation against weight quantization, but "
                f"{scheme.name!r} keeps activations in float; use {fits}."
            )


def _options(method: Method, options) -> object:
    """The method's options dataclass from a dict (or the dataclass itself)."""
    if isinstance(options, method.options):
        return options
    known = {f.name for f in dataclasses.fields(method.options)}
    unknown = [k for k in (options or {}) if k not in known]
    if unknown:
        raise QuantkitError(
            f"{method.name} has no option {unknown[0]!r}; its options are {', '.join(sorted(known)) or 'none'}."
        )
    return method.options(**{k: str(v) if isinstance(v, os.PathLike) else v for k, v in (options or {}).items()})


def _make_step(
    method: Method,
    options,
    transforms,
    spec: ArchSpec,
    scheme: QuantScheme,
    dtype,
    results: dict,
    log,
):
    """The runner step: each transform's step, then the method's (which quantizes each
    linear with its own scheme: the scheme's, or a per-module override's)."""
    steps = [t.make_step(spec, scheme, o, results, dtype, log) for t, o in transforms]
    steps.append(method.make_step(spec, scheme, options, results, dtype, log))

    def step(index, prefix, block, inputs):
        for s in steps:
            s(index, prefix, block, inputs)

    step.finish = lambda: [s.finish() for s in steps if hasattr(s, "finish")]
    # what steps carry from block to block (saved at each commit, restored by --resume)
    step.state = lambda: [s.state() if hasattr(s, "state") else None for s in steps]
    step.restore = lambda saved: [s.restore(x) for s, x in zip(steps, saved) if x is not None]
    return step


def quantize(
    model_name: str,
    scheme: QuantScheme,
    out: Path,
    method: str = "rtn",
    calibration: Calibration | None = None,
    options: dict | object | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    track: Track = no_progress,
    log: Callable[[str], None] | None = None,
    recipe: dict | None = None,
    transforms: list[tuple[str, dict | object]] = (),
    resume: bool = False,
    max_shard_size: int | str = SHARD_BYTES,
    target_bits: float | None = None,
    target_formats: tuple[str, ...] | None = None,
) -> dict:
    """Quantize `model_name` with `method` (rtn, awq, gptq, fp8; see the registry) and write
    the checkpoint to `out`. `options` are the method's (a dict or its options dataclass);
    `transforms` (name, options) run on each block first (smooth). `recipe` (the
    `quantkit run` recipe this call carries out) is recorded in the provenance. Returns the
    provenance it recorded.

    The model streams: each block's float weights are read from the model's files when
    its turn comes and released once its packed tensors are written (into shards of
    `max_shard_size` bytes), so memory holds one block, not the model. A run that was
    killed continues from its last finished block with `resume`.

    With `target_bits`, each fusion group gets its own format (int4 per group of 128, 64 or
    32, int8 per channel, or float) chosen from its measured sensitivity so the average bits
    per weight stay at most `target_bits` (`pipeline.mixed`), among `target_formats` when given
    (`mixed.allowed_formats`); the provenance records the choice."""
    m = method_entry(method)
    if m.role != "weights":
        raise QuantkitError(f"{method} does not quantize weights; use rtn, awq, gptq or fp8.")
    transforms = [(method_entry(name), _options(method_entry(name), o)) for name, o in transforms]
    check_method(m, scheme, transforms)
    options = _options(m, options)
    calibration = calibration or Calibration()
    max_shard_bytes = parse_size(max_shard_size)
    out = Path(out)
    check_output(out, overwrite)
    start = time.perf_counter()
    from quantkit.pipeline.mixed import FORMATS_NEED_BITS, allowed_formats

    mixed = None
    if target_formats is not None and target_bits is None:
        raise QuantkitError(FORMATS_NEED_BITS)
    if target_bits is not None:
        formats = allowed_formats(target_formats)
        scheme, mixed = _mixed_precision(model_name, m, options, scheme, calibration, target_bits, formats, track, log)
    model, tokenizer, source, weights, dtype = open_float_model(model_name, log)
    spec = arch_for(model.config)
    guided = getattr(options, "guided", 0)  # loss-guided Hessians: groups of output channels per linear
    if guided:
        from quantkit.calibration.guided import check_dense

        check_dense(spec, model_name)
    scheme = _fit_groups(model, spec, scheme, log)
    if log and spec.moe is not None and (note := vllm_moe_note(scheme)):
        log(note)
    linears = list(quantized_linears(model, spec, scheme))  # validates group sizes before any work
    if any(x.folds_scales for x in (m, *(t for t, _ in transforms))):
        check_scaled_together(model, spec, scheme, linears)
    results: dict[str, QParams] = {}
    kv = scheme.kv_cache
    step = _make_step(m, options, transforms, spec, scheme, dtype, results, log)
    expert_tokens: dict[str, list[int]] = {}  # block -> tokens routed to each expert (sparse blocks)

    def carried():  # what a resumed run needs of the blocks already done
        return {"steps": step.state(), "expert_tokens": dict(expert_tokens)}

    needs_data = m.needs_data(scheme, options) or any(t.needs_data(scheme, o) for t, o in transforms)
    args = {
        "model": str(source),
        "model_files": {f.name: f.stat().st_size for f in sorted(Path(source).glob("*.safetensors"))},
        "method": method,
        "scheme": dataclasses.asdict(scheme),
        "options": dataclasses.asdict(options),
        "transforms": {t.name: dataclasses.asdict(o) for t, o in transforms},
        "calibration": dataclasses.asdict(calibration) if needs_data or kv is not None else None,
        "device": device,
        "max_shard_size": max_shard_bytes,
        "target_bits": target_bits,
    } | ({"target_formats": list(formats)} if target_formats is not None else {})
    out.parent.mkdir(parents=True, exist_ok=True)
    run = PartialRun(out, args, overwrite=overwrite, resume=resume, max_shard_bytes=max_shard_bytes, log=log)
    try:
        _check_disk(run, model, spec, scheme, linears, dtype, calibration if args["calibration"] else None, guided > 0)
        samples, blocks = None, len(get_module(model, spec.blocks))
        if (needs_data or kv is not None) and run.next_block < blocks:
            c = calibration
            samples = calibration_samples(tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
        if not run.started and log:
            log(f"resuming {out}: {run.next_block} of {blocks} blocks were done")
        io = _Stream(model, spec, scheme, weights, dtype, results, run, carried)
        guides = None
        if samples is not None and guided:
            with io.capture():
                guides = _loss_gradients(
                    model, spec, weights, dtype, samples, guided, linears, calibration, track, run.folder, device
                )
        if run.step_state is not None:
            step.restore(run.step_state["steps"])
            expert_tokens.update(run.step_state["expert_tokens"])
        block_step = step if kv is None else _observe_kv_after(step, spec)
        with kv_cache.record_kv_amax(model) if kv is not None else contextlib.nullcontext():
            if run.next_block < blocks:
                run_blocks(
                    model,
                    spec,
                    block_step,
                    samples,
                    calibration.batch_size,
                    device,
                    track,
                    io,
                    calibration.min_expert_tokens,
                    expert_tokens,
                    guides,
                )
        step.finish()
        if not run.tail_written:
            io.write_tail()
        provenance = {
            "quantkit_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": str(model_name),
            "algorithm": method,
            "scheme": scheme.name,
            "weights": dataclasses.asdict(scheme.weights),
            "input_activations": dataclasses.asdict(scheme.input_activations) if scheme.input_activations else None,
            "kv_cache": dataclasses.asdict(kv) if kv else None,
            "calibration": args["calibration"],
            "options": dataclasses.asdict(options),
            "transforms": {t.name: dataclasses.asdict(o) for t, o in transforms},
            "quantized_linears": len(linears),
            **({"mixed_precision": mixed} if mixed else {}),
            **({"expert_tokens": expert_tokens} if expert_tokens else {}),
            "wall_time_s": round(time.perf_counter() - start, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "recipe": recipe,
        }
        if not run.started:
            provenance["resumed_at_block"] = io.start
        run.complete(checkpoint_config(model, scheme, set(linears), dtype), provenance, source)
    except QuantkitError:
        if run.started and run.next_block == 0:  # refused before any block: leave nothing behind
            shutil.rmtree(run.folder, ignore_errors=True)
        raise
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise QuantkitError(
                f"the disk under {out.parent} filled up while writing; free space and rerun with --resume."
            ) from None
        raise
    return provenance


SENSITIVITY_WINDOWS = (8, 256)  # calibration rows × tokens that --target-bits measures sensitivity on


def _mixed_precision(
    model_name, method: Method, options, scheme: QuantScheme, calibration, target_bits, formats, track, log
):
    """(the mixed scheme, what the provenance records of it) for `--target-bits`: the costs are
    measured with the method that quantizes the model (`mixed.sensitivity`)."""
    from quantkit.pipeline import mixed

    if method.format != "pack-quantized":
        raise QuantkitError(f"--target-bits chooses int4/int8 formats for rtn, awq and gptq, not {method.name}.")
    if scheme.format != "pack-quantized":
        raise QuantkitError(
            f"--target-bits mixes weight-only int4/int8 formats; it does not take {scheme.name!r}, "
            "whose activations are quantized too."
        )
    if scheme.overrides:
        raise QuantkitError("--target-bits chooses the per-layer formats itself; drop the scheme's overrides.")
    rows_n, seq_len = SENSITIVITY_WINDOWS
    windows = dataclasses.replace(calibration, samples=rows_n, seq_len=seq_len)
    sens = mixed.sensitivity(model_name, scheme, windows, track, log, method=method.name, options=options)
    choice = mixed.choose(sens["units"], target_bits, formats)
    achieved = mixed.achieved_bits(sens["units"], choice)
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
        "sensitivity": {"calibration": sens["calibration"], "scheme": sens["scheme"], "method": sens["method"]},
        "choice": choice,
        "kld_sum": sum(r["kld"][choice[r["label"]]] for r in sens["units"]),
    }
    return mixed.mixed_scheme(scheme, sens["units"], choice), record


def _loss_gradients(model, spec, weights, dtype, samples, groups, linears, calibration, track, folder, device):
    """`guided.loss_gradients` on the streaming model: each block's float weights read for
    its turn and released after; the output projection read from the files (the input
    embeddings' when tied); the blocks' inputs kept in the run's `folder` meanwhile."""
    from quantkit.calibration import guided

    key = f"{spec.lm_head}.weight"
    if key not in weights:  # tied to the input embeddings
        embed = model.get_input_embeddings()
        key = next(f"{n}.weight" for n, m in model.named_modules() if m is embed)

    return guided.loss_gradients(
        model,
        spec,
        samples,
        groups,
        linears,
        calibration.batch_size,
        load=lambda module, prefix: load_weights(module, prefix, weights, dtype),
        release=release_weights,
        head_weight=lambda: weights.read([key])[key].to(dtype).float(),
        track=track,
        spill=folder,
        device=device,
    )


class _Stream(InMemory):
    """How `run_blocks` gets and leaves each block in a streaming run: weights read from the
    model's files before the block, packed tensors written (and the run committed) after."""

    def __init__(self, model, spec, scheme, weights, dtype, results, run: PartialRun, carried):
        self.model, self.spec, self.scheme, self.weights = model, spec, scheme, weights
        self.dtype, self.results, self.run, self.carried = dtype, results, run, carried
        self.start, self.hidden = run.next_block, run.hidden
        keys = list(model.state_dict())
        if getattr(model.config, "tie_word_embeddings", False):
            keys.remove("lm_head.weight")
        inside = [k.startswith(spec.blocks + ".") for k in keys]
        first = inside.index(True)
        last = len(inside) - inside[::-1].index(True)
        self.head, self.tail = keys[:first], keys[last:]
        self.base_name = spec.blocks.rsplit(".", 1)[0]  # the decoder: blocks, embeddings, final norm
        self.blocks = get_module(model, spec.blocks)
        if run.started:
            self._copy(self.head)
            run.commit(0)

    def _copy(self, keys: list[str]) -> None:
        """Write tensors that calibration leaves alone, read one at a time in the model's dtype."""
        state = self.model.state_dict()
        for key in keys:
            t = self.weights.read([key])[key] if key in self.weights else state[key]
            for name, packed in pack_tensor(key, t, self.scheme, {}, self.dtype).items():
                self.run.writer.add(name, packed)

    @contextlib.contextmanager
    def capture(self):
        base = get_module(self.model, self.base_name)
        others = [(n, c) for n, c in base.named_children() if c is not self.blocks]
        for name, child in others:
            load_weights(child, f"{self.base_name}.{name}", self.weights, self.dtype)
        try:
            yield
        finally:
            for _, child in others:
                if any(True for _ in child.parameters()):
                    release_weights(child)

    def load(self, index: int, block: nn.Module) -> None:
        load_weights(block, f"{self.spec.blocks}.{index}", self.weights, self.dtype)

    def done(self, index: int, block: nn.Module, outputs) -> None:
        prefix = f"{self.spec.blocks}.{index}"
        if self.scheme.kv_cache is not None:
            kv_cache.store_layer_scales(get_module(block, self.spec.attention), self.scheme.kv_cache)
        for key, t in block.state_dict(prefix=prefix + ".").items():
            for name, packed in pack_tensor(key, t, self.scheme, self.results, self.dtype).items():
                self.run.writer.add(name, packed)
        for name in [n for n in self.results if n.startswith(prefix + ".")]:
            del self.results[name]
        release_weights(block)
        last = index + 1 == len(self.blocks)
        self.run.commit(index + 1, None if last else outputs, self.carried())

    def write_tail(self) -> None:
        self._copy(self.tail)
        self.run.commit(len(self.blocks), None, self.carried(), tail_written=True)


def _check_disk(run: PartialRun, model, spec, scheme, linears, dtype, calibration, guided=False) -> None:
    """Refuse to start when the rest of the checkpoint (plus one shard rewritten at the end,
    and the saved inputs of two blocks, or of every block for guided Hessians' backward pass)
    will not fit on the output's disk."""
    size = checkpoint_bytes(model, scheme, linears, dtype)
    inputs = 0
    if calibration is not None:
        kept = len(get_module(model, spec.blocks)) if guided else 2
        inputs = kept * calibration.samples * calibration.seq_len * model.config.get_text_config().hidden_size * 4
    need = max(0, size - run.writer.total_bytes) + min(size, run.writer.max_bytes) + inputs + (16 << 20)
    check_disk(run.folder, need)


def checkpoint_bytes(model: nn.Module, scheme: QuantScheme, linears: list[str], dtype: torch.dtype) -> int:
    """About how many bytes of tensors the checkpoint will hold, from the (empty) model's shapes."""
    quantized, total = set(linears), 0
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    for key, t in state.items():
        module = key.rsplit(".", 1)[0]
        if module in quantized and key.endswith(".weight"):
            s = scheme.scheme_for(module)
            static = s.input_activations is not None and not s.input_activations.dynamic
            total += linear_bytes(*t.shape, s.weights, static, float_bytes=dtype.itemsize)
        else:
            total += t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return int(total)


def _fit_groups(model: nn.Module, spec: ArchSpec, scheme: QuantScheme, log) -> QuantScheme:
    """Resolve an automatic group size against the input widths of the linears it covers."""
    widths = {
        f"{spec.blocks}.{i}.{n}": get_module(block, n).in_features
        for i, block in enumerate(get_module(model, spec.blocks))
        for n in spec.for_block(block).linears
    }
    scheme, notes = fit_group_size(scheme, widths)
    for note in notes:
        if log:
            log(note)
    return scheme
