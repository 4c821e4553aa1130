"""Device peaks and where an op sits under them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loom_mcp.traces.perfmodels import Work


def find_peak(device_name: str | None) -> tuple[Any | None, str | None]:
    """(DevicePeak or None, a note when None). Tries the trace's name, then simple variants
    (virtual-function suffixes, vendor prefixes) that profilers add."""
    if not device_name:
        return None, "device not named in the trace: roofline fields are null"
    try:
        from loom_mcp.devices.peaks import lookup_peak  # another module owns the peak table
    except ImportError:
        return None, "device peak table unavailable: roofline fields are null"
    variants = [device_name]
    for cut in (" VF", " (VF)"):
        if device_name.endswith(cut):
            variants.append(device_name[: -len(cut)])
    for prefix in ("NVIDIA ", "AMD Instinct ", "AMD "):
        for v in list(variants):
            if v.startswith(prefix):
                variants.append(v[len(prefix) :])
    for v in variants:
        try:
            peak = lookup_peak(v)
        except Exception:  # noqa: BLE001 - a broken table must not break trace analysis
            peak = None
        if peak is not None:
            return peak, None
    return None, f"no peak figures for '{device_name}': roofline fields are null"


@dataclass(frozen=True)
class Roof:
    tflops: float | None
    tbps: float | None
    pct: float | None
    bound: str | None
    floor_us: float | None  # time the work would take at the roofline
    note: str | None = None


NO_ROOF = Roof(None, None, None, None, None)


def place(work: Work | None, calls: int, time_us: float, peak: Any | None) -> Roof:
    if work is None or time_us <= 0 or calls <= 0:
        return NO_ROOF
    secs = time_us * 1e-6
    flops = work.flops * calls if work.flops is not None else None
    nbytes = work.bytes * calls if work.bytes is not None else None
    tflops = flops / secs / 1e12 if flops else None
    tbps = nbytes / secs / 1e12 if nbytes else None
    if peak is None:
        return Roof(tflops, tbps, None, None, None)
    peaks: dict[str, float] = dict(peak.flops or {})
    note = None
    if work.matrix:
        key = work.dtype or "fp32"
        pf = peaks.get(key)
        if key == "fp32" and pf and flops and flops / secs > 1.05 * pf and peaks.get("tf32"):
            pf, note = peaks["tf32"], "TF32 assumed (faster than the FP32 peak)"
    else:
        # Non-matrix math runs on the vector units ("fp32_vector" where slower than "fp32").
        pf = peaks.get("fp32_vector") or peaks.get("fp32")
    bw = float(peak.memory_bandwidth_bytes_s or 0.0)
    t_c = flops / pf if flops and pf else 0.0
    t_m = nbytes / bw if nbytes and bw else 0.0
    floor = max(t_c, t_m)
    if floor <= 0:
        return Roof(tflops, tbps, None, None, None, note)
    bound = "compute" if t_c > t_m else "memory"
    return Roof(tflops, tbps, 100.0 * floor / secs, bound, floor * 1e6, note)
