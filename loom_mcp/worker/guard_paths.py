"""Where the worker's audit hook (loom_mcp.worker.guard) looks for trusted code: the standard
library, the installed packages (loom_mcp included) and the compilers' caches, each as written and
as resolved, with paths folded by text alone.

Standard library only: imported by workers before torch, with the guard.
"""

from __future__ import annotations

import os
from pathlib import Path


def _real(path: str) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return path


def _lexical(path: str) -> str:
    """An absolute path with '.', '..' and repeated slashes folded, by text alone."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def _roots() -> tuple[list[str], list[str]]:
    """(standard-library directories, installed-package directories), each as written and as
    resolved."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    packages = {paths.get("purelib"), paths.get("platlib")}
    try:
        packages.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    packages.add(getattr(site, "getusersitepackages", lambda: None)())
    packages.add(str(Path(__file__).resolve().parents[1]))  # loom_mcp itself
    stdlib = {paths.get("stdlib"), paths.get("platstdlib")}

    def forms(roots) -> list[str]:
        return sorted({_lexical(f) for r in roots if r for f in (os.path.abspath(r), _real(r))})

    return forms(stdlib), forms(packages)


def _cache_roots() -> list[str]:
    """Where compilers write the modules they generate (never the candidate's own files)."""
    import getpass
    import tempfile

    roots = [os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR")]
    home = os.path.expanduser("~")
    roots += [os.path.join(home, ".triton"), os.path.join(home, ".cache")]
    try:
        user = getpass.getuser()
    except Exception:
        user = ""
    roots.append(os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
    return sorted({_lexical(f) for r in roots if r for f in (os.path.abspath(r), _real(r))})
