"""A quantize run written to disk as it goes, and resumable after a crash.

The checkpoint's tensors go block by block into shards inside the hidden `.NAME.partial`
folder beside the output (see `formats.checkpoint.ShardWriter`). After a block the run
commits: the shards' data is fsynced, the inputs the next block receives (and any state a
step carries from block to block) are saved, and `quantkit-resume.json` is replaced
atomically. Those inputs are the calibration rows' hidden states (128 × 512 tokens of a
576-wide model: 151 MB a commit, more than smollm2's whole packed block), so a run commits
after a block only when `COMMIT_SECONDS` of calibration have passed since its last commit
(and after the last block): a crash loses at most that much work, and a model whose blocks
take longer commits after every one. A run killed at any moment restarts from its last commit, so it writes what an
uninterrupted run would, byte for byte (with the same torch and thread count: a GEMM split
over other threads can round differently, and a resume in another environment says so).
The folder is renamed into place only when the checkpoint is complete.

`BlockStream` is how the calibration runner gets and leaves each block in such a run: the
block's float weights read from the model's files before it, its packed tensors written
(and the run committed) after.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from quantkit.atomic import write_atomic
from quantkit.calibration.runner import InMemory
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import SHARD_BYTES, ShardWriter, complete
from quantkit.formats.stored import pack_entry
from quantkit.models import kv_cache
from quantkit.models.arch import get_module
from quantkit.models.loading import load_weights, release_weights
from quantkit.pipeline.head import head_qparams

STATE = "quantkit-resume.json"
COMMIT_SECONDS = 60.0  # calibration time between commits (0: after every block)


def _now() -> float:
    return time.monotonic()


def _inputs_file(block: int) -> str:
    return f"inputs-{block:05d}.pt"


def _flat(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def _differs(saved: dict, now: dict) -> str | None:
    """The first argument (dotted key) whose value differs, with both values."""
    a, b = _flat(saved), _flat(json.loads(json.dumps(now)))
    for key in [*a, *(k for k in b if k not in a)]:
        if a.get(key) != b.get(key):
            return f"{key} = {json.dumps(a.get(key))}, not {json.dumps(b.get(key))}"
    return None


def _environment() -> dict:
    """What float results depend on besides the arguments: same values, same bits."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads()}


class PartialRun:
    """The hidden folder one quantize run writes into. `args` (JSON-able) identify the run:
    `resume` continues a folder left by a run with the same args; without it an existing
    folder is refused, or with `overwrite` deleted."""

    def __init__(
        self,
        out: Path,
        args: dict,
        *,
        overwrite: bool = False,
        resume: bool = False,
        max_shard_bytes: int = SHARD_BYTES,
        log=None,
        commit_seconds: float | None = None,
    ):
        self.out, self.args = Path(out), args
        self.commit_seconds = COMMIT_SECONDS if commit_seconds is None else commit_seconds
        self.committed_at, self.commits, self.saved_bytes = _now(), 0, 0
        self.folder = self.out.parent / f".{self.out.name}.partial"
        state = None
        if self.folder.exists():
            if not resume and not overwrite:
                raise QuantkitError(
                    f"an interrupted run left {self.folder}; pass --resume to continue it or --overwrite to start over."
                )
            if resume and (self.folder / STATE).is_file():
                state = json.loads((self.folder / STATE).read_text())
                diff = _differs(state["args"], args)
                if diff:
                    raise QuantkitError(
                        f"--resume: the interrupted run in {self.folder} was started with {diff}; "
                        "rerun with its arguments or pass --overwrite to start over."
                    )
                then, now = state.get("environment"), _environment()
                if then != now and log:
                    log(
                        f"resuming with {now} where the interrupted run had {then}: float results can differ "
                        "in the last bits, so the checkpoint may not be byte-identical to an uninterrupted run"
                    )
        elif resume and log:
            log(f"nothing to resume in {self.folder}; starting from the first block")
        if state is None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True)
        self.writer = ShardWriter(self.folder, max_shard_bytes, state and state["writer"])
        self.next_block = state["next_block"] if state else 0
        self.tail_written = bool(state and state["tail_written"])
        self.started = state is None
        self.hidden, self.step_state = None, None
        for f in self.folder.glob("inputs-*.pt*"):
            if not state or f.name != state["inputs"]:
                f.unlink()
        if state and state["inputs"]:
            saved = torch.load(self.folder / state["inputs"], weights_only=True)
            self.hidden, self.step_state = saved["hidden"], saved["steps"]

    def commit(self, next_block: int, hidden=None, step_state=None, tail_written: bool = False) -> None:
        """Make everything written so far durable, with what block `next_block` receives and
        what the steps carry from block to block."""
        writer = self.writer.state()
        inputs = None
        if hidden is not None or step_state is not None:
            inputs = _inputs_file(next_block)
            tmp = self.folder / (inputs + ".tmp")
            saved = {"hidden": None if hidden is None else [h.cpu() for h in hidden], "steps": step_state}
            torch.save(saved, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            self.saved_bytes += tmp.stat().st_size
            os.replace(tmp, self.folder / inputs)
        state = {
            "args": self.args,
            "environment": _environment(),
            "next_block": next_block,
            "tail_written": tail_written,
            "inputs": inputs,
            "writer": writer,
        }
        write_atomic(self.folder / STATE, json.dumps(state), durable=True)
        for f in self.folder.glob("inputs-*.pt"):
            if f.name != inputs:
                f.unlink()
        self.next_block, self.tail_written = next_block, tail_written
        self.committed_at, self.commits = _now(), self.commits + 1

    def due(self) -> bool:
        """Whether `COMMIT_SECONDS` (the run's `commit_seconds`) have passed since the last commit."""
        return _now() - self.committed_at >= self.commit_seconds

    def complete(self, config: dict, provenance: dict, source: Path | None) -> Path:
        """Write the safetensors files and metadata, and rename the folder into place."""
        self.writer.finish()
        for f in [*self.folder.glob("inputs-*.pt*"), *self.folder.glob("tuned-*"), self.folder / STATE]:
            f.unlink(missing_ok=True)
        complete(self.folder, self.out, config, provenance, source)
        return self.out


class BlockStream(InMemory):
    """How `run_blocks` gets and leaves each block of the streaming `model` in the run `run`:
    weights read from the model's files (`weights`) before the block, packed tensors
    (`schemes`: module -> scheme, each in its format; `results`: the method's `QParams`)
    written in `dtype` and the run committed after, with what `carried()` returns of the
    steps' state."""

    def __init__(self, model, spec, kv, schemes, weights, dtype, results, run: PartialRun, carried):
        self.model, self.spec, self.kv, self.schemes = model, spec, kv, schemes
        self.weights, self.dtype, self.results, self.run, self.carried = weights, dtype, results, run, carried
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

    def _write(self, key: str, t: torch.Tensor, results: dict) -> None:
        for name, packed in pack_entry(key, t, self.schemes, results, self.dtype).items():
            self.run.writer.add(name, packed)

    def _copy(self, keys: list[str]) -> None:
        """Write tensors that calibration leaves alone, read one at a time in the model's dtype."""
        state = self.model.state_dict()
        for key in keys:
            self._write(key, self.weights.read([key])[key] if key in self.weights else state[key], {})

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
        if self.kv is not None:
            kv_cache.store_layer_scales(get_module(block, self.spec.attention), self.kv)
        for key, t in block.state_dict(prefix=prefix + ".").items():
            self._write(key, t, self.results)
        for name in [n for n in self.results if n.startswith(prefix + ".")]:
            del self.results[name]
        release_weights(block)
        last = index + 1 == len(self.blocks)
        if last or self.run.due():
            self.run.commit(index + 1, None if last else outputs, self.carried())

    def write_tail(self, head=None) -> None:
        """The tensors after the blocks, then the last commit. `head`: the output projection's own
        scheme (`pipeline.head`): its weight (the input embeddings' when tied) rounded to nearest
        and packed, in place of the float one."""
        if head is None:
            self._copy(self.tail)
        else:
            key = f"{self.spec.lm_head}.weight"
            self._copy([k for k in self.tail if k != key])
            embed = self.model.get_input_embeddings()
            source = (
                key if key in self.weights else next(f"{n}.weight" for n, m in self.model.named_modules() if m is embed)
            )
            w = self.weights.read([source])[source].to(self.dtype)
            qparams = {self.spec.lm_head: head_qparams(w, head, self.dtype)}
            for name, packed in pack_entry(key, w, {self.spec.lm_head: head}, qparams, self.dtype).items():
                self.run.writer.add(name, packed)
        self.run.commit(len(self.blocks), None, self.carried(), tail_written=True)
