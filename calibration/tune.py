"""End-to-end scale tuning (`--tune-scales N`): after calibration, train the checkpoint's
weight scales on the KL divergence from the float model's next-token distribution to the
quantized model's, over the calibration rows. EfficientQAT's end-to-end training of the
quantization parameters (E2E-QP; Chen et al., arXiv 2407.11062) with the float model as the
teacher. The integer codes and zero points stay as calibration left them, so the format, the
size and the kernels that serve the checkpoint do not change; only `weight_scale` does.

    W = s · (q − z),   s = s₀ · exp(m)

with s₀ the calibrated scales and m (one per scale, 0 at the start) trained by Adam: each of
`epochs` epochs visits the rows once in a seeded order, one row a step, the learning rate
falling from `lr` to 0 on a cosine over all steps. The loss of a row is the mean over its
positions of KL(p_float ‖ p_quant) over the whole vocabulary (the output layer's soft-cap
included). Both models compute in float32. Group and per-channel int scales of the
pack-quantized format are tuned (with act-order's g_idx too); FP4/MX scales (fp8 or powers of
two) and every other format are left as they are.

Memory: the float model, the quantized one (codes in int8, each linear's float weights made
for its product and kept for the backward pass) and one row's logits: about three float32
copies of the model.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.formats import pack_quantized
from quantkit.kernels.attention import twin as reference

CHUNK = 256  # positions whose logits are formed at once
LR = 1e-3  # Adam's step on log s: about 0.1% of a scale per step at the start
SAVED = "tuned-scales.st"  # safetensors in the run's folder until the end (not *.safetensors: no shard)


def check_tunable(schemes: dict) -> None:
    """A `QuantkitError` unless every quantized linear (`schemes`: name -> scheme) has int
    weights in the pack-quantized format and float activations: the scales this step trains."""
    for name, s in schemes.items():
        w = s.weights
        if s.format != "pack-quantized" or w.type != "int" or s.input_activations is not None:
            raise QuantkitError(
                f"--tune-scales trains the int weight scales of weight-only int schemes (w4a16, w4a16-asym, "
                f"w3a16, w8a16); {name} is {s.format} with {w.type} weights"
                f"{' and quantized activations' if s.input_activations is not None else ''}: drop --tune-scales."
            )


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_memory(parameters: int) -> None:
    """A `QuantkitError` when three float32 copies of a model of `parameters` weights (the
    float model, the quantized one's weights made for the backward pass, their gradients'
    work) will not fit in the memory available now."""
    need, free = 3 * 4 * parameters, available_memory()
    if free is not None and need > free:
        raise QuantkitError(
            f"--tune-scales holds the float and the quantized model in float32, about {need / 2**30:.1f} GiB, "
            f"and {free / 2**30:.1f} GiB is available; drop --tune-scales or free memory."
        )


def save(path, scales: dict, first: float, last: float) -> None:
    """The tuned scales, with the mean KL of the first and the last epoch, written atomically."""
    meta = {"kl_first_epoch": repr(first), "kl_last_epoch": repr(last)}
    tmp = path.with_name(path.name + ".tmp")
    save_file({n: t.contiguous() for n, t in scales.items()}, tmp, metadata=meta)
    os.replace(tmp, path)


def load(path) -> tuple[dict, dict]:
    """(the scales `save` wrote, {"kl_first_epoch", "kl_last_epoch"})."""
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        scales = {n: f.get_tensor(n) for n in f.keys()}
    return scales, {k: round(float(v), 6) for k, v in meta.items()}


class ScaledLinear(nn.Module):
    """A pack-quantized linear as a float one whose scales train: W = s₀·exp(m) · (q − z)."""

    def __init__(self, q, scale, zero, g_idx, bias):
        super().__init__()
        out_f, in_f = q.shape
        self.register_buffer("q", q.to(torch.int8))
        self.register_buffer("zero", None if zero is None else zero.to(torch.int8))
        if g_idx is None:  # groups of consecutive columns (one group: per channel)
            g_idx = torch.arange(in_f) // -(-in_f // scale.shape[1])
        self.register_buffer("g_idx", g_idx.long())
        self.register_buffer("scale0", scale.float())
        self.log_gain = nn.Parameter(torch.zeros_like(self.scale0))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def scale(self) -> torch.Tensor:
        return self.scale0 * self.log_gain.exp()

    @property
    def weight(self) -> torch.Tensor:
        codes = self.q.float()
        if self.zero is not None:
            codes = codes - self.zero.float()[:, self.g_idx]
        return codes * self.scale()[:, self.g_idx]

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def quantized_student(teacher: nn.Module, tensors: dict, args: dict) -> tuple[nn.Module, dict]:
    """A float32 copy of `teacher` with the checkpoint's float tensors (`tensors`: norms that
    AWQ scaled, embeddings, ...) and a `ScaledLinear` for each linear in `args` (name -> its
    weights' `QuantArgs`). Returns (student, name -> ScaledLinear)."""
    import copy

    student = copy.deepcopy(teacher).float().requires_grad_(False)
    linears = {}
    for name, a in args.items():
        parent, _, child = name.rpartition(".")
        owner = student.get_submodule(parent) if parent else student
        own = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(f"{name}.weight_")}
        q, scale, zero, g_idx = pack_quantized.decompress_ints(own, a)
        linears[name] = ScaledLinear(q, scale, zero, g_idx, getattr(owner, child).bias)
        setattr(owner, child, linears[name])
    head, embed = student.get_output_embeddings(), student.get_input_embeddings()
    if head is not None and head.weight is embed.weight:  # tied, but written untied (--rotate)
        key = next(f"{n}.weight" for n, m in student.named_modules() if m is head)
        if key in tensors:
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    quantized = tuple(f"{n}." for n in args)
    plain = {k: v for k, v in tensors.items() if not k.startswith(quantized)}
    own = student.state_dict()
    for k, v in plain.items():
        if k in own:
            own[k].copy_(v.to(own[k].dtype))
    return student, linears


def _heads(model) -> tuple[nn.Module, nn.Module, float | None]:
    return model.get_output_embeddings(), model.base_model, getattr(model.config, "final_logit_softcapping", None)


def row_kl(teacher: nn.Module, student: nn.Module, ids: torch.LongTensor, backward: bool) -> float:
    """Mean KL(p_teacher ‖ p_student) over the positions of `ids` [1, seq]; with `backward`,
    its gradient is accumulated into the student's trainable parameters. The logits are made
    `CHUNK` positions at a time: the gradient at the student's last hidden state is gathered
    chunk by chunk and sent back through its blocks once."""
    t_head, t_base, cap = _heads(teacher)
    s_head, s_base, _ = _heads(student)
    with torch.no_grad():
        t_hidden = t_base(input_ids=ids).last_hidden_state
    with torch.set_grad_enabled(backward):
        s_hidden = s_base(input_ids=ids).last_hidden_state
    grad = torch.zeros_like(s_hidden) if backward else None
    n, total = s_hidden.shape[0] * s_hidden.shape[1], 0.0
    for p in range(0, s_hidden.shape[1], CHUNK):
        with torch.no_grad():
            log_p = F.log_softmax(reference.cap(t_head(t_hidden[:, p : p + CHUNK]).float(), cap), -1)
        h = s_hidden[:, p : p + CHUNK].detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            log_q = F.log_softmax(reference.cap(s_head(h).float(), cap), -1)
            kl = (log_p.exp() * (log_p - log_q)).sum() / n
        if backward:
            (grad[:, p : p + CHUNK],) = torch.autograd.grad(kl, h)
        total += kl.item()
    if backward:
        s_hidden.backward(grad)
    return total


def tune_scales(teacher, student, linears: dict, rows: torch.LongTensor, epochs: int, lr: float, seed: int, track):
    """Train the `linears`' scales (see the module docstring); returns (the tuned scales,
    name -> tensor, the mean KL of the first epoch's steps, of the last's)."""
    params = [lin.log_gain for lin in linears.values()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    steps = epochs * len(rows)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    order = torch.Generator().manual_seed(seed)
    visits = (i for _ in range(epochs) for i in torch.randperm(len(rows), generator=order).tolist())
    sums = [0.0] * epochs
    for step, i in enumerate(track(visits, "tune scales", steps)):
        opt.zero_grad(set_to_none=True)
        sums[step // len(rows)] += row_kl(teacher, student, rows[i : i + 1], backward=True)
        opt.step()
        schedule.step()
    scales = {name: lin.scale().detach() for name, lin in linears.items()}
    return scales, sums[0] / len(rows), sums[-1] / len(rows)
