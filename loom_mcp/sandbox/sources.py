"""The files a candidate is made of: itself, and the sibling sources its `SOURCES` lists.

A candidate may keep its CUDA source, headers or Python helpers beside it:

    SOURCES = ["gemv.cu", "gemv.h", "launch_policy.py"]

Paths are relative to the candidate's directory, below it, regular files reached through no
symlink. A job sees exactly these files of that directory (nothing else the agent keeps there),
and they are hashed with the candidate wherever its bytes identify evidence (the validation
reuse key, the compile cache) and frozen with it on submit. An undeclared sibling is not there
to import, so evidence of one version cannot be reused for another.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path, PurePosixPath

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox import safefs

MAX_SOURCES = 64
SOURCES_NAME = "SOURCES"
# What a candidate may declare besides Python: source text for compilers, which the static
# checks scan as they scan inline native sources.
NATIVE_SUFFIXES = frozenset({".cu", ".cuh", ".h", ".hpp", ".c", ".cc", ".cpp", ".hip", ".inc"})
# Source text only: Python the static checks read, and what compilers read. Bytecode and
# binaries (.pyc, .so) would run code nothing checked, under names that hide where it came from.
SOURCE_SUFFIXES = NATIVE_SUFFIXES | {".py"}
MAX_NAME_BYTES = 255


def sources_statement(tree: ast.Module) -> ast.Assign | ast.AnnAssign | None:
    """The first module-level statement that binds SOURCES, if any."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == SOURCES_NAME for t in stmt.targets):
            return stmt
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == SOURCES_NAME:
            return stmt
    return None


def literal_sources(stmt: ast.Assign | ast.AnnAssign) -> list[str] | None:
    """The statement's value when it is a literal list or tuple of strings, else None."""
    try:
        value = ast.literal_eval(stmt.value) if stmt.value is not None else None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _declared_names(code: Path) -> list[str]:
    """SOURCES as the static checks read it too (validate/static_checks/declared.py uses the
    two functions above: they never disagree)."""
    if code.suffix != ".py":
        return []
    try:
        tree = ast.parse(safefs.read_resolved_bytes(code).decode("utf-8"), filename=str(code))
    except (SyntaxError, ValueError):  # not UTF-8, or not Python: the candidate's own checks say so
        return []
    stmt = sources_statement(tree)
    if stmt is None:
        return []
    value = literal_sources(stmt)
    if value is None:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{code}:{stmt.lineno}: {SOURCES_NAME} must be a literal list of relative paths "
            '(e.g. SOURCES = ["gemv.cu", "gemv.h"])',
        )
    return value


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: a file name that is not UTF-8
        return False
    return True


def declared_sources(code: Path) -> list[Path]:
    """The sibling sources `code` declares, checked: relative, below its directory, regular
    files through no symlink, at most MAX_SOURCES of them. `code` is resolved and checked."""
    names = _declared_names(code)
    if len(names) > MAX_SOURCES:
        raise LoomError(ErrorCode.BAD_INPUT, f"{code}: {SOURCES_NAME} lists {len(names)} files; at most {MAX_SOURCES}")
    found: list[Path] = []
    for name in names:
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts or str(rel) in (".", ""):
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{code}: {SOURCES_NAME} entry {name[:200]!r} must be a path below the candidate's directory",
            )
        if (
            "\x00" in name
            or not name.isprintable()
            or not _encodable(name)
            or len(name.encode("utf-8", "replace")) > 1024
        ):
            raise LoomError(
                ErrorCode.BAD_INPUT, f"{code}: {SOURCES_NAME} entry {name[:200]!r} is not a plain file name"
            )
        if any(len(part.encode()) > MAX_NAME_BYTES for part in rel.parts):
            raise LoomError(ErrorCode.BAD_INPUT, f"{code}: {SOURCES_NAME} entry {name[:200]!r}: a name is too long")
        if rel.suffix not in SOURCE_SUFFIXES:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{code}: {SOURCES_NAME} entry {name[:200]!r}: only source files are declared "
                f"({', '.join(sorted(SOURCE_SUFFIXES))})",
            )
        path = code.parent / rel
        try:
            safefs.check_resolved_file(path, safefs.MAX_SOURCE_BYTES)
        except LoomError as exc:  # missing, a link, not a regular file, too big
            raise LoomError(exc.code, f"{SOURCES_NAME} of {code}: {exc.message}") from exc
        except OSError as exc:
            raise LoomError(ErrorCode.BAD_INPUT, f"{SOURCES_NAME} of {code}: {path}: {exc.strerror}") from exc
        if path != code and path not in found:
            found.append(path)
    return found


def code_files(code: Path) -> list[Path]:
    """`code` and its declared sources: what a job running it may read of its directory."""
    return [code, *declared_sources(code)]


def code_digest(code: Path) -> str:
    """sha256 over `code`'s bytes and each declared source's name and bytes. For a candidate that
    declares none it is the file's own sha256, so earlier keys stay valid."""
    own = safefs.read_resolved_bytes(code)
    sources = declared_sources(code)
    if not sources:
        return hashlib.sha256(own).hexdigest()
    h = hashlib.sha256(own)
    for path in sources:
        data = safefs.read_resolved_bytes(path)
        rel = path.relative_to(code.parent).as_posix().encode()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def snapshot(code: Path, into: Path) -> Path:
    """Copies of `code` and its declared sources, in their places below `into` (a new directory
    only the server writes), and the copy of `code`. A job then runs exactly the bytes that are
    hashed and recorded: an agent's file swapped while its validation runs changes neither."""
    into.mkdir(parents=True, exist_ok=False)
    for path in code_files(code):
        rel = path.relative_to(code.parent)
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        safefs.write_bytes(into, rel.as_posix(), safefs.read_resolved_bytes(path))
    return into / code.name
