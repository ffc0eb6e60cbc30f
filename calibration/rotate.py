"""Rotations fused into the weights (QuaRot, Ashkboos et al. 2024; SpinQuant's R1 and R2,
Liu et al. 2024): the model is rewritten into another float model with the same function
whose weights and activations have fewer outliers, before any method quantizes it.

- Residual stream (R1), an orthogonal Q [h, h]: every block reads x·Q and writes its outputs
  rotated. RMSNorm(x·Q) = RMSNorm(x)·Q once its weight n is folded into the linears that read
  it (‖x·Q‖ = ‖x‖), so: a linear W [out, h] reading a norm becomes W·diag(n)·Q (q/k/v, gate/up,
  the router and a shared expert's gate), a linear writing into the stream becomes Qᵀ·W
  (o_proj, every down projection; a bias b becomes b·Q), the embeddings E·Q, the LM head
  W·diag(n_final)·Q, and every norm's weight 1.
- Values (R2), an orthogonal H [d, d] per attention head: v_proj's rows of each KV head
  become Hᵀ·W_v (their bias b·H), o_proj's columns of each head W_o·H; the attention mixes
  rows of v, so its output per head is rotated by H and o_proj undoes it. q and k (and their
  per-head norms) are untouched.

A tied LM head cannot stay tied (E·Q is not (E·diag(n_final))·Q), so the checkpoint unties it:
`tie_word_embeddings` false and `lm_head.weight` written. Families whose norms act on the
blocks' outputs (Gemma 2 and 3's post-attention and post-feedforward norms) do not commute
with a rotation of the stream and are refused, as are norms that are not RMSNorms.

The pipeline applies this where the float weights are read (`RotatedWeights` wraps the
model's files), so capturing block 0's inputs, every method and the checkpoint see the
rotated model; the rotation depends only on the options (`rotation`), so --resume rewrites
the same weights."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.calibration.hadamard import hadamard
from quantkit.errors import QuantkitError
from quantkit.models.arch import ArchSpec, dimensions, get_module

KINDS = ("hadamard", "random-hadamard")


def rotation(kind: str, seed: int, hidden: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(Q [hidden, hidden], H [head_dim, head_dim], how each was built), fp64 and orthogonal:
    normalized Hadamard matrices (`hadamard.hadamard`), with `random-hadamard` each row's sign
    drawn from `seed` (QuaRot's randomized Hadamard)."""
    g = torch.Generator().manual_seed(seed)
    q, q_how = hadamard(hidden, g)
    h, h_how = hadamard(head_dim, g)
    if kind == "random-hadamard":
        q = torch.where(torch.rand(hidden, 1, generator=g, dtype=torch.float64) < 0.5, -q, q)
        h = torch.where(torch.rand(head_dim, 1, generator=g, dtype=torch.float64) < 0.5, -h, h)
        q_how, h_how = f"random signs · {q_how}", f"random signs · {h_how}"
    elif kind not in KINDS:
        raise QuantkitError(f"rotation {kind!r} is unknown; use {' or '.join(KINDS)}.")
    return q, h, {"kind": kind, "seed": seed, "hidden": f"{hidden}: {q_how}", "head": f"{head_dim}: {h_how}"}


def check_rotatable(model: nn.Module, spec: ArchSpec) -> None:
    """A `QuantkitError` naming the family and why when its rotation cannot be fused."""
    family = model.config.model_type
    if spec.post_attention_norm or spec.post_mlp_norm:
        raise QuantkitError(
            f"rotate cannot be fused into {family}: its post-attention and post-feedforward norms act on the "
            "blocks' outputs in the residual stream, which a rotation does not commute with; quantize it without "
            "rotate."
        )
    blocks = get_module(model, spec.blocks)
    norms = [(f"{spec.blocks}.{i}.{n}", get_module(b, n)) for i, b in enumerate(blocks) for n in _norms(spec)]
    for name, norm in norms + [(spec.final_norm, get_module(model, spec.final_norm))]:
        if not type(norm).__name__.endswith("RMSNorm") or getattr(norm, "bias", None) is not None:
            raise QuantkitError(
                f"rotate cannot be fused into {family}: {name} is a {type(norm).__name__}, not an RMSNorm, "
                "so it does not commute with a rotation; quantize it without rotate."
            )
    if spec.norm_offset:
        raise QuantkitError(f"rotate cannot be fused into {family}: its norms scale by (1 + w); not supported yet.")


def _norms(spec: ArchSpec) -> tuple[str, str]:
    return spec.input_norm, spec.pre_mlp_norm


def _plan(model: nn.Module, spec: ArchSpec) -> dict[str, tuple]:
    """Tensor name -> how it is rotated, from the family's AWQ mappings: a mapping from a norm
    names the linears (and float readers) that read the stream; one from a linear names the
    linears that write into it; the one from the attention's values is R2's."""
    dims = dimensions(model.config.to_dict())
    q_rows = dims["q"] + dims["kv"]
    keys = set(model.state_dict())
    final = f"{spec.final_norm}.weight"
    plan = {f"{spec.embed}.weight": ("embed",), final: ("norm",), f"{spec.lm_head}.weight": ("head", final)}
    for i, block in enumerate(get_module(model, spec.blocks)):
        b, prefix = spec.for_block(block), f"{spec.blocks}.{i}"
        for m in b.awq:
            if m.prev in _norms(b):
                norm = f"{prefix}.{m.prev}.weight"
                plan[norm] = ("norm",)
                plan |= {f"{prefix}.{n}.weight": ("in", norm, None) for n in m.linears + m.readers}
            else:
                plan |= {f"{prefix}.{n}.weight": ("out", False) for n in m.linears}
                plan |= {f"{prefix}.{n}.bias": ("out_bias",) for n in m.linears if f"{prefix}.{n}.bias" in keys}
        for m in b.awq:
            if m.prev.startswith(spec.attention + "."):  # values -> o_proj: R2
                start = q_rows if m.prev_rows == "v" else 0
                v = f"{prefix}.{m.prev}"
                plan[f"{v}.weight"] = plan[f"{v}.weight"][:2] + (start,)
                if f"{v}.bias" in keys:
                    plan[f"{v}.bias"] = ("v_bias", start)
                plan |= {f"{prefix}.{n}.weight": ("out", True) for n in m.linears}
        unknown = [f"{prefix}.{k}" for k, t in block.state_dict().items() if t.dim() > 1]
        unknown = [k for k in unknown if k not in plan]
        if unknown:
            raise QuantkitError(f"rotate does not know how {unknown[0]} reads or writes the residual stream.")
    return plan


class RotatedWeights:
    """The model's float weights (`weights`: `TensorFiles` or alike) served rotated by `q`
    (the stream) and `h` (the values of each head), as `plan` (`_plan`) says; each norm's
    weight is read once (kept for the linears that fold it) and served as ones. `tied_from`:
    the embeddings' name when the LM head was tied to them (it is served from them)."""

    def __init__(self, weights, plan: dict, q: torch.Tensor, h: torch.Tensor, head_key: str, tied_from: str | None):
        self.base, self.plan, self.q, self.h = weights, plan, q, h
        self.head_key, self.tied_from = head_key, tied_from
        self.names = set(weights) | {head_key}
        self.norms: dict[str, torch.Tensor] = {}
        self.embed = None  # the raw embeddings when the head is tied to them and `weights` reads once

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def _norm(self, key: str) -> torch.Tensor:
        if key not in self.norms:
            self.norms[key] = self.base.read([key])[key]
        return self.norms[key]

    def read(self, names) -> dict[str, torch.Tensor]:
        names = list(names)
        for n in names:  # norms first: their weights fold into the linears read with them
            op = self.plan.get(n, ("",))
            if op[0] == "norm":
                self._norm(n)
            elif op[0] in ("in", "head"):
                self._norm(op[1])
        raw = self.base.read([n for n in names if n not in self.norms and n != self.head_key])
        if self.tied_from in raw and self.tied_from not in self.base:  # read once: keep for the head
            self.embed = raw[self.tied_from]
        return {n: self._rotated(n, raw) for n in names}

    def _head_source(self) -> torch.Tensor:
        src = self.tied_from or self.head_key
        return self.base.read([src])[src] if src in self.base else self.embed

    def _rotated(self, name: str, raw: dict) -> torch.Tensor:
        op = self.plan.get(name)
        if op is None:
            return raw[name]
        kind = op[0]
        if kind == "norm":
            return torch.ones_like(self.norms[name])
        t = self._head_source() if kind == "head" else raw[name]
        w, q = t.double(), self.q
        if kind == "embed":
            w = w @ q
        elif kind in ("in", "head"):
            w = (w * self.norms[op[1]].double()) @ q
            if kind == "in" and op[2] is not None:
                w = torch.cat([w[: op[2]], per_head(w[op[2] :].T, self.h).T])
        elif kind == "out":
            w = q.T @ w
            if op[1]:
                w = per_head(w, self.h)
        elif kind == "out_bias":
            w = w @ q
        elif kind == "v_bias":
            w = torch.cat([w[: op[1]], per_head(w[None, op[1] :], self.h)[0]])
        return w.to(t.dtype)


def per_head(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """w [n, heads·d] with each head's d columns multiplied by h [d, d]."""
    d = h.shape[0]
    return (w.reshape(w.shape[0], -1, d) @ h).reshape(w.shape)


def untie(model: nn.Module, spec: ArchSpec) -> bool:
    """Give a model with tied embeddings an LM head of its own (on the meta device until it
    is read); True when it was tied."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    embed = get_module(model, spec.embed).weight
    get_module(model, spec.lm_head).weight = nn.Parameter(torch.empty_like(embed, device="meta"))
    model.config.tie_word_embeddings = False
    return True


def rotated_weights(model: nn.Module, spec: ArchSpec, weights, options) -> tuple[RotatedWeights, dict]:
    """(the model's `weights` served rotated as `options` (`registry.RotateOptions`) say, how the
    rotation was built) for the streaming `model` (built empty), whose LM head is untied first
    when it was tied; a `QuantkitError`
    when its family cannot take a fused rotation (`check_rotatable`)."""
    check_rotatable(model, spec)
    plan = _plan(model, spec)
    tied = untie(model, spec)
    dims = dimensions(model.config.to_dict())
    q, h, how = rotation(options.kind, options.seed, dims["hidden"], dims["head_dim"])
    head = f"{spec.lm_head}.weight"
    return RotatedWeights(weights, plan, q, h, head, f"{spec.embed}.weight" if tied else None), how | {"untied": tied}
