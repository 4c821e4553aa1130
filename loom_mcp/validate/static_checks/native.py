"""String constants: inline C++/CUDA/HIP sources (threads, streams, files, timers and pointer
caches in native code), hook names, and paths that stash results outside the process."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Context
from loom_mcp.validate.static_checks.rules import (
    IO_PATH,
    IO_PATH_MARKERS,
    NATIVE_PATTERNS,
    NATIVE_SOURCE,
    POINTER_KEY_TYPE,
    STATIC_MAP,
    STATIC_MAP_WINDOW,
    STATIC_POINTER_MAP,
    SUBCLASS_HOOK_NAMED,
    SUBCLASS_HOOKS,
)


def check_string(ctx: Context, node: ast.Constant) -> None:
    if not isinstance(node.value, str):
        return
    text = node.value
    if text in SUBCLASS_HOOKS:
        ctx.report(SUBCLASS_HOOK_NAMED, node, name=text)
    if NATIVE_SOURCE.search(text):
        _check_native_source(ctx, node, text)
        return
    for marker in IO_PATH_MARKERS:  # inside native source the patterns judge paths
        if marker in text:
            ctx.report(IO_PATH, node, name=marker)


def _check_native_source(ctx: Context, node: ast.Constant, text: str) -> None:
    check_native_text(ctx, text, node.lineno)


def check_native_text(ctx: Context, text: str, start: int) -> None:
    """C++/CUDA/HIP source that starts at line `start`: an inline string, or a declared file."""
    if "__global__" in text:
        ctx.kernel_evidence = True
    for pattern, rule in NATIVE_PATTERNS:
        for m in pattern.finditer(text):
            ctx.report(rule, start + text.count("\n", 0, m.start()), token=m.group(0))
    for m in STATIC_MAP.finditer(text):
        window = text[m.start() : m.start() + STATIC_MAP_WINDOW]
        if POINTER_KEY_TYPE.search(window):
            ctx.report(STATIC_POINTER_MAP, start + text.count("\n", 0, m.start()))
