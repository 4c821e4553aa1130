"""Kernel categories and short display names.

The kernel name decides first (it is what actually ran); the launching op's name is only a
fallback for kernels whose names say nothing (vendor GEMMs named by tile shapes are caught by
name, but a bare `kernel_0` launched under `aten::mm` is still a GEMM).
"""

from __future__ import annotations

import re

from loom_mcp.traces.events import KIND_KERNEL

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


def _re(p: str) -> re.Pattern[str]:
    return re.compile(p, re.IGNORECASE)


# Ordered: the first match wins. Communication and copies first (they are timed separately in
# the timeline); attention and MoE before GEMM because their kernels often contain GEMM words
# (flash kernels are templated on cutlass types, MoE kernels are grouped GEMMs).
_KERNEL_RULES: list[tuple[str, re.Pattern[str]]] = [
    (
        COMM,
        _re(
            r"nccl|rccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|cross_device_reduce|"
            r"multimem|custom_?ar|sendrecv|msccl|quickreduce|one_?shot_all|two_?shot_all"
        ),
    ),
    (MEMCPY, _re(r"__amd_rocclr_(copy|fill)|copyBuffer|fillBuffer|^memcpy|^memset")),
    (TRITON, re.compile(r"^triton_")),
    (
        ATTENTION,
        _re(
            r"flash|fmha|attn|attention|sdpa|_mha|mha_|paged_?atten|xformers|flashinfer|"
            r"decode_?atten|mla_|_mla|unified_atten|context_atten|prefill_atten"
        ),
    ),
    (MOE, _re(r"moe|expert|topk_gating|grouped_?gemm|permute_tokens|moe_align|fused_moe")),
    (
        GEMM,
        _re(
            r"gemm|gemv|cublas|nvjet|xmma|^Cijk_|matmul|wgmma|tensorop|s16816|hgemm|sgemm|"
            r"igemm|implicit_?gemm|winograd|convolution|conv[123]d|_conv_|conv_fwd|conv_bwd|"
            r"splitKreduce|hipblaslt|cutlass::Kernel|ck::.*Gemm|_mm_|bmm_|cutlass_\d+"
        ),
    ),
    (
        NORM,
        _re(
            r"layer_?norm|rms_?norm|batch_?norm|group_?norm|instance_?norm|l2_?norm|"
            r"GammaBeta|norm_kernel|_norm_|fused_add_rms|lpnorm"
        ),
    ),
    (QUANT, _re(r"quant|fp8|fp4|e4m3|e5m2|mxfp|nvfp4|marlin|awq|gptq|int4|int8")),
    (ELEMENTWISE, _re(r"elementwise|vectorized_|unrolled_|pointwise")),
    (
        REDUCTION,
        _re(
            r"reduce|softmax|argmax|argmin|topk|top_k|sort|scan|cumsum|cumprod|radix|"
            r"segmented|histogram|logsumexp|cross_entropy|nll_loss|sum_kernel|mean_kernel"
        ),
    ),
    (
        ELEMENTWISE,
        _re(
            r"copy|fill|cat_?array|CatArray|index|gather|scatter|transpose|permute|"
            r"dropout|activation|act_and_mul|silu|gelu|relu|sigmoid|tanh|rotary|rope|"
            r"embedding|where|masked|clamp|arange|pad|upsample|pool|multi_tensor_apply|"
            r"bitwise|compare|TensorOp|kv_?cache|store_kv|clamp_position|resolve_future|"
            r"cast|convert|add_kernel|mul_kernel"
        ),
    ),
]

_OP_RULES: list[tuple[str, re.Pattern[str]]] = [
    (COMM, _re(r"nccl|c10d|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast_")),
    (ATTENTION, _re(r"attention|flash|sdpa|_attn")),
    (MOE, _re(r"moe|expert")),
    (
        GEMM,
        _re(
            r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv|conv|"
            r"convolution|_convolution|cudnn_convolution|miopen_convolution)"
        ),
    ),
    (NORM, _re(r"norm")),
    (QUANT, _re(r"quant")),
    (
        REDUCTION,
        _re(
            r"softmax|^aten::(sum|mean|amax|amin|max|min|argmax|argmin|topk|sort|cumsum|"
            r"prod|var|std|any|all|logsumexp)\b"
        ),
    ),
    (ELEMENTWISE, _re(r"^aten::")),
]


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
_INNER = re.compile(
    r"\b([A-Za-z_]\w*?(?:Functor|functor|Impl|Ops|_kernel_cuda|_cuda|_kernel|Kernel|_op))\b"
)
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
