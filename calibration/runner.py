"""The layer-by-layer calibration runner shared by every algorithm.

It captures the inputs of decoder block 0 (and every block's keyword arguments: masks,
rotary tables) on the calibration samples, then for each
block in turn: moves it to the compute device, calls the algorithm's step (which
quantizes the block's linears in place, to their fake-quantized values), runs the
now-quantized block on its inputs and hands the outputs to the next block, so
quantization error propagates the way it will at inference. Only one block lives on
the device at a time; the rest of the model stays on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibration.method import Calibration
from quantkit.malloc import trim_freed_memory
from quantkit.models import moe
from quantkit.models.arch import ArchSpec, get_module
from quantkit.progress import Track, no_progress


@dataclass
class BlockInputs:
    """What one decoder block receives for each calibration batch."""

    hidden: list[torch.Tensor]  # per batch: [batch, seq, hidden]
    kwargs: list[dict]  # per batch: the block's keyword arguments (mask, rotary embeddings, ...)
    guides: dict[str, torch.Tensor] | None = None  # full linear name -> loss weights (calibration.guided)
    # the float block's linears' inputs as AWQ's search captures them (`hooks.mapping_inputs`), when
    # a caller runs AWQ on copies of one float block many times (mixed precision's sensitivity)
    captured: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def run(self, block: nn.Module) -> list[torch.Tensor]:
        """The block's outputs for every batch."""
        outs = []
        for h, kw in zip(self.hidden, self.kwargs):
            out = block(h, **kw)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return outs


class FloatStream:
    """The float model's hidden states between blocks (the targets' inputs): block `index`'s
    inputs per batch, or None before the first block. A streaming run saves it at each commit
    (`state`) and `--resume` restores it, so a resumed run is the uninterrupted one."""

    def __init__(self):
        self.index, self.hidden = None, None

    def inputs(self, index: int, quantized: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.index != index:
            return quantized
        return [h.to(q.device) for h, q in zip(self.hidden, quantized)]

    def advance(self, index: int, outputs: list[torch.Tensor]) -> None:
        self.index, self.hidden = index + 1, outputs

    def state(self) -> dict | None:
        return None if self.hidden is None else {"index": self.index, "hidden": [h.cpu() for h in self.hidden]}

    def restore(self, saved: dict) -> None:
        self.index, self.hidden = saved["index"], saved["hidden"]


# step(block_index, block_prefix, block, inputs): quantize the block in place.
# `inputs` is None when the algorithm needs no calibration data.
Step = Callable[[int, str, nn.Module, "BlockInputs | None"], None]


class _Captured(Exception):
    pass


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, spec: ArchSpec, samples: torch.Tensor, batch_size: int, device: torch.device
) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """Run the model on `samples` [n, seq] with every block stubbed out, and keep block 0's
    hidden states per batch and each block's keyword arguments per batch: the mask and
    rotary tables can differ by block (sliding-window layers, Gemma 3's two RoPE bases)."""
    blocks = get_module(model, spec.blocks)
    base = get_module(model, spec.blocks.rsplit(".", 1)[0])
    others = [m for m in base.children() if m is not blocks]
    hidden, kwargs = [], [[] for _ in blocks]

    def stub(i: int):
        def forward(*args, **kw):
            h = args[0] if args else kw.pop("hidden_states")
            if i == 0:
                hidden.append(h)
            kwargs[i].append(kw)
            if i == len(blocks) - 1:
                raise _Captured
            return h  # the block is not run: its successors only need their own arguments

        return forward

    for m in others:
        m.to(device)
    for i, block in enumerate(blocks):
        block.forward = stub(i)
    try:
        for batch in samples.split(batch_size):
            try:
                base(input_ids=batch.to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        for block in blocks:
            del block.forward
        for m in others:
            m.to("cpu")
    return hidden, kwargs


class InMemory:
    """Blocks that are already in memory and stay there: what `run_blocks` does by default.
    A streaming run passes its own (see `pipeline.quantize`): `load` reads a block's
    weights, `done` writes and releases them, and `start`/`hidden` resume a run."""

    start = 0  # the first block to run
    hidden = None  # block `start`'s inputs per batch, when they were saved; else captured

    def capture(self):
        """Context in which block 0's inputs are captured (the embeddings must be present)."""
        return contextlib.nullcontext()

    def load(self, index: int, block: nn.Module) -> None:
        pass

    def done(self, index: int, block: nn.Module, outputs: list[torch.Tensor] | None) -> None:
        pass


@torch.no_grad()
def run_blocks(
    model: nn.Module,
    spec: ArchSpec,
    step: Step,
    samples: torch.Tensor | None = None,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    track: Track = no_progress,
    io: InMemory | None = None,
    min_expert_tokens: int = Calibration.min_expert_tokens,
    expert_tokens: dict[str, list[int]] | None = None,
    guides: dict[str, torch.Tensor] | None = None,
) -> None:
    """Call `step` on every decoder block in order, feeding each the previous block's
    quantized outputs. With `samples` None, steps get no inputs (e.g. RTN). `io` says
    where blocks come from and go to (default: the model in memory).

    In a sparse (mixture-of-experts) block the step sees every expert calibrated: the
    tokens routed to each expert are counted first (into `expert_tokens`, by block), and an
    expert routed fewer than `min_expert_tokens` runs on all tokens for its statistics while
    the block's output keeps the real routing (`moe.cover`). `guides` (the loss weights of
    `calibration.guided`) reach the steps as their inputs' `guides`."""
    device = torch.device(device)
    io = io or InMemory()
    blocks = get_module(model, spec.blocks)
    hidden = kwargs = None
    if samples is not None:
        with io.capture():
            hidden, kwargs = capture_block_inputs(model, spec, samples, batch_size, device)
        if io.hidden is not None:
            hidden = [h.to(device) for h in io.hidden]
    n = len(blocks)
    label = "blocks" if io.start == 0 else f"blocks (resumed at {io.start + 1}/{n})"
    for i in track(range(io.start, n), label, n - io.start):
        io.load(i, blocks[i])
        block = blocks[i].to(device)
        inputs = None if hidden is None else BlockInputs(hidden, kwargs[i], guides)
        prefix = f"{spec.blocks}.{i}"
        with moe.cover(block, spec, inputs, min_expert_tokens, {} if expert_tokens is None else expert_tokens, prefix):
            step(i, prefix, block, inputs)
        if inputs is not None:  # the last block too: KV-cache calibration observes this pass
            hidden = inputs.run(block)
        blocks[i].to("cpu")
        io.done(i, blocks[i], hidden)
        trim_freed_memory()  # the block's temporaries (see quantkit.malloc)
