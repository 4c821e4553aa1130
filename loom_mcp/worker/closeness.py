"""Closeness of a candidate's outputs to the reference's, for the trusted reference worker
(loom_mcp.worker.reference): elementwise and normwise, scaled to the reference and never stricter
than the error the reference itself makes; and whether outputs are degenerate (a constant
could match them).
"""

from __future__ import annotations

from typing import Any

import torch

from loom_mcp.worker.harness import canonical_dtype

# The yardstick is the error the reference itself makes: `native` (the task's Model run in its
# dtype on this device, with the candidate process's numerics switches) against `ref` (the same
# Model in float64). A candidate as accurate as PyTorch must pass, so that error is always
# allowed, with a factor; below it, the task's tolerance applies, scaled to the reference:
#
# * elementwise, |out - ref| <= atol_eff + rtol |ref| with
#   atol_eff = max(min(atol, floor * rms(ref)), REF_ERROR_FACTOR * max |native - ref|),
#   where `floor` is max(rtol, the dtype's default rtol). The cap at floor * RMS keeps atol from
#   passing any output smaller than atol (softmax over 32k columns gives values ~3e-5: all zeros,
#   a constant or the answer times 1e-3 passed at fp32's atol of 1e-4); the second term is what
#   PyTorch's own kernel misses by (fp32 GEMMs on inputs x 64, TF32 convolutions), which may
#   exceed atol. Global, not per element: an equally accurate kernel that sums in another order
#   errs at other elements. A reference whose finite values are all zero keeps atol.
# * normwise, ||out - ref||_2 / ||ref||_2 (float64, finite elements) <= max(floor,
#   REF_ERROR_FACTOR * the same error of `native`). All zeros, any constant and a scaled copy
#   are ~1 off, far above any reference's own error, so the widened elementwise slack cannot
#   let them through.
#
# Both the candidate's error and the reference's own are reported. The reference run in its
# dtype passes both rules by construction. A task's `check(out, ref)` replaces both; the numbers
# are still reported.

# Two bits: within 4x of the error the reference itself makes in the task's dtype. A downgrade of
# an fp32 task from TF32 to bf16 (3 fewer mantissa bits, 8x) still fails it.
REF_ERROR_FACTOR = 4.0
# The default rtol per canonical dtype (judge_models.DEFAULT_TOLERANCES; a test keeps them equal):
# the least relative precision asked of a float output, whatever a task's TOLERANCE says.
RTOL_FLOOR = {"fp64": 1e-7, "fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2, "fp8": 1e-1}


# Elements per piece when a comparison walks an output: its float64 temporaries (a few per
# element) stay near a GiB, where whole-output float64 copies of a 6 GiB output took 90 GiB.
CHUNK_ELEMENTS = 1 << 24


def _pieces(*tensors: torch.Tensor | None) -> Any:
    """Aligned flat slices of equally sized tensors (None stays None), CHUNK_ELEMENTS at a time."""
    flats = [t.reshape(-1) if t is not None else None for t in tensors]
    total = next(f for f in flats if f is not None).numel()
    for start in range(0, total, CHUNK_ELEMENTS):
        yield [f[start : start + CHUNK_ELEMENTS] if f is not None else None for f in flats]


class _Norm:
    """A 2-norm gathered piece by piece, rescaled as a larger element turns up (as in LAPACK's
    dnrm2), so that no square overflows and no whole-output copy is made."""

    def __init__(self) -> None:
        self.top = 0.0
        self.sum_sq = 0.0  # of (x / top)^2

    def add(self, values: torch.Tensor) -> None:
        if not values.numel():
            return
        top = float(values.abs().max())
        if top == float("inf") or self.top == float("inf"):
            self.top = float("inf")
            return
        if top > self.top:
            self.sum_sq *= (self.top / top) ** 2
            self.top = top
        if self.top > 0.0:
            self.sum_sq += float(torch.sum((values / self.top) ** 2))

    def value(self) -> float:
        return self.top if self.top in (0.0, float("inf")) else self.top * self.sum_sq**0.5


def reference_stats(native: list, exact: list | None) -> list[dict[str, Any] | None]:
    """Per output: the reference's scale (RMS and 2-norm of its finite float64 values) and the
    error the reference makes in the task's dtype (normwise and largest elementwise, against the
    float64 run; None when there is no float64 run). None for non-float outputs. Computed while
    the candidate runs, with the reference outputs themselves."""
    stats: list[dict[str, Any] | None] = []
    for i, value in enumerate(native):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            stats.append(None)
            continue
        ref = exact[i] if exact is not None and i < len(exact) else None
        target = ref if ref is not None else value
        with_own = ref is not None and tuple(value.shape) == tuple(target.shape)
        norm, err_norm, err_max, count = _Norm(), _Norm(), 0.0, 0
        for want, own in _pieces(target, value if with_own else None):
            want = want.to(torch.float64)
            finite = torch.isfinite(want)
            norm.add(want[finite])
            count += int(finite.sum())
            if own is not None:
                own = own.to(want.device, torch.float64)
                err = (own - want)[finite & torch.isfinite(own)]
                err_norm.add(err)
                if err.numel():
                    err_max = max(err_max, float(err.abs().max()))
        entry: dict[str, Any] = {
            "ref_norm": norm.value(),
            "ref_rms": norm.value() / max(count, 1) ** 0.5,
            "ref_norm_rel_err": None,
            "ref_max_abs_err": None,
        }
        if with_own:
            entry["ref_max_abs_err"] = err_max
            entry["ref_norm_rel_err"] = err_norm.value() / norm.value() if norm.value() > 0 else None
        stats.append(entry)
    return stats


def scale_rules(
    dtype: str, tolerance: dict[str, float], stats: dict[str, Any] | None
) -> tuple[float, float | None, str]:
    """(atol to use, normwise bound or None, how both were derived) for one float output."""
    atol, rtol = tolerance["atol"], tolerance["rtol"]
    if not stats or not stats["ref_norm"] or stats["ref_norm"] == float("inf"):
        return atol, None, "the reference has no nonzero finite value: plain atol"
    floor = max(rtol, RTOL_FLOOR.get(dtype, 0.0))
    own_abs = stats["ref_max_abs_err"] or 0.0
    own_norm = stats["ref_norm_rel_err"] or 0.0
    atol_eff = max(min(atol, floor * stats["ref_rms"]), REF_ERROR_FACTOR * own_abs)
    bound = max(floor, REF_ERROR_FACTOR * own_norm)
    if stats["ref_norm_rel_err"] is None:
        how = f"rtol {floor:g}; no float64 run to measure the reference's own error"
    else:
        how = (
            f"the larger of rtol {floor:g} and {REF_ERROR_FACTOR:g} x the reference's own {dtype} error {own_norm:.3g}"
        )
    return atol_eff, bound, f"({how}); reference RMS {stats['ref_rms']:.3g}"


def compare_one(
    out: torch.Tensor,
    native: torch.Tensor,
    exact: torch.Tensor | None,
    tolerance: dict[str, float],
    stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    dtype = canonical_dtype(native.dtype)
    result: dict[str, Any] = {
        "dtype": dtype,
        "shape_match": True,
        "dtype_match": True,
        "nan_inf_parity": True,
        "max_abs_err": None,
        "max_rel_err": None,
        "mismatched": None,
        "message": None,
        "atol": tolerance["atol"],
        "rtol": tolerance["rtol"],
        "passed": False,
        "atol_effective": None,
        "norm_rel_err": None,
        "norm_rel_bound": None,
        "ref_norm_rel_err": None,
        "ref_max_abs_err": None,
        "ref_rms": None,
    }
    if tuple(out.shape) != tuple(native.shape):
        result["shape_match"] = False
        result["message"] = f"output shape {tuple(out.shape)} != reference {tuple(native.shape)}"
        return result
    if out.dtype != native.dtype:
        result["dtype_match"] = False
        result["message"] = f"output dtype {out.dtype} != reference {native.dtype}"
        return result
    scaled = native.is_floating_point()
    if scaled and stats is None:
        stats = reference_stats([native], [exact] if exact is not None else None)[0]
    atol, bound, how = scale_rules(dtype, tolerance, stats) if scaled else (tolerance["atol"], None, "")
    if scaled and stats:
        result.update(
            atol_effective=atol,
            norm_rel_bound=bound,
            ref_rms=stats["ref_rms"],
            ref_norm_rel_err=stats["ref_norm_rel_err"],
            ref_max_abs_err=stats["ref_max_abs_err"],
        )
    # On the reference's device: on a GPU the float64 error statistics of 30 cases of 16M elements
    # are milliseconds; on the host they were most of run_validation's wall time. In pieces: see
    # CHUNK_ELEMENTS.
    target_full = exact if exact is not None else native
    inf = float("inf")
    parity = True
    nan_counts, inf_counts = [0, 0], [0, 0]  # reference, candidate
    err_norm = _Norm()
    max_abs = max_rel = 0.0
    mismatched = 0
    for want, have in _pieces(target_full, out):
        target = want.to(torch.float64)
        got = have.to(target.device, torch.float64)
        ref_nan, got_nan = torch.isnan(target), torch.isnan(got)
        parity = parity and (
            torch.equal(ref_nan, got_nan)
            and torch.equal(target == inf, got == inf)
            and torch.equal(target == -inf, got == -inf)
        )
        nan_counts[0] += int(ref_nan.sum())
        nan_counts[1] += int(got_nan.sum())
        inf_counts[0] += int(torch.isinf(target).sum())
        inf_counts[1] += int(torch.isinf(got).sum())
        finite = torch.isfinite(target) & torch.isfinite(got)
        signed = (got - target)[finite]
        if not signed.numel():
            continue
        diff = signed.abs()
        scale = target.abs()[finite]
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / scale.clamp_min(1e-12)).max()))
        mismatched += int((diff > atol + tolerance["rtol"] * scale).sum())
        err_norm.add(signed)
    result["nan_inf_parity"] = bool(parity)
    result["max_abs_err"], result["max_rel_err"], result["mismatched"] = max_abs, max_rel, mismatched
    if bound is not None and stats and parity:  # with NaN/Inf out of place it means nothing
        result["norm_rel_err"] = err_norm.value() / stats["ref_norm"]
    norm_bad = bound is not None and result["norm_rel_err"] is not None and not result["norm_rel_err"] <= bound
    problems = []
    if norm_bad:
        problems.append(
            f"normwise relative error ||out - ref|| / ||ref|| = "
            f"{result['norm_rel_err']:.3g} exceeds its bound {bound:.3g} {how}"
        )
    if result["mismatched"]:
        if atol < tolerance["atol"]:
            why = f" (capped from {tolerance['atol']:g} at the reference's scale)"
        elif atol > tolerance["atol"]:
            why = (
                f" (widened from {tolerance['atol']:g} to {REF_ERROR_FACTOR:g} x the "
                f"reference's own {dtype} max abs error {result['ref_max_abs_err']:.3g})"
            )
        else:
            why = ""
        problems.append(
            f"{result['mismatched']} of {out.numel()} elements outside "
            f"atol={atol:.3g}{why} rtol={tolerance['rtol']:g} "
            f"(max abs err {result['max_abs_err']:.3g})"
        )
    if not result["nan_inf_parity"]:
        result["message"] = (
            f"NaN/Inf positions differ: reference has {nan_counts[0]} NaN and "
            f"{inf_counts[0]} Inf, candidate {nan_counts[1]} NaN and {inf_counts[1]} Inf"
        )
    elif problems:
        result["message"] = "; ".join(problems)
    result["passed"] = result["nan_inf_parity"] and result["mismatched"] == 0 and not norm_bad
    return result


def degenerate(native: list[torch.Tensor]) -> bool:
    """Outputs that a constant could match (METR dropped such tasks): worth a warning. Their mean
    everywhere is within the dtype's relative tolerance of them in norm (spread <= floor x RMS),
    so it passes the normwise rule; an all-zero output counts. Relative, not absolute: softmax
    rows of 1e-5 values varying by 10 % are not constant."""
    for t in native:
        if not (t.is_floating_point() and t.numel() > 1):
            continue
        total, count = 0.0, 0
        for (piece,) in _pieces(t):
            v = piece.to(torch.float64)
            finite = v[torch.isfinite(v)]
            total += float(finite.sum())
            count += finite.numel()
        if count <= 1:
            continue
        mean = total / count
        spread, size = _Norm(), _Norm()
        for (piece,) in _pieces(t):
            v = piece.to(torch.float64)
            finite = v[torch.isfinite(v)]
            spread.add(finite - mean)
            size.add(finite)
        floor = RTOL_FLOOR.get(canonical_dtype(t.dtype), 0.0)
        if spread.value() <= floor * size.value():
            return True
    return False
