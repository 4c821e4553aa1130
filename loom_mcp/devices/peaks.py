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
"""

from __future__ import annotations

import re

from loom_mcp.models import DevicePeak

T = 1e12
GiB = 1 << 30
MiB = 1 << 20

_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet and Hopper architecture whitepaper (nvidia.com)"
_NV_H200 = "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200)"
_NV_BW = "NVIDIA GB200 NVL72 / HGX B200 datasheet (nvidia.com), per-GPU rows"
_NV_A100 = "NVIDIA A100 Tensor Core GPU datasheet and Ampere architecture whitepaper (nvidia.com)"
_AMD = "AMD Instinct {} product page / data sheet (amd.com)"

_HOPPER_SXM = {
    "fp64": 66.9 * T, "fp64_vector": 33.5 * T, "fp32": 66.9 * T, "tf32": 494.7 * T,
    "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T, "int8": 1978.9 * T,
}  # fmt: skip
_HOPPER_NVL = {
    "fp64": 60 * T, "fp64_vector": 30 * T, "fp32": 60 * T, "tf32": 417.5 * T,
    "bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T, "int8": 1670.5 * T,
}  # fmt: skip
_AMPERE = {
    "fp64": 19.5 * T, "fp64_vector": 9.7 * T, "fp32": 19.5 * T, "tf32": 156 * T,
    "bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T,
}  # fmt: skip
_CDNA3_X = {
    "fp64": 163.4 * T, "fp64_vector": 81.7 * T, "fp32": 163.4 * T, "tf32": 653.7 * T,
    "bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T, "int8": 2614.9 * T,
}  # fmt: skip
_CDNA2_GCD_MI250 = {
    "fp64": 45.25 * T, "fp64_vector": 22.65 * T, "fp32": 45.25 * T, "fp32_vector": 22.65 * T,
    "bf16": 181.05 * T, "fp16": 181.05 * T, "int8": 181.05 * T,
}  # fmt: skip

PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(
        model="H100 SXM", vendor="nvidia", arch="sm_90", memory_bandwidth_bytes_s=3.35 * T,
        memory_bytes=80 * GiB, flops=dict(_HOPPER_SXM), l2_bytes=50 * MiB,
        source=f"{_NV_H100}, SXM5 column; 50 MB L2 from the whitepaper",
    ),
    DevicePeak(
        model="H100 PCIe", vendor="nvidia", arch="sm_90", memory_bandwidth_bytes_s=2.0 * T,
        memory_bytes=80 * GiB, l2_bytes=50 * MiB,
        flops={
            "fp64": 51.2 * T, "fp64_vector": 25.6 * T, "fp32": 51.2 * T, "tf32": 378 * T,
            "bf16": 756 * T, "fp16": 756 * T, "fp8": 1513 * T, "int8": 1513 * T,
        },
        source=f"{_NV_H100}, PCIe column (80 GB HBM2e, 2.0 TB/s); 50 MB L2 from the whitepaper",
    ),
    DevicePeak(
        model="H100 NVL", vendor="nvidia", arch="sm_90", memory_bandwidth_bytes_s=3.9 * T,
        memory_bytes=94 * GiB, flops=dict(_HOPPER_NVL), l2_bytes=50 * MiB,
        source=f"{_NV_H100}, H100 NVL column, per GPU (94 GB, 3.9 TB/s); L2 assumed as H100 "
        "(not in the datasheet)",
    ),
    DevicePeak(
        model="H200 SXM", vendor="nvidia", arch="sm_90", memory_bandwidth_bytes_s=4.8 * T,
        memory_bytes=141 * GiB, flops=dict(_HOPPER_SXM), l2_bytes=60 * MiB,
        source=f"{_NV_H200}, SXM column (same GH100 compute as H100 SXM); L2 is not in the "
        "datasheet: 60 MiB is what CUDA reports (cudaDeviceProp.l2CacheSize) on our H200",
    ),
    DevicePeak(
        model="H200 NVL", vendor="nvidia", arch="sm_90", memory_bandwidth_bytes_s=4.8 * T,
        memory_bytes=141 * GiB, flops=dict(_HOPPER_NVL), l2_bytes=60 * MiB,
        source=f"{_NV_H200}, NVL column; L2 assumed equal to H200 SXM (unverified)",
    ),
    DevicePeak(
        model="B200", vendor="nvidia", arch="sm_100", memory_bandwidth_bytes_s=7.7 * T,
        memory_bytes=180 * GiB, l2_bytes=None,
        flops={
            "fp64": 37 * T, "fp32": 75 * T, "tf32": 1100 * T, "bf16": 2250 * T,
            "fp16": 2250 * T, "fp8": 4500 * T, "int8": 4500 * T, "fp4": 9000 * T,
        },
        source=f"{_NV_BW}, HGX B200 column (1000 W; 180 GB, 7.7 TB/s; earlier material said "
        "192 GB / 8 TB/s); NVIDIA publishes no B200 L2 size, so l2_bytes is unknown",
    ),
    DevicePeak(
        model="GB200", vendor="nvidia", arch="sm_100", memory_bandwidth_bytes_s=8.0 * T,
        memory_bytes=186 * GiB, l2_bytes=None,
        flops={
            "fp64": 40 * T, "fp32": 80 * T, "tf32": 1250 * T, "bf16": 2500 * T,
            "fp16": 2500 * T, "fp8": 5000 * T, "int8": 5000 * T, "fp4": 10000 * T,
        },
        source=f"{_NV_BW}, GB200 NVL72 column (B200 at up to 1200 W; 186 GB, 8 TB/s); "
        "L2 unpublished",
    ),
    DevicePeak(
        model="A100 80GB SXM", vendor="nvidia", arch="sm_80", memory_bandwidth_bytes_s=2.039 * T,
        memory_bytes=80 * GiB, flops=dict(_AMPERE), l2_bytes=40 * MiB,
        source=f"{_NV_A100}, 80GB SXM column (2,039 GB/s); no FP8 on Ampere",
    ),
    DevicePeak(
        model="A100 80GB PCIe", vendor="nvidia", arch="sm_80", memory_bandwidth_bytes_s=1.935 * T,
        memory_bytes=80 * GiB, flops=dict(_AMPERE), l2_bytes=40 * MiB,
        source=f"{_NV_A100}, 80GB PCIe column (1,935 GB/s)",
    ),
    DevicePeak(
        model="A100 40GB", vendor="nvidia", arch="sm_80", memory_bandwidth_bytes_s=1.555 * T,
        memory_bytes=40 * GiB, flops=dict(_AMPERE), l2_bytes=40 * MiB,
        source=f"{_NV_A100}, 40GB columns (1,555 GB/s, SXM and PCIe alike)",
    ),
    DevicePeak(
        model="L40S", vendor="nvidia", arch="sm_89", memory_bandwidth_bytes_s=0.864 * T,
        memory_bytes=48 * GiB, l2_bytes=96 * MiB,
        flops={
            "fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T,
            "fp8": 733 * T, "int8": 733 * T,
        },
        source="NVIDIA L40S datasheet (nvidia.com; 48 GB GDDR6, 864 GB/s) and Ada Lovelace "
        "whitepaper (96 MB L2); FP64 runs at 1/64 of FP32 and is not listed",
    ),
    DevicePeak(
        model="MI300X", vendor="amd", arch="gfx942", memory_bandwidth_bytes_s=5.3 * T,
        memory_bytes=192 * GiB, flops=dict(_CDNA3_X), l2_bytes=256 * MiB,
        source=_AMD.format("MI300X") + " and CDNA 3 whitepaper; l2_bytes is the 256 MB Infinity "
        "Cache (LLC); the L2 proper is 4 MB per XCD x 8",
    ),
    DevicePeak(
        model="MI300A", vendor="amd", arch="gfx942", memory_bandwidth_bytes_s=5.3 * T,
        memory_bytes=128 * GiB, l2_bytes=256 * MiB,
        flops={
            "fp64": 122.6 * T, "fp64_vector": 61.3 * T, "fp32": 122.6 * T, "tf32": 490.3 * T,
            "bf16": 980.6 * T, "fp16": 980.6 * T, "fp8": 1961.2 * T, "int8": 1961.2 * T,
        },
        source=_AMD.format("MI300A") + " (128 GB unified HBM3 shared with the CPU); l2_bytes is "
        "the 256 MB Infinity Cache (LLC)",
    ),
    DevicePeak(
        model="MI325X", vendor="amd", arch="gfx942", memory_bandwidth_bytes_s=6.0 * T,
        memory_bytes=256 * GiB, flops=dict(_CDNA3_X), l2_bytes=256 * MiB,
        source=_AMD.format("MI325X") + " (same CDNA 3 compute as MI300X; 256 GB HBM3E, 6 TB/s); "
        "l2_bytes is the 256 MB Infinity Cache (LLC)",
    ),
    DevicePeak(
        model="MI350X", vendor="amd", arch="gfx950", memory_bandwidth_bytes_s=8.0 * T,
        memory_bytes=288 * GiB, l2_bytes=256 * MiB,
        flops={
            "fp64": 72.1 * T, "fp32": 144.2 * T, "bf16": 2306.9 * T, "fp16": 2306.9 * T,
            "fp8": 4613.7 * T, "int8": 4613.7 * T,
        },
        source=_AMD.format("MI350X") + " and CDNA 4 whitepaper; CDNA 4 lists no TF32 matrix rate; "
        "l2_bytes is the 256 MB Infinity Cache (LLC)",
    ),
    DevicePeak(
        model="MI355X", vendor="amd", arch="gfx950", memory_bandwidth_bytes_s=8.0 * T,
        memory_bytes=288 * GiB, l2_bytes=256 * MiB,
        flops={
            "fp64": 78.6 * T, "fp32": 157.3 * T, "bf16": 2516.6 * T, "fp16": 2516.6 * T,
            "fp8": 5033.2 * T, "int8": 5033.2 * T,
        },
        source=_AMD.format("MI355X") + " and CDNA 4 whitepaper; no TF32 matrix rate; l2_bytes is "
        "the 256 MB Infinity Cache (LLC; one third-party page says 64 MB, unconfirmed)",
    ),
    DevicePeak(
        model="MI250X", vendor="amd", arch="gfx90a", memory_bandwidth_bytes_s=1.6384 * T,
        memory_bytes=64 * GiB, l2_bytes=8 * MiB,
        flops={
            "fp64": 47.85 * T, "fp64_vector": 23.95 * T, "fp32": 47.85 * T,
            "fp32_vector": 23.95 * T, "bf16": 191.5 * T, "fp16": 191.5 * T, "int8": 191.5 * T,
        },
        source=_AMD.format("MI250X") + " halved: per GCD, since each OAM module shows up as two "
        "devices (module: 95.7 TF FP64 matrix, 383 TF FP16, 128 GB, 3.2768 TB/s); "
        "8 MB L2 per GCD, no Infinity Cache",
    ),
    DevicePeak(
        model="MI250", vendor="amd", arch="gfx90a", memory_bandwidth_bytes_s=1.6384 * T,
        memory_bytes=64 * GiB, flops=dict(_CDNA2_GCD_MI250), l2_bytes=8 * MiB,
        source=_AMD.format("MI250") + " halved: per GCD (module: 90.5 TF FP64 matrix, 362.1 TF "
        "FP16, 128 GB, 3.2768 TB/s); 8 MB L2 per GCD",
    ),
    DevicePeak(
        model="MI210", vendor="amd", arch="gfx90a", memory_bandwidth_bytes_s=1.6384 * T,
        memory_bytes=64 * GiB, flops=dict(_CDNA2_GCD_MI250), l2_bytes=8 * MiB,
        source=_AMD.format("MI210") + " (104 CUs, 64 GB HBM2e, 1.6384 TB/s; FP64 matrix 45.3 TF, "
        "FP16/BF16/INT8 181.0); 8 MB L2, no Infinity Cache",
    ),
)  # fmt: skip

_BY_MODEL = {p.model: p for p in PEAKS}

# Ordered: the first rule that matches wins, so qualified variants come before the bare name.
# Patterns run on the normalised name (lower case, vendor words dropped, separators as spaces).
_RULES: tuple[tuple[str, str], ...] = (
    ("H100 PCIe", r"\bh100\b.*\bpcie\b"),
    ("H100 NVL", r"\bh100\b.*\bnvl\b"),
    ("H100 SXM", r"\bh100\b"),
    ("H200 NVL", r"\bh200\b.*\bnvl\b"),
    ("H200 SXM", r"\bh200\b"),
    ("GB200", r"\bgb200\b"),
    ("B200", r"\bb200\b"),
    ("A100 40GB", r"\ba100\b.*\b40 ?gb\b"),
    ("A100 80GB PCIe", r"\ba100\b.*\bpcie\b"),
    ("A100 80GB SXM", r"\ba100\b"),
    ("L40S", r"\bl40s\b"),
    ("MI300X", r"\bmi300x\b"),
    ("MI300A", r"\bmi300a\b"),
    ("MI325X", r"\bmi325x\b"),
    ("MI350X", r"\bmi350x\b"),
    ("MI355X", r"\bmi355x\b"),
    ("MI250X", r"\bmi250x\b"),
    ("MI250", r"\bmi250\b"),
    ("MI210", r"\bmi210\b"),
)
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
