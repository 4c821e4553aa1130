"""Kernel categories and short display names.

The kernel name decides first (it is what actually ran); the launching op's name is only a
fallback for kernels whose names say nothing (vendor GEMMs named by tile shapes are caught by
name, but a bare `kernel_0` launched under `aten::mm` is still a GEMM).
"""

from __future__ import annotations

import re
import sys
from importlib import resources

from loom_mcp.traces.events import KIND_KERNEL

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

GEMM = "GEMM"
ATTENTION = "attention"
NORM = "normalization"
ELEMENTWISE = "elementwise"
REDUCTION = "reduction"
QUANT = "quant/dequant"
MOE = "MoE"
COMM = "communication"
MEMCPY = "memcpy/memset"
TRITON = "Triton"
OTHER = "other"

CATEGORIES = (
    GEMM,
    ATTENTION,
    NORM,
    ELEMENTWISE,
    REDUCTION,
    QUANT,
    MOE,
    COMM,
    MEMCPY,
    TRITON,
    OTHER,
)


def _load_rules() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    """categories.toml's rule lists by table ("kernel", "op"), in file order."""
    path = resources.files("loom_mcp.traces").joinpath("categories.toml")
    tables = tomllib.loads(path.read_text(encoding="utf-8"))
    built: dict[str, list[tuple[str, re.Pattern[str]]]] = {}
    for table, entries in tables.items():
        rules = built.setdefault(table, [])
        for entry in entries:
            category, pattern = entry["category"], entry["pattern"]
            if category not in CATEGORIES:
                raise ValueError(f"categories.toml: unknown category {category!r} in [[{table}]]")
            flags = re.IGNORECASE if entry.get("ignore_case", True) else 0
            text = "".join(pattern) if isinstance(pattern, list) else pattern
            rules.append((category, re.compile(text, flags)))
    return built


# Ordered: the first match wins (categories.toml says why the order is what it is). Kernel names
# decide; the launching op's name is the fallback.
_RULES = _load_rules()
_KERNEL_RULES: list[tuple[str, re.Pattern[str]]] = _RULES["kernel"]
_OP_RULES: list[tuple[str, re.Pattern[str]]] = _RULES["op"]


def timeline_bucket(category: str) -> str:
    """Which timeline part a category's time lands in."""
    if category == COMM:
        return "comm"
    if category == MEMCPY:
        return "memcpy"
    return "compute"


def op_category(op_name: str) -> str:
    """The category of a host op by its name alone (a CPU trace has no kernels to name)."""
    for cat, rx in _OP_RULES:
        if rx.search(op_name):
            return cat
    return OTHER


def classify(kernel_name: str, kind: int, op_name: str | None = None) -> str:
    if kind != KIND_KERNEL:
        return MEMCPY
    for cat, rx in _KERNEL_RULES:
        if rx.search(kernel_name):
            return cat
    if op_name:
        for cat, rx in _OP_RULES:
            if rx.search(op_name):
                return cat
    return OTHER


_GENERIC = {
    "BinaryFunctor",
    "AUnaryFunctor",
    "BUnaryFunctor",
    "UnaryOpFunctor",
    "ReduceOp",
    "func_wrapper_t",
    "TensorIteratorBase",
    "gpu_kernel_impl",
    "gpu_kernel_impl_nocast",
}
_INNER = re.compile(r"\b([A-Za-z_]\w*?(?:Functor|functor|Impl|Ops|_kernel_cuda|_cuda|_kernel|Kernel|_op))\b")
_GENERIC_BASES = {"kernel", "device_kernel", "trampoline_kernel", "kernel_entry", "global_kernel"}
_FIRST_ID = re.compile(r"<\s*([A-Za-z_][\w:]*)")


def _demangle_head(name: str) -> str:
    """`_ZN5aiter24add_rmsnorm_quant_kernelI...` -> `aiter::add_rmsnorm_quant_kernel` (names only)."""
    i = 3 if name.startswith("_ZN") else 2
    parts = []
    while i < len(name) and name[i].isdigit():
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        n = int(name[i:j])
        parts.append(name[j : j + n])
        i = j + n
        if i < len(name) and name[i] in "IE":
            break
    return "::".join(parts) if parts else name


def short_name(name: str, limit: int = 64) -> str:
    """Readable kernel name: no return type, namespaces or argument list; the functor that
    tells elementwise/reduce kernels apart is kept in <>."""
    n = name.strip()
    if n.startswith("_Z"):
        n = _demangle_head(n)
    if n.startswith("void "):
        n = n[5:]
    n = n.replace("(anonymous namespace)::", "")
    paren = n.find("(")
    signature = paren > 0 and n[paren - 1] != " "  # `f(args)`, not `Memcpy HtoD (...)`
    if "::" in n or "<" in n or signature:
        cut = len(n)
        for ch in "<(":
            k = n.find(ch)
            if 0 <= k < cut:
                cut = k
        base = n[:cut].split("::")[-1] or n[:cut]
        rest = n[cut:]
        inner = None
        if rest.startswith("<"):
            if base.lower().rstrip("0123456789_") in _GENERIC_BASES:
                # `cutlass::Kernel2<cutlass_80_tensorop_..._gemm...>`: the argument is the name.
                m = _FIRST_ID.search(rest)
                inner = m.group(1).split("::")[-1] if m else None
            else:
                found = [m for m in _INNER.findall(rest) if m != base]
                specific = [m for m in found if m not in _GENERIC]
                inner = (specific or found or [None])[0]
        n = f"{base}<{inner}>" if inner else base
    if len(n) > limit:
        n = n[: limit - 1] + "…"
    return n
