"""The C++ element-wise passes of W8A8 on the CPU (`kernels/int8/w8a8.cpp`), built on first use
by `cpu_ext.Extension` (the same compiler flags, cache folder and build lock as the other kernels).

`load()` returns `torch.ops.quantkit_w8a8` (`quantize_per_token`, `scale_rows_`) or None, and
`reason()` says why it is None: `QUANTKIT_NO_EXT=1`, no C++ compiler or ninja, or a failed build.
`cpu.w8a8_gemm_cpu` then runs the same math as torch ops: bit for bit the same int8 values and
scales, about ten passes over the activations instead of one (measured in docs/benchmarks.md).
"""

from __future__ import annotations

from quantkit.kernels import cpu_ext

EXTENSION = cpu_ext.Extension("int8/w8a8.cpp", "quantkit_w8a8", "quantize_per_token", "the W8A8 CPU kernels")
load, reason = EXTENSION.load, EXTENSION.reason
