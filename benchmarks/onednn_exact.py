"""How far oneDNN's int8 GEMM (and `torch._int_mm`, the same path) lands from the exact W8A8 result
on smollm2-135m's real activations, for the ISA oneDNN runs here.

    OMP_NUM_THREADS=1 python benchmarks/onednn_exact.py [--isa avx2] [--layers 2 12 25] [--tokens 512]

The float model runs one row of `news` (seed 0) and each chosen linear's input is kept; its
weight is quantized to int8 per output channel as `quantkit rtn --scheme w8a8` does (`primitives`),
and oneDNN's result (`onednn.w8a8_gemm_cpu`, run even where it is not exact: `inexact_ok`) is
compared with the exact one (`kernels/int8/twin.py`: the same int8 values, fp32 sums). Per
linear: ‖oneDNN − exact‖ / ‖exact‖, the share of outputs off by more than 1e-3 of the largest,
and for scale W8A8's own error, ‖exact − float‖ / ‖float‖.

--isa avx2 re-runs this script with ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2-only CPU runs: there
oneDNN sums u8 · s8 pairs in saturating int16, `onednn.saturates`). On AVX-512, AVX-VNNI and
AMX the first column is ~1e-7, the fp32 rounding of the scales.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", choices=["avx2"], default=None, help="re-run with oneDNN capped at AVX2")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 12, 25])
    p.add_argument("--tokens", type=int, default=512)
    a = p.parse_args()
    if a.isa == "avx2" and os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2":
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
        sys.exit(subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode)
    import torch
    import torch.nn.functional as F

    from quantkit.calibration.datasets import calibration_samples, load_documents
    from quantkit.kernels.int8 import onednn, twin
    from quantkit.models.loading import load_float_model
    from quantkit.primitives import compute_qparams, quantize
    from quantkit.scheme import preset

    torch.set_num_threads(1)
    model, tok, _ = load_float_model("smollm2-135m", dtype=torch.float32)
    ids = calibration_samples(tok, load_documents("news"), 1, a.tokens, seed=0)
    inputs = {}
    for i in a.layers:
        for name in LINEARS:
            key = f"model.layers.{i}.{name}"
            hook = lambda m, args, out, key=key: inputs.__setitem__(key, args[0].reshape(-1, args[0].shape[-1]))  # noqa: E731
            model.get_submodule(key).register_forward_hook(hook)
    with torch.no_grad():
        model(ids)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "the CPU's widest")
    print(f"oneDNN capped at {cap}; its int8 sums saturate here: {onednn.saturates()}; {ids.shape[1]} news tokens\n")
    print("| linear | oneDNN vs exact (rel. L2) | outputs off > 1e-3 max | W8A8 vs float (rel. L2) |")
    print("|---|---|---|---|")
    for key, x in inputs.items():
        w = model.get_submodule(key).weight.data
        args = preset("w8a8").weights
        s = compute_qparams(w, args)[0]
        w_int8 = quantize(w, s, None, args)
        exact = twin.int8_gemm(x, w_int8, s)
        y = onednn.w8a8_gemm_cpu(x, onednn.prepack_w8a8(w_int8, s, inexact_ok=True))
        f = F.linear(x, w)
        err = (y - exact).abs()
        off = (err > 1e-3 * exact.abs().amax()).float().mean().item()
        rel = (err.norm() / exact.norm()).item()
        print(f"| {key[13:]} | {rel:.1e} | {off:.2%} | {((exact - f).norm() / f.norm()).item():.1e} |")


if __name__ == "__main__":
    main()
