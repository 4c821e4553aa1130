"""Parsers of compiler output: nvcc/ptxas `-Xptxas -v`, hipcc `-Rpass-analysis=kernel-resource-usage`,
and compiler diagnostics with file:line; plus an occupancy estimate from the resources.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, cast

from loom_mcp.models import CompileDiagnostic, KernelResources

# ptxas prints one block per entry: "Compiling entry function 'X' for 'sm_90'", then
# "N bytes stack frame, N bytes spill stores, N bytes spill loads", then
# "Used N registers, [used N barriers,] N bytes smem[, ...]".
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")

# nvcc/clang diagnostics: "file.cu(12): error: msg" and "file.hip:12:5: error: msg".
_NVCC_DIAG = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?P<sev>error|warning|note)[^:]*: (?P<msg>.*)$")
_CLANG_DIAG = re.compile(r"^(?P<file>[^\s:]+):(?P<line>\d+):(?:\d+:)? (?P<sev>error|warning|note|remark): (?P<msg>.*)$")

# AMD: "remark: k.hip:3:0: Function Name: _Z3addPfS_" then "... VGPRs: 12", "SGPRs: 18",
# "ScratchSize [bytes/lane]: 0", "Occupancy [waves/SIMD]: 8", "LDS Size [bytes/block]: 0".
_AMD_REMARK = re.compile(r"remark: (?:[^:]+:\d+:\d+: )?(?P<key>[A-Za-z ]+?)(?: \[[^\]]*\])?: (?P<value>\S+)")


def demangle(names: list[str]) -> dict[str, str]:
    """c++filt when present; mangled names otherwise (never fails)."""
    import shutil
    import subprocess

    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    try:
        out = subprocess.run(
            ["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {n: n for n in names}
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def parse_ptxas(text: str) -> list[KernelResources]:
    kernels: list[KernelResources] = []
    current: KernelResources | None = None
    for line in text.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = KernelResources(name=m.group(1))
            kernels.append(current)
            continue
        if current is None:
            continue
        if m := _PTXAS_FRAME.search(line):
            current.stack_bytes, current.spill_stores_bytes, current.spill_loads_bytes = map(int, m.groups())
        if m := _PTXAS_USED.search(line):
            current.registers = int(m.group(1))
            if s := _PTXAS_SMEM.search(line):
                current.shared_memory_bytes = int(s.group(1))
            else:
                current.shared_memory_bytes = 0
    names = demangle([k.name for k in kernels])
    for k in kernels:
        k.name = names.get(k.name, k.name)
    return kernels


def parse_amd_resource_usage(text: str) -> list[KernelResources]:
    kernels: list[KernelResources] = []
    current: KernelResources | None = None
    for line in text.splitlines():
        m = _AMD_REMARK.search(line)
        if not m:
            continue
        key, value = m.group("key").strip(), m.group("value")
        if key == "Function Name":
            current = KernelResources(name=value)
            kernels.append(current)
            continue
        if current is None or not value.isdigit():
            continue
        number = int(value)
        if key == "VGPRs":
            current.registers = number
        elif key == "SGPRs":
            current.sgprs = number
        elif key == "ScratchSize":
            current.stack_bytes = number
            current.spill_stores_bytes = number  # scratch use on AMD is where spills land
        elif key == "LDS Size":
            current.shared_memory_bytes = number
        elif key == "Occupancy":
            # waves per SIMD, out of the architecture's maximum (8 on CDNA3's 512-VGPR SIMDs)
            current.occupancy = min(1.0, number / 8)
            current.occupancy_limiter = "compiler estimate"
    names = demangle([k.name for k in kernels])
    for k in kernels:
        k.name = names.get(k.name, k.name)
    return kernels


def parse_diagnostics(text: str, source: Path | None = None) -> list[CompileDiagnostic]:
    found: list[CompileDiagnostic] = []
    for line in text.splitlines():
        m = _NVCC_DIAG.match(line.strip()) or _CLANG_DIAG.match(line.strip())
        if not m or m.group("sev") == "remark":
            continue
        file = m.group("file")
        if source is not None and Path(file).name == source.name:
            file = str(source)
        # the patterns admit only error|warning|note here (remark skipped above)
        severity = cast(Literal["error", "warning", "note"], m.group("sev"))
        found.append(
            CompileDiagnostic(severity=severity, message=m.group("msg").strip(), file=file, line=int(m.group("line")))
        )
    return found


# Per-SM limits used for the estimate; Hopper and Ampere datacenter parts share them.
SM_LIMITS = {
    "default": {"regs": 65536, "smem": 228 * 1024, "warps": 64, "reg_alloc_unit": 256},
    "sm_80": {"regs": 65536, "smem": 164 * 1024, "warps": 64, "reg_alloc_unit": 256},
    "sm_89": {"regs": 65536, "smem": 100 * 1024, "warps": 48, "reg_alloc_unit": 256},
}


def estimate_occupancy(k: KernelResources, arch: str | None, warps_per_block: int | None) -> None:
    """Fill k.occupancy: resident warps per SM / max, limited by registers, shared memory, warps."""
    if k.registers is None or not arch or not arch.startswith("sm_"):
        return
    lim = SM_LIMITS.get(arch, SM_LIMITS["default"])
    wpb = warps_per_block or 8  # unknown block size: assume 256 threads, a common choice
    regs_per_warp = -(-k.registers * 32 // lim["reg_alloc_unit"]) * lim["reg_alloc_unit"]
    by_regs = lim["regs"] // max(regs_per_warp * wpb, 1)
    by_smem = lim["smem"] // k.shared_memory_bytes if k.shared_memory_bytes else 10**9
    by_warps = lim["warps"] // wpb
    blocks = min(by_regs, by_smem, by_warps)
    limiter = {by_regs: "registers", by_smem: "shared_memory", by_warps: "warps"}[blocks]
    k.occupancy = round(min(1.0, blocks * wpb / lim["warps"]), 3)
    k.occupancy_limiter = limiter if warps_per_block else f"{limiter} (assuming 256 threads/block)"
