"""Reaching past the process or past these checks: files, sockets and serialized caches, and code
built or loaded at run time where these checks cannot read it.

The one file access allowed is reading one of the file's declared SOURCES, named from
`__file__` and literals (declared.py says which spellings): `.read_text()`, `.read_bytes()`,
`.open()` or `open()` for reading. Any other path method or open() is an error, whatever the
receiver, as is any write to a declared source."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Call, Context, root, src
from loom_mcp.validate.static_checks.rules import (
    COMPUTED_GETATTR,
    DYNAMIC_CALL,
    DYNAMIC_CALLS,
    GUARDED_ROOTS,
    IO_CALL,
    IO_CALLS,
    IO_WARNING_CALL,
    IO_WARNING_CALLS,
    IO_WARNING_PREFIXES,
    OPEN_CALL,
    PATH_IO,
    PATH_IO_METHODS,
    SOURCE_READS,
    SOURCE_WRITE,
    TOFILE,
)


def check_call(ctx: Context, call: Call) -> None:
    _check_io(ctx, call)
    _check_dynamic(ctx, call)


def _check_io(ctx: Context, call: Call) -> None:
    node, name, func = call.node, call.name, call.node.func
    if name == "builtins.open":
        _check_open(ctx, node)
    elif name in IO_CALLS or (name.endswith(".?") and name.split(".", 1)[0] in ("os", "io", "shutil")):
        # The second form: a function of os/io/shutil fetched by a computed name (getattr).
        ctx.report(IO_CALL, node, name=name.removeprefix("builtins."))
    elif name in IO_WARNING_CALLS or name.startswith(IO_WARNING_PREFIXES):
        ctx.report(IO_WARNING_CALL, node, name=name)
    elif call.attr in PATH_IO_METHODS and isinstance(func, ast.Attribute):
        _check_path_method(ctx, node, func)
    elif name.startswith("pathlib.") and name.rsplit(".", 1)[-1] in PATH_IO_METHODS:  # Path.read_text(p)
        ctx.report(PATH_IO, node, name=name.rsplit(".", 1)[-1], path="a path passed as an argument")
    if call.attr == "tofile":
        ctx.report(TOFILE, node)


def _check_path_method(ctx: Context, node: ast.Call, func: ast.Attribute) -> None:
    """`path.method(...)` on any receiver: a read of a declared source, or an error."""
    source = ctx.sources.source(func.value)
    if source is None:
        ctx.report(PATH_IO, node, name=func.attr, path=src(func.value))
    elif func.attr == "open":
        _check_mode(ctx, node, source, _argument(node, 0, "mode"), ".open()")
    elif func.attr not in SOURCE_READS:
        ctx.report(SOURCE_WRITE, node, what=f".{func.attr}()", source=source)
    elif node.args:  # read_text()/read_bytes() take no positional argument: a swapped-in writer would
        ctx.report(SOURCE_WRITE, node, what=f".{func.attr}(...) with a positional argument", source=source)


def _check_open(ctx: Context, node: ast.Call) -> None:
    """open(path, mode): a read of a declared source, or an error."""
    path = _argument(node, 0, "file")
    source = ctx.sources.source(path) if path is not None else None
    # open()'s eighth positional argument is the opener, which may hand back any descriptor.
    if source is None or len(node.args) > 7 or any(k.arg == "opener" for k in node.keywords):
        ctx.report(OPEN_CALL, node, path=src(path) if path is not None else "a computed path")
    else:
        _check_mode(ctx, node, source, _argument(node, 1, "mode"), "open()")


def _check_mode(ctx: Context, node: ast.Call, source: str, mode: ast.expr | None, what: str) -> None:
    """Opening a declared source: only for reading, with a literal mode ('r', 'rb', 'rt')."""
    if mode is None and not _spread(node):
        return
    text = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else None
    if text is None or "r" not in text or not set(text) <= set("rbt"):
        ctx.report(SOURCE_WRITE, node, what=f"{what} with mode {src(mode) if mode else 'unknown'}", source=source)


def _argument(node: ast.Call, index: int, keyword: str) -> ast.expr | None:
    """The call's argument at `index` or named `keyword`, where written out."""
    if len(node.args) > index and not any(isinstance(a, ast.Starred) for a in node.args[: index + 1]):
        return node.args[index]
    return next((k.value for k in node.keywords if k.arg == keyword), None)


def _spread(node: ast.Call) -> bool:
    """Whether arguments come from *args or **kwargs, which could carry anything."""
    return any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)


def _check_dynamic(ctx: Context, call: Call) -> None:
    node, name = call.node, call.name
    if name in DYNAMIC_CALLS:
        ctx.report(DYNAMIC_CALL, node, name=name.removeprefix("builtins."))
    if name == "builtins.getattr" and len(node.args) >= 2:
        base = ctx.chain(node.args[0]) or ""
        attr = node.args[1]
        if root(base) in GUARDED_ROOTS and not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
            ctx.report(COMPUTED_GETATTR, node, name=base)
