"""Numerics: computing below the task's precision (low dtypes, TF32, autocast), and RNG state."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Call, Context, src
from loom_mcp.validate.static_checks.rules import (
    AUTOCAST,
    AUTOCAST_CALLS,
    LOW_DTYPE,
    LOW_DTYPES,
    LOW_PRECISION_METHOD,
    LOW_PRECISION_METHODS,
    MATMUL_PRECISION,
    SEED_CALL,
    SEED_CALLS,
    TF32_ARG,
)


def check_attribute(ctx: Context, node: ast.Attribute, name: str | None) -> None:
    if name is not None and name in LOW_DTYPES and LOW_DTYPES[name] not in ctx.allowed_dtypes:
        ctx.report(LOW_DTYPE, node, name=name.replace("triton.language", "tl"))


def check_call(ctx: Context, call: Call) -> None:
    node, name, attr = call.node, call.name, call.attr
    if attr in LOW_PRECISION_METHODS and not node.args and LOW_PRECISION_METHODS[attr] not in ctx.allowed_dtypes:
        ctx.report(LOW_PRECISION_METHOD, node, name=attr)
    if name == "torch.set_float32_matmul_precision":
        arg = node.args[0] if node.args else None
        if not (isinstance(arg, ast.Constant) and arg.value == "highest"):
            ctx.report(MATMUL_PRECISION, node)
    if name in AUTOCAST_CALLS:
        ctx.report(AUTOCAST, node, name=name)
    for kw in node.keywords:
        low_tf32 = kw.arg == "allow_tf32" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
        tf32_precision = (
            kw.arg == "input_precision"
            and isinstance(kw.value, ast.Constant)
            and isinstance(kw.value.value, str)
            and kw.value.value.startswith("tf32")
        )
        if low_tf32 or tf32_precision:
            ctx.report(TF32_ARG, node, arg=kw.arg, value=src(kw.value))
    if name in SEED_CALLS or attr == "manual_seed":
        ctx.report(SEED_CALL, node, name=name or ".manual_seed")
