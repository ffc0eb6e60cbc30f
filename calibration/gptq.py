"""GPTQ (Frantar et al., ICLR 2023): quantize a weight column by column, feeding each
column's error back into the columns not yet quantized through the inverse Hessian.

Pure functions in the shape of IST-DASLab/gptq `gptq.py`: `accumulate_hessian` (from
`calibration.hessian`) is its `add_batch`, `quantize_weight` its `fasterquant`. The grid is the one of
`quantkit.primitives` (min-max qparams, round-half-to-even), so with an identity
Hessian GPTQ returns exactly what round-to-nearest returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibration import fp4
from quantkit.calibration.awq import ClipInputs, clip_qparams, search_clip
from quantkit.calibration.guided import quantize_rows
from quantkit.calibration.hessian import accumulate_hessian
from quantkit.calibration.hooks import Replay, by_args, reduce_each, reduce_inputs, targets
from quantkit.calibration.method import QParams
from quantkit.calibration.registry import HESSIAN_BYTES
from quantkit.calibration.targets import FloatTargets
from quantkit.errors import QuantkitError
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import FP4_MAX, check_group_size, compute_qparams, nvfp4_global_scale, round_e2m1
from quantkit.scheme import ACTORDERS, QuantArgs, QuantScheme

DAMP_RETRIES = 4  # each retry multiplies damp by 10


@dataclass(slots=True)
class GPTQResult:
    """The fake-quantized weight [out, in] (W's dtype, original column order) and its qparams.

    scale / zero_point are shaped as in `primitives` (group [out, in/group_size], channel
    [out, 1], tensor [1]); zero_point is None when symmetric. g_idx (int32 [in], the group
    of each input column) is set only for actorder "group". damp_used is the damping that
    let the Hessian be factored.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    damp_used: float
    global_scale: torch.Tensor | None = None  # NVFP4: the one of the whole (stacked) weight


def quantize_weight(
    W: torch.Tensor,
    H: torch.Tensor,
    args: QuantArgs,
    block_size: int = 128,
    damp: float = 0.01,
    actorder: str | None = None,
    scale_dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] | None = None,
    name: str = "weight",
    range_search: bool = False,
    refine: int = 0,
    fixed_scales: torch.Tensor | None = None,
) -> GPTQResult:
    """GPTQ-quantize W [out, in] given the Hessian H [in, in] of its layer's inputs (or H [G,
    in, in]: W's rows in G equal contiguous groups, each group's rounding errors fed back
    through its own Hessian in one column loop, the columns visited in the order of the
    Hessians' mean diagonal: loss-guided Hessians' row groups, `calibration.guided`).

    `args` gives the grid (strategy group, channel or tensor). `actorder` (default
    `args.actorder`): None keeps the natural column order; "static"/"weight" visits columns
    by descending diag H but keeps contiguous groups (no g_idx); "group" also forms the
    groups over that order and returns g_idx. H is dampened by damp·mean(diag H); when it
    still cannot be factored, damp is raised ×10 (each retry reported through `log`) up to
    DAMP_RETRIES times, then a QuantkitError is raised. `name` labels the messages.

    With `range_search` (int groups and the FP4 grids), a group's qparams are not min-max of its weights
    when the group starts: its range [lo, hi] is searched (AWQ's clip search, `search_clip`)
    to minimise the error of the group's partial products under the group's block of H,
    d·H_g·dᵀ (H_g ∝ X_gᵀX_g: the output error the group's rounding alone causes). The first
    candidate is the min-max range, so it never scores worse than it.

    With `refine` > 0, that many passes of `refine_rounding` follow the column loop: each
    column rounded again, to the grid point that minimises the output error with every
    other column as it is, under the dampened H (the objective GPTQ approximates); the
    qparams stay.
    """
    return quantize_weights(
        W, H, [args], block_size, damp, actorder, scale_dtype, log, name, range_search, refine, fixed_scales
    )[0]


def quantize_weights(
    W: torch.Tensor,
    H: torch.Tensor,
    formats: list[QuantArgs],
    block_size: int = 128,
    damp: float = 0.01,
    actorder: str | None = None,
    scale_dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] | None = None,
    name: str = "weight",
    range_search: bool = False,
    refine: int = 0,
    fixed_scales: torch.Tensor | None = None,
) -> list[GPTQResult]:
    """`quantize_weight` of one W [out, in] under one H for each of `formats` (which share an
    act-order): the column order, the damped Hessian and its inverse Cholesky factor depend
    on W and H only, so they are made once (what mixed precision's sensitivity asks for
    several formats), and each result is the one `quantize_weight` gives bit for bit.

    `fixed_scales` [out, column blocks] (fp8 blocks, one format): each row's scale in each
    column block, set before the loop instead of taken when the loop reaches the block, so
    that a linear's rows can be quantized in parts that cut its row blocks (`guided.block_scales`);
    the results' scale is then `fixed_scales` itself."""
    orders = {actorder or args.actorder for args in formats}
    if len(orders) != 1:
        raise QuantkitError(
            f"GPTQ quantizes {name} for several formats under one act-order, not {sorted(map(str, orders))}."
        )
    actorder = orders.pop()
    for args in formats:
        _check(W, H, args, block_size, damp, actorder, name)
    if fixed_scales is not None:
        formats = [_rows_as_blocks(args, W, fixed_scales, name) for args in formats]
    W0, n = W, W.shape[1]
    H = H.detach().to(W.device, torch.float32)
    H = H if H.dim() == 3 else H[None]  # H [G, in, in]: W's rows in G equal groups, each under its own
    diag = H.diagonal(dim1=1, dim2=2).mean(0)  # one group: its own diagonal, exactly
    dead = diag == 0  # inputs that were always zero: weight 0, H 1
    if actorder is None:
        perm = torch.arange(n, device=W.device)
    else:  # row groups share one column order, by their Hessians' mean diagonal
        perm = torch.argsort(torch.where(dead, 1.0, diag), descending=True, stable=True)
    # working copies in visiting order, fp32: W [out, in], H [G, in, in] (the caller's H is not modified)
    W, H = W.detach().float()[:, perm], H.index_select(1, perm).index_select(2, perm)
    dead = dead[perm]
    H[:, dead, dead] = 1
    W[:, dead] = 0
    gids = [_group_ids(perm, args, actorder) for args in formats]
    grams = [  # each group's block of H [G, gs, gs], before damping
        [H[:, cols][:, :, cols] for cols in (torch.nonzero(gid == g)[:, 0] for g in range(int(gid.max()) + 1))]
        if range_search and args.strategy in ("group", "tensor_group") and (args.type == "int" or args.is_fp4)
        else None
        for args, gid in zip(formats, gids)
    ]
    say = log or (lambda message: None)
    factors = [_inverse_cholesky(h, damp, say, name if len(H) == 1 else f"{name} rows {k}") for k, h in enumerate(H)]
    Hinv, damp_used = torch.stack([f[0] for f in factors]), max(f[1] for f in factors)  # Hinv [G, in, in], upper
    del factors
    if not refine:
        del H  # at most four [in, in] matrices (per row group) were alive at once: the caller's H, ours and two factors
    inv, results = torch.argsort(perm), []
    for k, (args, gid, gram) in enumerate(zip(formats, gids, grams)):
        gs = fp4_global_scale(W, args)
        Q, scale, zero_point = _column_loop(W, Hinv, gid, args, block_size, scale_dtype, gram, gs, fixed_scales)
        if refine:
            if k == len(formats) - 1:
                del Hinv  # refining needs the damped H, not its factor
            Q = refine_rounding(W, Q, H, gid, scale, zero_point, args, refine, block_size)
        g_idx = gid[inv].to(torch.int32) if _grouped(args) and actorder == "group" else None
        results.append(GPTQResult(Q[:, inv].to(W0.dtype), scale, zero_point, g_idx, damp_used, gs))
    return results


def _group_ids(perm, args, actorder):
    """The group (column of qparams) of each visited column."""
    if not _grouped(args):
        return torch.zeros_like(perm)  # one set of qparams, taken before the loop
    if actorder in ("static", "weight"):
        return perm // _width(args)  # the original contiguous group (or column block) of each visited column
    return torch.arange(perm.numel(), device=perm.device) // _width(args)  # groups over the visiting order


def _rows_as_blocks(args: QuantArgs, W: torch.Tensor, fixed: torch.Tensor, name: str) -> QuantArgs:
    """fp8 blocks whose scales are given per row ([out, column blocks]): the same grid with
    blocks of one row, so that a column's scales are `fixed`'s column as it stands."""
    if args.strategy != "block":
        raise QuantkitError(f"GPTQ takes fixed scales for fp8 blocks only, not the {args.strategy} strategy ({name}).")
    cols = args.block_structure[1]
    if tuple(fixed.shape) != (W.shape[0], -(-W.shape[1] // cols)):
        raise QuantkitError(
            f"the fixed scales of {name} are {tuple(fixed.shape)}; its weight {tuple(W.shape)} in blocks of "
            f"{cols} columns needs ({W.shape[0]}, {-(-W.shape[1] // cols)})."
        )
    return dataclasses.replace(args, block_structure=(1, cols))


def _check(W, H, args, block_size, damp, actorder, name):
    if W.dim() != 2:
        raise QuantkitError(f"GPTQ quantizes 2-D weights [out, in]; {name} has shape {tuple(W.shape)}.")
    n = W.shape[1]
    if tuple(H.shape[-2:]) != (n, n) or H.dim() not in (2, 3) or W.shape[0] % (1 if H.dim() == 2 else len(H)):
        raise QuantkitError(
            f"the Hessian of {name} is {tuple(H.shape)}; its weight has {n} input columns, so it must be ({n}, {n}) "
            f"(or (G, {n}, {n}) for {W.shape[0]} rows in G equal groups)."
        )
    if args.strategy not in ("group", "channel", "tensor", "tensor_group", "block"):
        raise QuantkitError(f"GPTQ quantizes weights per group, channel or tensor, not per {args.strategy} ({name}).")
    if args.strategy == "block" and actorder == "group":
        raise QuantkitError(f"act-order group reorders columns across fp8 blocks ({name}); use --act-order static.")
    if args.strategy in ("group", "tensor_group"):
        check_group_size(name, n, args.group_size)
    if actorder not in ACTORDERS:
        raise QuantkitError(f"actorder {actorder!r} is unknown; use static, group or none.")
    if block_size < 1 or damp < 0:
        raise QuantkitError(f"GPTQ needs block_size >= 1 and damp >= 0 (got {block_size} and {damp}) for {name}.")
    if not torch.isfinite(H).all():
        raise QuantkitError(f"the Hessian of {name} has NaN or inf entries; check the calibration inputs.")


def _inverse_cholesky(H, damp, log, name):
    # upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹; H is dampened in place
    mean_diag, added = H.diagonal().mean(), 0.0
    for attempt in range(DAMP_RETRIES + 1):
        H.diagonal().add_(damp * mean_diag - added)
        added = damp * mean_diag
        L, info = torch.linalg.cholesky_ex(H)
        if info.item() == 0:
            L = torch.cholesky_inverse(L)  # H⁻¹, in L's place as soon as it is made
            U, info = torch.linalg.cholesky_ex(L, upper=True)
            if info.item() == 0 and torch.isfinite(U).all():
                return U, damp
        del L
        if attempt == DAMP_RETRIES:
            break
        new = damp * 10 if damp > 0 else 0.01
        log(f"GPTQ {name}: the Hessian is not positive definite with damp {damp:g}; retrying with damp {new:g}.")
        damp = new
    raise QuantkitError(
        f"GPTQ could not factor the Hessian of {name} even with damp {damp:g}; it is singular or not "
        "positive semi-definite: pass a larger damp, or calibrate on more (and finite) inputs."
    )


def _group_qparams(w, gram, args, scale_dtype, global_scale=None):
    """qparams of one group's current weights w [out, group_size]: min-max, or with `gram`
    (its block of H) the range that minimises d·gram·dᵀ (NVFP4: under the weight's global scale)."""
    if gram is None:
        return compute_qparams(w, args, scale_dtype, global_scale)
    G, gs = len(gram), w.shape[1]  # gram [G, gs, gs]: one per row group
    # row group g's rows side by side as the g-th group of columns: one search for all of them
    side = w if G == 1 else w.reshape(G, -1, gs).transpose(0, 1).reshape(-1, G * gs)
    ranges = search_clip(  # all rows at once
        side,
        ClipInputs(gram, None, gs),
        args,
        batch_co=side.shape[0],
        scale_dtype=scale_dtype,
        global_scale=global_scale,
    )
    if G > 1:
        ranges = ranges.transpose(0, 1).reshape(-1, 1, 2)  # [out, 1, 2]
    return clip_qparams(w, ranges, args, scale_dtype, global_scale)


def _column_loop(W, Hinv, gid, args, block_size, scale_dtype, grams=None, global_scale=None, fixed=None):
    # Hinv [G, n, n]: W's rows in G equal contiguous groups, each fed back through its own
    out, n = W.shape
    G = len(Hinv)
    qp = [None] * (int(gid.max()) + 1)  # (scale, zero_point) per group id
    if fixed is not None:  # fp8 blocks: every row's scale per column block, given
        qp = [(fixed[:, g : g + 1], None) for g in range(len(qp))]
    fast = [None] * len(qp)  # the same as [out] vectors for the inner loop
    if not _grouped(args):
        qp[0] = compute_qparams(W, args, scale_dtype)
    gids = gid.tolist()
    # rows of the transposed weight are columns: the loop reads and writes contiguous memory
    Wt = W.T.contiguous()  # Wt [in, out]
    Qt = torch.zeros_like(Wt)  # Qt [in, out], fake-quantized, visiting order
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = Wt[i1:i2].clone()  # W1 [b, out]
        Err1 = torch.zeros_like(W1)  # Err1 [b, out]
        Hinv1 = Hinv[:, i1:i2, i1:i2]  # Hinv1 [G, b, b]
        diag = _divisors(Hinv1, out)
        for k in range(i2 - i1):
            g = gids[i1 + k]
            if qp[g] is None:  # a group starts: qparams from its weights as updated so far
                cols = (gid == g).nonzero()[:, 0]  # visiting positions, all >= i1 + k
                current = _current(Wt, W1, Err1, Hinv, cols, i1, k)  # [out, group_size]
                qp[g] = _group_qparams(current, None if grams is None else grams[g], args, scale_dtype, global_scale)
            if fast[g] is None:
                fast[g] = _column_qparams(*qp[g], out, args)
            w = W1[k]  # w [out]
            q = _fake_quantize_column(w, *fast[g], args.qmin, args.qmax)
            Qt[i1 + k] = q
            err = (w - q) / diag[k]
            W1[k:].view(-1, G, out // G).sub_(Hinv1[:, k, k:].T[:, :, None] * err.view(G, -1)[None])
            Err1[k] = err
        Wt[i2:] -= _times(Hinv[:, i1:i2, i2:], Err1)  # lazy batch update of the later blocks
    Q = Qt.T
    if not _grouped(args):
        return Q, *qp[0]
    zeros = [z for _, z in qp]
    return Q, torch.cat([s for s, _ in qp], 1), None if zeros[0] is None else torch.cat(zeros, 1)


def _divisors(Hb: torch.Tensor, out: int):
    """Each column's divisor in a block of Hb [G, b, b]: its diagonal as floats (one row group),
    or per row [b, out] (G equal contiguous groups of the out rows)."""
    if len(Hb) == 1:
        return Hb[0].diagonal().tolist()
    return Hb.diagonal(dim1=1, dim2=2).T.repeat_interleave(out // len(Hb), 1)


def _times(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Aᵀ·B per row group: A [G, b, m], B [b, out] (out in G equal contiguous groups) -> [m, out],
    group g's columns A[g]ᵀ·B[:, group g] (one group: one matmul, as GPTQ always made it)."""
    if len(A) == 1:
        return A[0].T @ B
    (G, b, m), out = A.shape, B.shape[1]
    return torch.bmm(A.transpose(1, 2), B.view(b, G, out // G).transpose(0, 1)).transpose(0, 1).reshape(m, out)


@torch.no_grad()
def refine_rounding(W, Q, H, gid, scale, zero_point, args, passes: int = 1, block_size: int = 128):
    """Coordinate descent on a rounding Q of W (QuantEase, Behdin et al. 2023): with every
    other column fixed, the error tr((W − Q)·H·(W − Q)ᵀ) is a convex quadratic in one column
    q_j, minimised at q_j + ((W − Q)·H)_j / H_jj, and on the grid (each row's qparams fixed,
    clamped at its ends) by the grid point nearest to that. Visiting every column `passes`
    times can only lower the error. W, Q fp32 [out, n] and H [n, n] in one column order,
    gid [n] each column's group (its column of scale / zero_point); returns the new Q.
    G = H·(W − Q)ᵀ is kept up to date: inside a block of block_size columns after each
    column, for the rest once per block."""
    out, n = Q.shape
    H = H if H.dim() == 3 else H[None]  # H [G, n, n]: Q's rows in G equal contiguous groups, each under its own
    G = len(H)
    Qt = Q.T.contiguous()  # Qt [n, out]: a column of Q is a row, contiguous
    Gt = H[0] @ (W - Q).T if G == 1 else _times(H, (W - Q).T)  # Gt [n, out] (H symmetric)
    gids, fast = gid.tolist(), {}
    for _ in range(passes):
        for i1 in range(0, n, block_size):
            i2 = min(i1 + block_size, n)
            Gb, Hb = Gt[i1:i2].clone(), H[:, i1:i2, i1:i2]  # Gb [b, out], Hb [G, b, b]
            diag = _divisors(Hb, out)
            moved = Qt.new_zeros(i2 - i1, out)  # old minus new values of the block's columns
            for k in range(i2 - i1):
                g = gids[i1 + k]
                if g not in fast:
                    s, z = scale, zero_point  # per channel or tensor: one set
                    if _grouped(args):
                        s, z = s[:, g : g + 1], None if z is None else z[:, g : g + 1]
                    fast[g] = _column_qparams(s, z, out, args)
                q = Qt[i1 + k]  # q [out], a view
                new = _fake_quantize_column(q + Gb[k] / diag[k], *fast[g], args.qmin, args.qmax)
                moved[k] = q - new
                Gb.view(-1, G, out // G).add_(Hb[:, :, k].T[:, :, None] * moved[k].view(G, -1)[None])
                q.copy_(new)
            Gt += H[0][:, i1:i2] @ moved if G == 1 else _times(H[:, i1:i2], moved)  # H symmetric
    return Qt.T


def _column_qparams(scale, zero, out, args):
    # [out] vectors of a column's qparams: fp32 scale, fp32 zero (or None), and the scale in
    # its own dtype when dequantization must round there (as `primitives.dequantize` does);
    # fp8 blocks: the column's [row blocks] scales spread over their rows
    if args.strategy == "block":
        s = scale.reshape(-1).repeat_interleave(args.block_structure[0])[:out]
        return s.float(), None, None if s.dtype == torch.float32 else s
    s = scale.reshape(-1).expand(out)
    z = None if zero is None else zero.reshape(-1).expand(out).float()
    return s.float(), z, None if s.dtype == torch.float32 else s


def _fake_quantize_column(w, s, z, s_native, qmin, qmax):
    # primitives.quantize then dequantize of one column w [out], in the same arithmetic
    if isinstance(qmax, float):  # the fp4 e2m1 / fp8 e4m3 grids (`QuantArgs.qmax` of a float type)
        return fake_quantize_float_column(w, s, qmax, s_native)
    y = w / s
    if z is not None:
        y = y + z
    q = y.round_().clamp_(qmin, qmax)
    if z is not None:
        q = q - z
    return q * s if s_native is None else (q.to(s_native.dtype) * s_native).float()


def _current(Wt, W1, Err1, Hinv, cols, i1, k):
    # columns `cols` of W [out, len(cols)] with this block's feedback so far; those inside the
    # block are taken from W1 itself, bit for bit, as a symmetric group's extreme value sits
    # on a rounding tie
    vals = Wt[cols] - _times(Hinv[:, i1 : i1 + k][:, :, cols], Err1[:k])  # vals [len(cols), out]
    inside = cols < i1 + W1.shape[0]
    vals[inside] = W1[cols[inside] - i1]
    return vals.T


def _grouped(args: QuantArgs) -> bool:
    """Groups of columns with their own scales: int groups, MX (group), NVFP4 (tensor_group) and
    fp8 blocks (block: a group is a column block, one scale per row block)."""
    return args.strategy in ("group", "tensor_group", "block")


def _width(args: QuantArgs) -> int:
    """Columns per group: the group size, or a block's columns."""
    return args.block_structure[1] if args.strategy == "block" else args.group_size


def fp4_global_scale(W: torch.Tensor, args: QuantArgs) -> torch.Tensor | None:
    """NVFP4: the global scale of W (linears quantized together, q/k/v or gate/up, share it
    as vLLM needs); None for other grids."""
    return nvfp4_global_scale(W.abs().amax()) if args.strategy == "tensor_group" else None


def fake_quantize_float_column(
    w: torch.Tensor, s: torch.Tensor, grid_max: float, s_native: torch.Tensor | None = None
) -> torch.Tensor:
    """One column w [out] rounded to the fp4 e2m1 (grid_max 6) or fp8 e4m3 (448) grid under
    its fp32 scales s [out], as `primitives.quantize` then `dequantize` compute it (in the
    scales' own dtype `s_native` when given: fp8 block scales stored in bf16 or fp16)."""
    y = w / s
    q = round_e2m1(y) if grid_max == FP4_MAX else y.clamp(-grid_max, grid_max).to(torch.float8_e4m3fn).float()
    return q * s if s_native is None else (q.to(s_native.dtype) * s_native).float()


def gptq_step(spec: ArchSpec, scheme: QuantScheme, options, results: dict, scale_dtype, log: Callable | None = None):
    """Runner step, true-sequential inside the block: each group of linears that share an
    input (q,k,v → o → gate,up → down) is quantized on inputs recomputed after the groups
    before it were quantized. Once the attention's linears are all done, its outputs are
    computed once and reused by the later groups' passes. In a sparse block, one Hessian
    per expert: every expert's gate/up are quantized after one pass (or a few, HESSIAN_BYTES
    of Hessians at a time), then every expert's down. With `options.guided` (dense blocks),
    each linear's groups of rows are quantized under their own loss-guided Hessians
    (`calibration.guided`; the block's `inputs.guides`). With `options.float_targets` (dense
    blocks), each group's weights are first moved to the least-squares fit of the float
    model's outputs from the quantized inputs (`calibration.targets`): the float model's
    hidden states travel beside the quantized ones (`runner.FloatStream`, saved with a
    resumable run's state) and each block is copied before it is quantized."""

    guided, floats = options.guided, options.float_targets
    if floats and guided:
        raise QuantkitError("--float-targets and --guided cannot be combined yet; drop one.")
    if floats and spec.moe is not None:
        raise QuantkitError(
            "--float-targets is for dense models (an expert's routed tokens differ between the float and the "
            "quantized model); drop it."
        )
    floats = FloatTargets() if floats else None
    if guided and any(s.weights is not None and s.weights.actorder == "group" for s in (scheme, *scheme.overrides)):
        raise QuantkitError(
            "guided Hessians split a linear's rows, which act-order group cannot; use --act-order static."
        )

    def guided_part(W, H, args, name, fixed_scales):  # one row group of a linear under its guided Hessian
        return _quantize_with(options, W, finite(H, name), args, scale_dtype, log, name, fixed_scales)

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        if guided and inputs.guides is None:
            raise QuantkitError("GPTQ's guided Hessians need the loss gradients; quantize through quantkit.quantize.")
        bspec = spec.for_block(block)
        attention = [n for n in bspec.linears if n.startswith(bspec.attention + ".")]
        done, replay = set(), None
        if floats:
            floats.start(index, block, inputs)
        for stage in bspec.stages:
            if replay is None and all(n in done for n in attention):
                replay = Replay(get_module(block, bspec.attention), len(inputs.hidden))
                if floats:  # the float block's attention, now that its outputs stop changing too
                    floats.attention_done(bspec.attention, len(inputs.hidden))
            done.update(n for group in stage for n in group)
            groups = [names for names in (targets(scheme, prefix, g) for g in stage) if names]
            if guided:
                for names in groups:
                    quantize_rows(block, names, prefix, inputs, replay, scheme, results, scale_dtype, guided_part)
                continue
            for chunk in _chunks(block, groups):
                if floats:
                    hessians = floats.hessians(block, prefix, chunk, inputs, replay, options.damp, finite)
                elif len(stage) == 1:
                    names = chunk[0]
                    first, full = get_module(block, names[0]), f"{prefix}.{names[0]}"
                    hessians = {names[0]: reduce_inputs(block, first, inputs, full, accumulate_hessian, replay)}
                else:
                    firsts = {names[0]: get_module(block, names[0]) for names in chunk}
                    hessians = reduce_each(block, firsts, inputs, accumulate_hessian, prefix, replay)
                for names in chunk:
                    H = finite(hessians.pop(names[0]), f"{prefix}.{names[0]}")
                    # the rows of linears that share H are quantized independently, so one call on
                    # their stacked weights gives each one's result with one factorisation and loop
                    for args, same in by_args(scheme, prefix, names).items():
                        # a per tensor scale, or fp8 blocks whose rows would straddle two linears: one at a time
                        for part in [[n] for n in same] if args.strategy in ("tensor", "block") else [same]:
                            _quantize_part(block, part, prefix, H, args, options, results, scale_dtype, log)
        fp4.record_input_global_scales(
            bspec, scheme, prefix, block, targets(scheme, prefix, bspec.linears), inputs, results
        )
        if floats:
            floats.finish(index, inputs.kwargs)

    if floats:  # the float stream travels with a resumable run's commits
        step.state, step.restore = floats.state, floats.restore
    return step


def _chunks(block, groups: list[list[str]]):
    """The groups of one pass in runs whose Hessians together take about HESSIAN_BYTES."""
    chunk, size = [], 0
    for names in groups:
        width = get_module(block, names[0]).in_features
        if chunk and size + 4 * width * width > HESSIAN_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(names)
        size += 4 * width * width
    if chunk:
        yield chunk


def finite(H, name):
    if not torch.isfinite(H).all():
        raise QuantkitError(
            f"the calibration activations of {name} contain NaN or inf; the float model "
            "overflows on this text (try float32 or other calibration text)."
        )
    return H


def _quantize_with(options, W, H, args, scale_dtype, log, name, fixed_scales=None) -> GPTQResult:
    """`quantize_weight` with the step's options (GPTQOptions)."""
    return quantize_with(options, W, H, [args], scale_dtype, log, name, fixed_scales)[0]


def quantize_with(options, W, H, formats: list, scale_dtype, log, name, fixed_scales=None) -> list[GPTQResult]:
    """`quantize_weights` (every format of `formats` under one factorisation of H) with a
    step's options (GPTQOptions)."""
    return quantize_weights(
        W,
        H,
        formats,
        options.block_size,
        options.damp,
        scale_dtype=scale_dtype,
        log=log,
        name=name,
        range_search=options.range_search,
        refine=options.refine,
        fixed_scales=fixed_scales,
    )


def _quantize_part(block, part, prefix, H, args, options, results, scale_dtype, log):
    linears = [get_module(block, n) for n in part]
    weight = torch.cat([lin.weight.data for lin in linears])
    r = _quantize_with(options, weight, H, args, scale_dtype, log, f"{prefix}.{'+'.join(part)}")
    rows = [lin.out_features for lin in linears]
    zeros = r.zero_point.split(rows) if r.zero_point is not None else [None] * len(rows)
    scales = [r.scale] if len(part) == 1 else r.scale.split(rows)  # one linear: a tensor's or its blocks' scales
    for name, linear, w, scale, zero in zip(part, linears, r.weight.split(rows), scales, zeros):
        linear.weight.data.copy_(w)
        g_idx = r.g_idx.clone() if r.g_idx is not None else None  # one tensor per linear on disk
        qp = QParams(scale.clone(), None if zero is None else zero.clone(), g_idx, global_scale=r.global_scale)
        results[f"{prefix}.{name}"] = qp


# `quantkit plan --calibrate gptq`: fitted on smollm2 (64 × 512, 2026-12-01: 317 s with range
# search against a measured 120 GFLOP/s), the run reaches this fraction of the fp32 matmul rate
PLAN_EFFICIENCY = 0.58


def plan_cost(groups: list[tuple[int, int, float]], tokens: int, group_size: int, sparse_input: int) -> dict:
    """What GPTQ adds to calibrating one block, for `plan`: per group of linears that share
    an input, (in, out summed, share of the `tokens` it sees). Working set: the widest
    Hessian, its act-order permuted copy and two factors, with the Hessians of a pass over
    experts held at once (up to HESSIAN_BYTES), and the stacked weights, permuted, Q and the
    error; FLOPs: accumulating XᵀX, factoring it, and the column loop."""
    widest = max(i for i, _, _ in groups)  # the largest Hessian: down_proj's
    out_rows = max(o for i, o, _ in groups if i == widest)
    held = sum(1 for i, _, _ in groups if i == widest)  # a pass over experts keeps one Hessian each
    held = min(held, max(1, HESSIAN_BYTES // (4 * widest**2)))
    working = (3 + held) * widest**2 * 4 + 4 * out_rows * widest * 4
    flops = sum(2 * tokens * t * i * i + i**3 / 3 + 2 * o * i * i for i, o, t in groups)
    return {"working_set": working, "flops": flops, "efficiency": PLAN_EFFICIENCY}
