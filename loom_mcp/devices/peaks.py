"""Datasheet ceilings of the accelerators loom knows, and matching of the names drivers report.

Conventions, so every consumer reads the table the same way:

* FLOP/s are dense (no 2:4 sparsity). Vendors headline sparse tensor rates; those are halved here.
* ``flops[dtype]`` is the best unit's rate for that dtype: tensor/matrix cores where they take it
  (so fp64 on H100 is the FP64 Tensor Core rate). Where plain SIMD is slower it is also given as
  ``fp64_vector`` / ``fp32_vector``. A dtype the part has no fast path for is left out, never 0.
* ``int8`` is in OP/s. Bandwidth is decimal (TB/s x 1e12), memory is the nominal size in GiB.
* ``l2_bytes`` is the largest device-side cache a cold benchmark must flush: the L2 on NVIDIA,
  the Infinity Cache (MALL, a memory-side last-level cache) on AMD parts that have one. Each
  ``source`` says which.
* MI250X / MI250 appear to software as two devices (one per GCD), so their rows are per GCD.

The table itself is peaks.toml beside this module, in the datasheets' units, read once at import.
"""

from __future__ import annotations

import re
import sys
from importlib import resources

from loom_mcp.models import DevicePeak

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

T = 1e12
GiB = 1 << 30
MiB = 1 << 20


_KEYS = {"model", "vendor", "arch", "bandwidth_tb_s", "memory_gib", "l2_mib", "tflops", "source"}


def _load() -> tuple[tuple[DevicePeak, ...], tuple[tuple[str, str], ...]]:
    """peaks.toml's parts, in file order, and its name-matching rules."""
    path = resources.files("loom_mcp.devices").joinpath("peaks.toml")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    shared, documents = data["shared_tflops"], data["documents"]
    peaks = []
    for entry in data["peak"]:
        if unknown := entry.keys() - _KEYS:
            raise ValueError(f"peaks.toml: {entry.get('model')}: unknown keys {sorted(unknown)}")
        tflops = entry["tflops"]
        tflops = shared[tflops] if isinstance(tflops, str) else tflops
        l2_mib = entry.get("l2_mib")
        docs = {key: doc.format(model=entry["model"]) for key, doc in documents.items()}
        peaks.append(
            DevicePeak(
                model=entry["model"],
                vendor=entry["vendor"],
                arch=entry["arch"],
                # Multiplied here, as the datasheets' units times T, so the floats are the same
                # ones `3.35 * T` always gave.
                memory_bandwidth_bytes_s=entry["bandwidth_tb_s"] * T,
                memory_bytes=entry["memory_gib"] * GiB,
                flops={dtype: rate * T for dtype, rate in tflops.items()},
                l2_bytes=None if l2_mib is None else l2_mib * MiB,
                source=entry["source"].format_map(docs),
            )
        )
    rules = tuple((model, pattern) for model, pattern in data["names"]["rules"])
    return tuple(peaks), rules


PEAKS: tuple[DevicePeak, ...]
# Ordered: the first rule that matches wins, so qualified variants come before the bare name.
_RULES: tuple[tuple[str, str], ...]
PEAKS, _RULES = _load()
_BY_MODEL = {p.model: p for p in PEAKS}
if _unmatched := {model for model, _ in _RULES} - _BY_MODEL.keys():
    raise ValueError(f"peaks.toml: name rules for unknown models {sorted(_unmatched)}")
_COMPILED = tuple((model, re.compile(pattern)) for model, pattern in _RULES)
_NOISE = re.compile(r"\b(nvidia|amd|instinct|tesla|radeon|tensor core gpu|gpu|accelerator)\b")


def _normalise(name: str) -> str:
    text = re.sub(r"[_\-/,()®™]+", " ", name.lower())
    return " ".join(_NOISE.sub(" ", text).split())


def normalise_arch(arch: str | None) -> str | None:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'; 'sm_90a', 'sm90', 'compute_90', '9.0' -> 'sm_90'."""
    if not arch:
        return None
    text = arch.strip().lower()
    if m := re.match(r"(gfx[0-9a-f]+)", text):
        return m.group(1)
    if m := re.match(r"(?:sm_?|compute_?)(\d+)", text):
        return f"sm_{m.group(1)}"
    if m := re.fullmatch(r"(\d+)\.(\d+)", text):
        return f"sm_{m.group(1)}{m.group(2)}"
    return text


def _by_arch(arch: str, name: str) -> DevicePeak | None:
    candidates = [p for p in PEAKS if p.arch == arch]
    if not candidates:
        return None
    # The name told us nothing, so take the fastest part of that architecture: a physical floor
    # computed from it can only be too low, never flag a real result as impossible.
    best = max(candidates, key=lambda p: (p.memory_bandwidth_bytes_s, p.flops.get("bf16", 0.0)))
    why = f"name {name!r} not recognised; " if name else ""
    note = (
        f"matched by architecture only ({why}{arch} has {len(candidates)} known parts, the "
        f"fastest was taken so floors stay conservative). {best.source}"
    )
    return best.model_copy(update={"source": note})


def lookup_peak(name: str, arch: str | None = None) -> DevicePeak | None:
    """The datasheet ceilings for a device name as NVML, amdsmi, torch or a trace spells it.

    Works for "NVIDIA H100 80GB HBM3", "NVIDIA H200", "AMD Instinct MI300X VF", "MI210", a
    rocprofv3 agent ("gfx950" with product "AMD Instinct MI350X"), and so on. When the name says
    nothing useful (e.g. "AMD Radeon Graphics", or an arch string passed as the name) the
    architecture decides, and ``source`` says so. Unknown devices give None: loom never invents
    a ceiling.
    """
    raw = name or ""
    normalised = _normalise(raw)
    for model, pattern in _COMPILED:
        if pattern.search(normalised):
            return _BY_MODEL[model]
    # rocprofv3 agents and some torch builds put the gfx target where the name belongs.
    name_arch = raw if raw.strip().lower().startswith("gfx") else None
    arch_key = normalise_arch(arch) or normalise_arch(name_arch)
    return _by_arch(arch_key, raw if name_arch is None else "") if arch_key else None
