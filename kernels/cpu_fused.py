"""The C++ element-wise kernels of a decoder block on the CPU (`kernels/csrc/fused.cpp`): RMSNorm,
residual add + RMSNorm, rotary embedding in place, SiLU(gate) * up, each one pass instead of the
torch ops of the module it replaces. Built on first use by `cpu_ext.Extension`; `load()` is
`torch.ops.quantkit_fused` or None, and `reason()` says why. `quantkit.ops` falls back to the
twins in `quantkit.kernels.reference` (the modules' own torch code)."""

from __future__ import annotations

from quantkit.kernels import cpu_ext

EXTENSION = cpu_ext.Extension("fused.cpp", "quantkit_fused", "silu_mul", "the C++ CPU element-wise kernels")
load, reason = EXTENSION.load, EXTENSION.reason
