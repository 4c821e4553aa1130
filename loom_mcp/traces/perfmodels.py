"""FLOPs and bytes of one op call, from the shapes and dtypes the profiler recorded.

Only ops whose work is determined by their inputs are modelled; anything else returns None
rather than a guess. Bytes are the minimum traffic (each input read once, the output written
once), so achieved bandwidth derived from them is a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loom_mcp.traces.events import OpSig

DTYPE_BYTES = {
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "float": 4,
    "double": 8,
    "long int": 8,
    "long": 8,
    "int": 4,
    "unsigned int": 4,
    "short int": 2,
    "short": 2,
    "bool": 1,
    "unsigned char": 1,
    "signed char": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1,
    "c10::Float8_e8m0fnu": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "c10::complex<c10::Half>": 4,
}
# dtype -> key of DevicePeak.flops
PEAK_KEY = {
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "float": "fp32",
    "double": "fp64",
    "c10::Float8_e4m3fn": "fp8",
    "c10::Float8_e5m2": "fp8",
    "c10::Float8_e4m3fnuz": "fp8",
    "c10::Float8_e5m2fnuz": "fp8",
    "signed char": "int8",
    "unsigned char": "int8",
}
SHORT_DTYPE = {
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "float": "fp32",
    "double": "fp64",
    "long int": "i64",
    "int": "i32",
    "bool": "bool",
    "c10::Float8_e4m3fn": "fp8",
    "c10::Float8_e5m2": "fp8e5",
}


@dataclass(frozen=True)
class Work:
    flops: float | None
    bytes: float | None
    dtype: str | None  # DevicePeak.flops key of the math, e.g. "bf16"
    matrix: bool  # runs on matrix units (tensor cores / MFMA): use the matrix peak


@dataclass
class _T:
    shape: list[int]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def _tensors(sig: OpSig) -> list[_T | None]:
    """Per input: a tensor (shape, dtype) or None for scalars, lists and unknowns."""
    dims = sig.dims if isinstance(sig.dims, list) else []
    types = sig.types if isinstance(sig.types, list) else []
    out: list[_T | None] = []
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) else ""
        if t in DTYPE_BYTES and isinstance(d, list) and all(isinstance(x, int) for x in d):
            out.append(_T(list(d), t))
        else:
            out.append(None)
    return out


def _concrete(sig: OpSig, i: int) -> str | None:
    c = sig.concrete
    if isinstance(c, list) and i < len(c) and isinstance(c[i], str) and c[i] != "":
        return c[i]
    return None


def _int_list(s: str | None, n: int, default: int) -> list[int]:
    if s is None:
        return [default] * n
    try:
        v = [int(x) for x in s.strip("[]() ").split(",") if x.strip()]
    except ValueError:
        return [default] * n
    if len(v) == 1:
        v = v * n
    return v if len(v) == n else [default] * n


def _gemm(sig: OpSig, t: list[_T | None]) -> Work | None:
    name = sig.name.split("::")[-1]
    bias: _T | None = None
    if name in ("mm", "matmul", "bmm", "_scaled_mm", "mv"):
        a, b = (t + [None, None])[:2]
    elif name in ("addmm", "baddbmm", "addbmm", "addmv"):
        bias, a, b = (t + [None, None, None])[:3]
    elif name == "linear":
        a, w = (t + [None, None])[:2]
        bias = t[2] if len(t) > 2 else None
        if a is None or w is None or len(w.shape) != 2 or not a.shape:
            return None
        m = math.prod(a.shape[:-1])
        n_, k = w.shape
        flops = 2.0 * m * n_ * k + (m * n_ if bias else 0)
        nbytes = a.nbytes + w.nbytes + m * n_ * DTYPE_BYTES[a.dtype] + (bias.nbytes if bias else 0)
        return Work(flops, float(nbytes), PEAK_KEY.get(a.dtype), True)
    else:
        return None
    if a is None or b is None or not a.shape or not b.shape:
        return None
    if len(b.shape) == 1:  # matrix-vector
        m = math.prod(a.shape[:-1])
        k = a.shape[-1]
        flops = 2.0 * m * k
        out_elems = m
        batch = 1
        b_bytes = b.nbytes
    else:
        k, n_ = b.shape[-2], b.shape[-1]
        if len(a.shape) >= 3 and len(b.shape) >= 3:
            batch = math.prod(a.shape[:-2])
            m = a.shape[-2]
        else:
            batch = 1
            m = math.prod(a.shape[:-1])
        if a.shape[-1] != k:
            return None
        flops = 2.0 * batch * m * n_ * k
        out_elems = batch * m * n_
        b_bytes = b.nbytes
    elt = DTYPE_BYTES[a.dtype]
    out_elt = 2 if name == "_scaled_mm" else elt
    nbytes = a.nbytes + b_bytes + out_elems * out_elt + (bias.nbytes if bias else 0)
    if bias is not None:
        flops += out_elems
    return Work(flops, float(nbytes), PEAK_KEY.get(a.dtype), True)


# Convolution argument positions: (stride, padding, dilation, groups) in Concrete Inputs.
_CONV_ARGS = {
    "convolution": (3, 4, 5, 8),
    "_convolution": (3, 4, 5, 8),
    "conv1d": (3, 4, 5, 6),
    "conv2d": (3, 4, 5, 6),
    "conv3d": (3, 4, 5, 6),
    "cudnn_convolution": (3, 2, 4, 5),
    "miopen_convolution": (4, 3, 5, 6),
}


def _conv(sig: OpSig, t: list[_T | None]) -> Work | None:
    name = sig.name.split("::")[-1]
    pos = _CONV_ARGS.get(name)
    if pos is None or len(t) < 2 or t[0] is None or t[1] is None:
        return None
    x, w = t[0], t[1]
    if name in ("convolution", "_convolution") and _concrete(sig, 6) == "True":
        return None  # transposed convolution: output size needs output_padding; not modelled
    nsp = len(x.shape) - 2
    if nsp < 1 or len(w.shape) != nsp + 2:
        return None
    stride = _int_list(_concrete(sig, pos[0]), nsp, 1)
    pad = _int_list(_concrete(sig, pos[1]), nsp, 0)
    dil = _int_list(_concrete(sig, pos[2]), nsp, 1)
    # Groups need no special case: the weight's second dim is already C_in / groups.
    out_sp = []
    for i in range(nsp):
        k = w.shape[2 + i]
        o = (x.shape[2 + i] + 2 * pad[i] - dil[i] * (k - 1) - 1) // stride[i] + 1
        if o <= 0:
            return None
        out_sp.append(o)
    n, cout = x.shape[0], w.shape[0]
    cin_g = w.shape[1]
    flops = 2.0 * n * cout * math.prod(out_sp) * cin_g * math.prod(w.shape[2:])
    out_bytes = n * cout * math.prod(out_sp) * DTYPE_BYTES[x.dtype]
    bias = t[2] if len(t) > 2 else None
    nbytes = x.nbytes + w.nbytes + out_bytes + (bias.nbytes if bias else 0)
    return Work(flops, float(nbytes), PEAK_KEY.get(x.dtype), True)


# name -> (layout of q/k/v, index of is_causal in Concrete Inputs)
_ATTN = {
    "_flash_attention_forward": ("BSHD", 8),
    "_efficient_attention_forward": ("BSHD", None),
    "_scaled_dot_product_flash_attention": ("BHSD", 4),
    "_scaled_dot_product_efficient_attention": ("BHSD", 6),
    "_scaled_dot_product_cudnn_attention": ("BHSD", 6),
    "_cudnn_attention_forward": ("BHSD", 10),
    "scaled_dot_product_attention": ("BHSD", 5),
    "_scaled_dot_product_flash_attention_for_cpu": ("BHSD", 4),
}


def _attention(sig: OpSig, t: list[_T | None]) -> Work | None:
    name = sig.name.split("::")[-1]
    spec = _ATTN.get(name)
    if spec is None or len(t) < 3 or any(x is None for x in t[:3]):
        return None
    q, k, v = t[0], t[1], t[2]
    assert q is not None and k is not None and v is not None
    if len(q.shape) != 4 or len(k.shape) != 4:
        return None  # varlen (packed) layouts need per-sequence lengths
    layout, causal_at = spec
    if layout == "BSHD":
        b, sq, h, d = q.shape
        sk = k.shape[1]
    else:
        b, h, sq, d = q.shape
        sk = k.shape[2]
    dv = v.shape[-1]
    pairs = float(sq) * sk
    if name == "_efficient_attention_forward":
        causal = (_concrete(sig, 9) or "0") not in ("0", "")
    else:
        causal = causal_at is not None and _concrete(sig, causal_at) == "True"
    if causal and sq <= sk:
        pairs = sq * sk - sq * (sq - 1) / 2.0
    flops = 2.0 * b * h * pairs * (d + dv)
    out_bytes = b * h * sq * dv * DTYPE_BYTES[q.dtype]
    nbytes = q.nbytes + k.nbytes + v.nbytes + out_bytes
    return Work(flops, float(nbytes), PEAK_KEY.get(q.dtype), True)


_NORMS = {
    "native_layer_norm": 8,
    "layer_norm": 8,
    "rms_norm": 4,
    "_fused_rms_norm": 4,
    "native_batch_norm": 8,
    "batch_norm": 8,
    "_native_batch_norm_legit_no_training": 8,
    "native_group_norm": 8,
    "group_norm": 8,
}
_SOFTMAX = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"}
_REDUCE = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "norm",
    "linalg_vector_norm",
    "var",
    "std",
    "prod",
    "any",
    "all",
    "logsumexp",
    "var_mean",
    "std_mean",
}
# Per-element FLOPs of elementwise ops; anything transcendental counts as a few.
_ELEMENTWISE = {
    "add": 1,
    "sub": 1,
    "mul": 1,
    "div": 1,
    "neg": 1,
    "abs": 1,
    "rsub": 1,
    "reciprocal": 1,
    "maximum": 1,
    "minimum": 1,
    "clamp": 2,
    "clamp_min": 1,
    "clamp_max": 1,
    "where": 1,
    "masked_fill": 1,
    "eq": 1,
    "ne": 1,
    "lt": 1,
    "gt": 1,
    "le": 1,
    "ge": 1,
    "bitwise_and": 1,
    "bitwise_or": 1,
    "bitwise_not": 1,
    "logical_and": 1,
    "logical_or": 1,
    "logical_not": 1,
    "floor": 1,
    "ceil": 1,
    "round": 1,
    "sign": 1,
    "relu": 1,
    "threshold": 1,
    "exp": 4,
    "log": 4,
    "sqrt": 2,
    "rsqrt": 2,
    "pow": 4,
    "sin": 4,
    "cos": 4,
    "erf": 8,
    "tanh": 6,
    "sigmoid": 4,
    "gelu": 8,
    "silu": 5,
    "mish": 10,
    "softplus": 6,
    "hardtanh": 2,
    "leaky_relu": 2,
    "elu": 5,
    "hardswish": 4,
    "hardsigmoid": 3,
    "addcmul": 2,
    "addcdiv": 2,
    "lerp": 3,
    "copy": 0,
    "clone": 0,
    "_to_copy": 0,
    "to": 0,
    "contiguous": 0,
    "fill": 0,
    "zero": 0,
    "native_dropout": 2,
    "dropout": 2,
    "gelu_backward": 10,
    "silu_backward": 8,
    "threshold_backward": 1,
    "tanh_backward": 2,
    "sigmoid_backward": 2,
}


def _broadcast(shapes: list[list[int]]) -> list[int]:
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for i, x in enumerate(s):
            j = nd - len(s) + i
            out[j] = max(out[j], x)
    return out


def _elementwise(name: str, sig: OpSig, t: list[_T | None]) -> Work | None:
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    per = _ELEMENTWISE.get(base)
    tens = [x for x in t if x is not None]
    if per is None or not tens:
        return None
    inplace = name.endswith("_") or base == "copy"
    if base == "copy" and len(tens) >= 2:
        dst, src = tens[0], tens[1]
        return Work(0.0, float(src.nbytes + dst.nbytes), None, False)
    out_shape = tens[0].shape if inplace else _broadcast([x.shape for x in tens])
    # 0-dim tensors (wrapped scalars) do not take part in type promotion.
    dims = [x for x in tens if x.shape] or tens
    out_elt = max(DTYPE_BYTES[x.dtype] for x in dims)
    if base in ("eq", "ne", "lt", "gt", "le", "ge") or base.startswith("logical"):
        out_elt = 1
    numel = math.prod(out_shape) if out_shape else 1
    nbytes = sum(x.nbytes for x in tens) + numel * (DTYPE_BYTES[tens[0].dtype] if inplace else out_elt)
    return Work(float(per * numel), float(nbytes), None, False)


def model(sig: OpSig) -> Work | None:
    """FLOPs and bytes of one call of `sig`, or None when the op is not modelled."""
    name = sig.name
    short = name.split("::")[-1]
    try:
        t = _tensors(sig)
        if name.startswith("triton_"):
            # Inductor passes its input and output buffers as arguments: their sum is the
            # minimum traffic. The math is unknown (a fusion), so no FLOPs.
            tens = [x for x in t if x is not None]
            if not tens:
                return None
            return Work(None, float(sum(x.nbytes for x in tens)), None, False)
        if not name.startswith("aten::"):
            return None
        w = _gemm(sig, t) or _conv(sig, t) or _attention(sig, t)
        if w is not None:
            return w
        x = t[0] if t else None
        if short in _NORMS and x is not None:
            params = sum(p.nbytes for p in t[1:] if p is not None)
            return Work(float(_NORMS[short] * x.numel), float(2 * x.nbytes + params), None, False)
        if short in _SOFTMAX and x is not None:
            return Work(5.0 * x.numel, float(2 * x.nbytes), None, False)
        if short in _REDUCE and x is not None:
            return Work(float(x.numel), float(x.nbytes), None, False)
        if short in ("index_select", "embedding") and len(t) >= 2:
            table = t[0]
            idx = t[2] if short == "index_select" and len(t) > 2 else t[1]
            if table is None or idx is None or len(table.shape) < 2:
                return None
            row = math.prod(table.shape[1:]) * DTYPE_BYTES[table.dtype]
            return Work(0.0, float(2 * idx.numel * row + idx.nbytes), None, False)
        return _elementwise(short, sig, t)
    except (ArithmeticError, IndexError, KeyError, TypeError, ValueError):
        return None


def shapes_label(sig: OpSig, limit: int = 44) -> str:
    """`[8944,1024]x[1024,1024] bf16`: tensor inputs only."""
    t = [x for x in _tensors(sig) if x is not None]
    if not t:
        return ""
    s = "x".join("[" + ",".join(str(d) for d in x.shape) + "]" for x in t)
    dt = SHORT_DTYPE.get(t[0].dtype, t[0].dtype)
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return f"{s} {dt}"


def dtype_of(sig: Any) -> str | None:
    t = [x for x in _tensors(sig) if x is not None]
    return t[0].dtype if t else None
