"""How a kernel is chosen: once, from an ordered list of candidates, with a reason for each one
passed over (vLLM's `choose_mp_linear_kernel` and attention selector).

    choice = choose("decode attention", attention.DECODE, Problem(device, dtype, head_dim=64))
    out = choice.fn(q, k_cache, ...)        # the hot path: no checks, the winner's callable
    choice.name, choice.why                 # what runs, and why the faster ones do not

Each operation keeps its list beside its implementations (`kernels/<op>/__init__.py`), fastest
first and the twin last. `backend` "auto" tries the candidates of the problem's device type and
those for any device; "triton" only the GPU kernels (which then run wherever the tensors are:
under TRITON_INTERPRET=1 on a CPU) and the twin; "torch" only the twin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from quantkit.errors import QuantkitError

BACKENDS = ("auto", "triton", "torch")


class Problem(SimpleNamespace):
    """What an operation is asked to run: `device`, `dtype` (the activations'), `backend`, and
    whatever shapes and dtypes its candidates look at (head_dim, kv_dtype, a weight ...)."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype, backend: str = "auto", **shapes):
        check_backend(backend)
        super().__init__(device=torch.device(device), dtype=dtype, backend=backend, **shapes)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One implementation of an operation. `can_implement(problem)` is (True, "") or (False, why
    not, one phrase); `build(problem)` returns the callable the hot path calls (building any
    weight layout it needs). `device` is the device type it runs on (None: any); `backend` is
    "triton" for a GPU kernel that backend="triton" forces, "torch" for the twin."""

    name: str
    can_implement: Callable[[Problem], tuple[bool, str]]
    build: Callable[[Problem], Callable]
    device: str | None = None
    backend: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """The candidate chosen for an operation: its `name`, the callable `fn`, and the faster
    candidates `passed_over` [(name, why not)]."""

    op: str
    name: str
    fn: Callable
    passed_over: tuple[tuple[str, str], ...] = ()
    forced: str | None = None  # "torch" when backend="torch" made the twin run

    @property
    def why(self) -> str | None:
        """Why this is not the fastest candidate for the problem (None when it is)."""
        if self.forced:
            return f"backend {self.forced}"
        return "; ".join(f"{name}: {why}" for name, why in self.passed_over) or None


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise QuantkitError(f"backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}.")


def _tried(c: Candidate, p: Problem) -> bool:
    if c.backend == "torch":
        return True
    if p.backend == "auto":
        return c.device in (None, p.device.type)
    return p.backend == "triton" and c.backend == "triton"


def choose(op: str, candidates: list[Candidate], problem: Problem) -> Choice:
    """The first candidate that can implement `problem`, built, with the reasons the ones before
    it could not. Called at load; the caller keeps the `Choice` and calls `fn` from then on."""
    passed_over, gpu_only = [], []
    for c in candidates:
        if not _tried(c, problem):
            if c.device == "cuda" and problem.device.type != "cuda":
                gpu_only.append((c.name, "it needs a GPU"))
            continue
        ok, why = c.can_implement(problem)
        if ok:
            forced = "torch" if problem.backend == "torch" and len(candidates) > 1 else None
            if c.backend == "torch" and not passed_over:  # the twin, where only a GPU has faster
                passed_over = gpu_only
            return Choice(op, c.name, c.build(problem), tuple(passed_over), forced)
        passed_over.append((c.name, why))
    reasons = "; ".join(f"{name}: {why}" for name, why in passed_over)
    raise QuantkitError(f"no kernel can run {op} here ({reasons}).")


def always(problem: Problem) -> tuple[bool, str]:
    """`can_implement` of a candidate that takes every problem (a twin)."""
    return True, ""


def fixed(fn: Callable) -> Callable[[Problem], Callable]:
    """`build` of a candidate whose callable needs nothing built: `fn` itself."""
    return lambda problem: fn


def triton_module(module: str, problem: Problem):
    """The Triton launcher module `quantkit.kernels.<module>`, or None when Triton is missing;
    with backend "triton" a missing Triton is an error that says what to do."""
    import importlib

    try:
        return importlib.import_module(f"quantkit.kernels.{module}")
    except ImportError as e:
        if problem.backend == "triton":
            raise QuantkitError(
                f"the Triton kernel {module} is unavailable ({e}); install triton or use backend torch."
            ) from None
        return None
