"""The quantization pipeline: load the float model, run a method (after any transforms,
such as smoothing) block by block through the calibration runner, pack the result and
write the checkpoint. What a method needs and makes comes from its registry entry."""

from __future__ import annotations

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
from quantkit.calibration.guided import gradient_rows
from quantkit.calibration.method import Method, QParams
from quantkit.calibration.registry import METHODS, weight_methods
from quantkit.calibration.registry import method as method_entry
from quantkit.calibration.runner import run_blocks
from quantkit.errors import QuantkitError
from quantkit.formats import int_quantized
from quantkit.formats.checkpoint import SHARD_BYTES, check_disk, check_output, parse_size, read_tensors, write_in_place
from quantkit.formats.stored import entry_bytes, linear_bytes, pack_entry
from quantkit.models import kv_cache
from quantkit.models.arch import ArchSpec, arch_for, get_module
from quantkit.models.loading import load_float_model, load_weights, open_float_model, release_weights
from quantkit.pipeline.head import head_scheme, quantized_head
from quantkit.pipeline.mixed import ESTIMATORS, FORMATS_NEED_BITS, allowed_formats, for_target_bits, listing
from quantkit.pipeline.stream import BlockStream, PartialRun
from quantkit.primitives import check_group_size
from quantkit.progress import Track, no_progress
from quantkit.scheme import PRESETS, QuantScheme, fit_group_size, to_quantization_config
from quantkit.version import __version__

__all__ = ["Calibration", "quantize", "pack_model", "linear_schemes", "check_method"]


def linear_schemes(model: nn.Module, spec: ArchSpec, scheme: QuantScheme) -> dict[str, QuantScheme]:
    """Full name -> scheme (the scheme itself or the per-module override that matches) of
    every block linear the scheme quantizes, each resolved once, group sizes checked."""
    found = {}
    for i, block in enumerate(get_module(model, spec.blocks)):
        for name in spec.for_block(block).linears:
            full = f"{spec.blocks}.{i}.{name}"
            s = scheme.scheme_for(full)
            if s is None:
                continue
            if s.weights.strategy == "group":
                check_group_size(full, get_module(block, name).in_features, s.weights.group_size)
            found[full] = s
    return found


def pack_model(
    model: nn.Module, scheme: QuantScheme, results: dict[str, QParams], dtype: torch.dtype, release: bool = False
) -> dict:
    """The checkpoint's tensors: packed quantized linears, everything else in `dtype`. With
    `release` the model is spent: each quantized linear's float weight is dropped as soon as
    it is packed, so packing needs little memory beyond the packed tensors themselves."""
    schemes = {name: scheme.scheme_for(name) for name in results}
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {}
    for key in list(state):
        tensors.update(pack_entry(key, state.pop(key), schemes, results, dtype))
        if release and key.rsplit(".", 1)[0] in results:
            get_module(model, key.rsplit(".", 1)[0]).weight = None
    return tensors


def checkpoint_bytes(model: nn.Module, schemes: dict[str, QuantScheme], dtype: torch.dtype) -> int:
    """Bytes of tensors the checkpoint will hold, from the (empty) model's shapes: the linears
    in `schemes` each in its scheme's format, the rest in `dtype` (KV-cache scales, added while
    calibrating, left out)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return sum(entry_bytes(key, t, schemes, dtype) for key, t in state.items())


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


def check_scaled_together(model: nn.Module, spec: ArchSpec, schemes: dict[str, QuantScheme]) -> None:
    """AWQ and SmoothQuant fold one scale into the op before each mapping's linears and
    compensate only the quantized ones, and search it for one grid, so a mapping must be
    quantized whole or not at all, and with one set of weight args (`schemes`: those of the
    quantized linears)."""
    folding = listing([m.name for m in METHODS.values() if m.folds_scales], "or")
    for i, block in enumerate(get_module(model, spec.blocks)):
        for m in spec.for_block(block).awq:
            names = [f"{spec.blocks}.{i}.{n}" for n in m.linears]
            left_out = [n for n in names if n not in schemes]
            if left_out and len(left_out) < len(names):
                raise QuantkitError(
                    f"{left_out[0]} is ignored but shares the scales folded into "
                    f"{spec.blocks}.{i}.{m.prev} with {', '.join(m.linears)}; with {folding} "
                    "ignore all of them or none."
                )
            args = [schemes[n].weights for n in names if n in schemes]
            if any(a != args[0] for a in args):
                other = next(n for n, a in zip(names, args) if a != args[0])
                raise QuantkitError(
                    f"{other} gets other weight args than {names[0]} but shares the scales folded into "
                    f"{spec.blocks}.{i}.{m.prev} with it; with {folding} give a mapping's "
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
            owners = listing([m.name for m in METHODS.values() if m.actorder], "and")
            raise QuantkitError(
                f"{p}.actorder: {s.weights.actorder!r} is not allowed; use null with the "
                f"{method.name} step (act-order is {owners}'s)."
            )
        if method.name == "gptq" and s.format == "float-quantized" and s.weights.strategy != "block":
            raise QuantkitError(
                f"{p}: GPTQ makes fp8 weights only block-wise (fp8-block) or in MX groups (mxfp8); "
                "use quantkit fp8 for these."
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
    steps = [t.make_step(spec, scheme, o, results, dtype, log) for t, o in transforms if t.step]
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
    target_estimate: str | None = None,
    lm_head: str | None = None,
    tune_scales: int | None = None,
) -> dict:
    """Quantize `model_name` with `method` (a weight method of the registry: rtn, awq, gptq,
    fp8) and write the checkpoint to `out`. `options` are the method's (a dict or its
    options dataclass); `transforms` (name, options) run on each block first (smooth).
    `recipe` (the `quantkit run` recipe this call carries out) is recorded in the
    provenance. Returns the provenance it recorded.

    The model streams: each block's float weights are read from the model's files when
    its turn comes and released once its packed tensors are written (into shards of
    `max_shard_size` bytes), so memory holds one block, not the model. A run that was
    killed continues from its last finished block with `resume`.

    With `target_bits`, each fusion group gets its own format (int4 per group of 128, 64 or
    32, int8 per channel, or float) chosen from its measured sensitivity so the average bits
    per weight stay at most `target_bits` (`pipeline.mixed`), among `target_formats` when given
    (`mixed.allowed_formats`); the provenance records the choice. `lm_head` ("int8") quantizes the
    output projection too, untied from the input embeddings (`pipeline.head`). `tune_scales`
    (epochs) trains the written int scales end to end on the calibration rows before the
    checkpoint is completed (`calibration.tune`)."""
    run = _Run(model_name, method, options, transforms, calibration, out, overwrite, device, track, log)
    scheme = run.validate(scheme, max_shard_size, target_bits, target_formats, target_estimate)
    run.resolve(scheme, lm_head, target_bits, tune_scales)
    run.open_output(resume, target_bits, target_formats)
    try:
        run.check_disk()
        run.capture()
        run.calibrate_blocks()
        run.tune()
        return run.finish(recipe)
    except QuantkitError:
        if run.partial.started and run.partial.next_block == 0:  # refused before any block: leave nothing behind
            shutil.rmtree(run.partial.folder, ignore_errors=True)
        raise
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise QuantkitError(
                f"the disk under {run.out.parent} filled up while writing; free space and rerun with --resume."
            ) from None
        raise


class _Run:
    """One `quantize` call in named phases: `validate` (the arguments, and the mixed scheme
    of `--target-bits`), `resolve` (the model's architecture and the scheme of each linear,
    resolved once), `open_output` (the hidden output folder, or the interrupted run it
    resumes), `check_disk`, `capture` (the calibration text, and the loss gradients of
    guided Hessians), `calibrate_blocks`, `tune` (`--tune-scales`) and `finish` (provenance,
    and the checkpoint renamed into place)."""

    def __init__(self, model_name, method, options, transforms, calibration, out, overwrite, device, track, log):
        self.model_name, self.device, self.track, self.log = model_name, device, track, log
        self.method = m = method_entry(method)
        if m.role != "weights":
            raise QuantkitError(f"{method} does not quantize weights; use {listing(weight_methods(), 'or')}.")
        self.transforms = [(method_entry(name), _options(method_entry(name), o)) for name, o in transforms]
        self.options, self.out, self.overwrite = options, Path(out), overwrite
        self.calibration = calibration or Calibration()

    def validate(self, scheme: QuantScheme, max_shard_size, target_bits, target_formats, estimate=None) -> QuantScheme:
        """The scheme to quantize with (with `target_bits`, the mixed one chosen), once the
        arguments are checked against the method and the output folder."""
        m, log = self.method, self.log
        check_method(m, scheme, self.transforms)
        self.options = _options(m, self.options)
        self.max_shard_bytes = parse_size(max_shard_size)
        check_output(self.out, self.overwrite)
        self.start = time.perf_counter()
        if target_formats is not None and target_bits is None:
            raise QuantkitError(FORMATS_NEED_BITS)
        rewrites = [t.name for t, _ in self.transforms if t.reads]
        if target_bits is not None and rewrites:
            raise QuantkitError(
                f"--target-bits measures the sensitivity of the model before {rewrites[0]}; "
                f"drop one of {rewrites[0]} and --target-bits."
            )
        self.formats, self.mixed = None, None
        if target_bits is not None:
            self.formats = allowed_formats(target_formats)
            scheme, self.mixed = for_target_bits(
                self.model_name,
                m,
                self.options,
                scheme,
                self.calibration,
                target_bits,
                self.formats,
                self.track,
                log,
                estimate or ESTIMATORS[0],
            )
        return scheme

    def resolve(self, scheme: QuantScheme, lm_head: str | None = None, target_bits=None, tune_scales=None) -> None:
        """The model, built empty; its group sizes fitted; the scheme of each of its linears (and
        of the output projection with `lm_head`), checked against `tune_scales`; the runner step."""
        m, log = self.method, self.log
        self.model, self.tokenizer, self.source, self.weights, self.dtype = open_float_model(self.model_name, log)
        self.spec = spec = arch_for(self.model.config)
        self.rewritten = {}  # transform -> how it rewrote the float weights as they are read (rotate)
        for t, o in self.transforms:
            if t.reads:
                self.weights, self.rewritten[t.name] = t.make_reader(self.model, spec, self.weights, o)
        self.guided = getattr(self.options, "guided", 0)  # loss-guided Hessians: groups of output channels per linear
        if self.guided:
            from quantkit.calibration.guided import check_dense

            check_dense(spec, self.model_name)
        scheme = head_scheme(lm_head, scheme, spec.lm_head, target_bits)
        self.scheme = scheme = _fit_groups(self.model, spec, scheme, log)
        self.head = quantized_head(scheme, spec.lm_head)
        if log and spec.moe is not None and (note := vllm_moe_note(scheme)):
            log(note)
        self.schemes = linear_schemes(self.model, spec, scheme)  # group sizes checked before any work
        self.tune_epochs, self.tuned = tune_scales or 0, None
        if tune_scales:
            from quantkit.calibration.tune import check_memory, check_tunable

            check_tunable({**self.schemes, **({spec.lm_head: self.head} if self.head else {})})
            if self.device == "cpu":
                check_memory(sum(p.numel() for p in self.model.parameters()))
        if any(x.folds_scales for x in (m, *(t for t, _ in self.transforms))):
            check_scaled_together(self.model, spec, self.schemes)
        self.results: dict[str, QParams] = {}
        self.step = _make_step(m, self.options, self.transforms, spec, scheme, self.dtype, self.results, log)
        self.expert_tokens: dict[str, list[int]] = {}  # block -> tokens routed to each expert (sparse blocks)
        needs_data = m.needs_data(scheme, self.options) or any(t.needs_data(scheme, o) for t, o in self.transforms)
        self.calibrated = needs_data or scheme.kv_cache is not None or self.tune_epochs > 0  # reads calibration text

    def open_output(self, resume: bool, target_bits, target_formats) -> None:
        """The hidden folder the run writes into: a fresh one, or the one an interrupted run
        with the same arguments left (`resume`)."""
        args = (
            {
                "model": str(self.source),
                "model_files": {f.name: f.stat().st_size for f in sorted(Path(self.source).glob("*.safetensors"))},
                "method": self.method.name,
                "scheme": dataclasses.asdict(self.scheme),
                "options": dataclasses.asdict(self.options),
                "transforms": {t.name: dataclasses.asdict(o) for t, o in self.transforms},
                "calibration": dataclasses.asdict(self.calibration) if self.calibrated else None,
                "device": self.device,
                "max_shard_size": self.max_shard_bytes,
                "target_bits": target_bits,
            }
            | ({"tune_scales": self.tune_epochs} if self.tune_epochs else {})
            | ({"target_formats": list(self.formats)} if target_formats is not None else {})
        )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.partial = PartialRun(
            self.out, args, overwrite=self.overwrite, resume=resume, max_shard_bytes=self.max_shard_bytes, log=self.log
        )

    def check_disk(self) -> None:
        """Refuse to start when the rest of the checkpoint (plus one shard rewritten at the end,
        and the saved inputs of two blocks, or of every block for guided Hessians' backward
        pass; twice two with GPTQ's float targets, whose float stream is saved too) will not fit
        on the output's disk."""
        writer, model, c = self.partial.writer, self.model, self.calibration
        size = checkpoint_bytes(model, self.schemes, self.dtype)
        if self.head is not None:  # packed, and no longer tied
            size += linear_bytes(self.head.format, *model.get_output_embeddings().weight.shape, self.head.weights, 4)
        inputs = 0
        if self.calibrated:
            rows = 2 * c.samples  # the stream's saved inputs: two blocks'
            if self.guided > 0:  # the gradient pass (before the stream) keeps every block's, of its rows
                blocks = len(get_module(model, self.spec.blocks))
                rows = max(rows, blocks * gradient_rows(c.samples, self.options.guided_rows))
            rows += 2 * c.samples * bool(getattr(self.options, "float_targets", False))  # the float stream, beside
            inputs = rows * c.seq_len * model.config.get_text_config().hidden_size * 4
        need = max(0, size - writer.total_bytes) + min(size, writer.max_bytes) + inputs + (16 << 20)
        check_disk(self.partial.folder, need)

    def capture(self) -> None:
        """The calibration text (unless every block is done), the block stream (writing the
        tensors before the blocks on a fresh run), the loss gradients of guided Hessians, and
        what the steps carried when the run resumes."""
        run, c = self.partial, self.calibration
        self.samples, self.blocks = None, len(get_module(self.model, self.spec.blocks))
        if self.calibrated and run.next_block < self.blocks:
            self.samples = calibration_samples(
                self.tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed
            )
        if not run.started and self.log:
            self.log(f"resuming {self.out}: {run.next_block} of {self.blocks} blocks were done")
        self.io = BlockStream(
            self.model,
            self.spec,
            self.scheme.kv_cache,
            self.schemes,
            self.weights,
            self.dtype,
            self.results,
            run,
            lambda: {"steps": self.step.state(), "expert_tokens": dict(self.expert_tokens)},
        )
        self.guides = None
        if self.samples is not None and self.guided:
            with self.io.capture():
                self.guides = _loss_gradients(self, list(self.schemes))
        if run.step_state is not None:
            self.step.restore(run.step_state["steps"])
            self.expert_tokens.update(run.step_state["expert_tokens"])

    def calibrate_blocks(self) -> None:
        """Every block not done yet through the runner (K/V maxima recorded when the scheme
        quantizes the KV cache), then the tensors after the blocks."""
        step, spec, kv = self.step, self.spec, self.scheme.kv_cache
        block_step = step if kv is None else _observe_kv_after(step, spec)
        with kv_cache.record_kv_amax(self.model) if kv is not None else contextlib.nullcontext():
            if self.partial.next_block < self.blocks:
                c = self.calibration
                run_blocks(
                    self.model,
                    spec,
                    block_step,
                    self.samples,
                    c.batch_size,
                    self.device,
                    self.track,
                    self.io,
                    c.min_expert_tokens,
                    self.expert_tokens,
                    self.guides,
                )
        step.finish()
        if not self.partial.tail_written:
            self.io.write_tail(self.head)

    def tune(self) -> None:
        """`--tune-scales`: the written shards' int scales trained end to end against the float
        model (`calibration.tune`), then written over the old ones in place. The trained scales
        are saved in the run's folder first, so a run killed while they are written resumes
        by writing them again."""
        if not self.tune_epochs:
            return
        from quantkit.calibration import tune

        folder = self.partial.folder
        self.partial.writer.finish()
        saved = folder / tune.SAVED
        if not saved.is_file():
            teacher = load_float_model(self.source, torch.float32)[0].to(self.device)
            args = {n: s.weights for n, s in self.schemes.items()}
            if self.head is not None:
                args[self.spec.lm_head] = self.head.weights
            student, linears = tune.quantized_student(teacher, read_tensors(folder), args)
            c = self.calibration
            rows = calibration_samples(self.tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
            scales, first, last = tune.tune_scales(
                teacher, student, linears, rows.to(self.device), self.tune_epochs, tune.LR, c.seed, self.track
            )
            tune.save(saved, scales, first, last)
        scales, self.tuned = tune.load(saved)
        write_in_place(folder, {f"{n}.weight_scale": t for n, t in scales.items()})

    def finish(self, recipe: dict | None) -> dict:
        """Record the provenance and complete the checkpoint; returns the provenance."""
        scheme, kv, options = self.scheme, self.scheme.kv_cache, self.options
        provenance = {
            "quantkit_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": str(self.model_name),
            "algorithm": self.method.name,
            "scheme": scheme.name,
            "weights": dataclasses.asdict(scheme.weights),
            "input_activations": dataclasses.asdict(scheme.input_activations) if scheme.input_activations else None,
            "kv_cache": dataclasses.asdict(kv) if kv else None,
            "calibration": self.partial.args["calibration"],
            "options": dataclasses.asdict(options),
            "transforms": {t.name: dataclasses.asdict(o) | self.rewritten.get(t.name, {}) for t, o in self.transforms},
            "quantized_linears": len(self.schemes),
            **({"mixed_precision": self.mixed} if self.mixed else {}),
            **({"expert_tokens": self.expert_tokens} if self.expert_tokens else {}),
            **({"tune_scales": self.tuned} if self.tuned else {}),
            "wall_time_s": round(time.perf_counter() - self.start, 2),
            "resume_state": {"commits": self.partial.commits, "bytes": self.partial.saved_bytes},
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "recipe": recipe,
        }
        if not self.partial.started:
            provenance["resumed_at_block"] = self.io.start
        head = {self.spec.lm_head} if self.head is not None else set()
        config = checkpoint_config(self.model, scheme, set(self.schemes) | head, self.dtype)
        if head:
            config["tie_word_embeddings"] = False
        self.partial.complete(config, provenance, self.source)
        return provenance


def _loss_gradients(run: _Run, linears: list[str]):
    """`guided.loss_gradients` on the run's streaming model: each block's float weights read
    for its turn and released after; the output projection read from the files (the input
    embeddings' when tied); the blocks' inputs kept in the run's folder meanwhile."""
    from quantkit.calibration import guided

    model, spec, weights, dtype = run.model, run.spec, run.weights, run.dtype
    key = f"{spec.lm_head}.weight"
    if key not in weights:  # tied to the input embeddings
        embed = model.get_input_embeddings()
        key = next(f"{n}.weight" for n, m in model.named_modules() if m is embed)

    return guided.loss_gradients(
        model,
        spec,
        run.samples[: gradient_rows(len(run.samples), run.options.guided_rows)],
        run.guided,
        linears,
        run.calibration.batch_size,
        load=lambda module, prefix: load_weights(module, prefix, weights, dtype),
        release=release_weights,
        head_weight=lambda: weights.read([key])[key].to(dtype).float(),
        track=run.track,
        spill=run.partial.folder,
        device=run.device,
    )


def _fit_groups(model: nn.Module, spec: ArchSpec, scheme: QuantScheme, log) -> QuantScheme:
    """Resolve an automatic group size against the input widths of the linears it covers."""
    widths = {
        f"{spec.blocks}.{i}.{n}": get_module(block, n).in_features
        for i, block in enumerate(get_module(model, spec.blocks))
        for n in spec.for_block(block).linears
    }
    widths[spec.lm_head] = model.get_output_embeddings().in_features  # counts only where the head is quantized
    scheme, notes = fit_group_size(scheme, widths)
    for note in notes:
        if log:
            log(note)
    return scheme
