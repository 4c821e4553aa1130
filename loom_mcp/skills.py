"""The loom agent skills: shipped as package data (`loom_mcp/skills_data/`), copied by install."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from loom_mcp.client_config import InstallError, umask

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:  # moved to importlib.resources.abc in 3.11
        from importlib.abc import Traversable

SKILLS_PACKAGE_DIR = "skills_data"


def packaged_skills() -> Traversable:
    return resources.files("loom_mcp") / SKILLS_PACKAGE_DIR


def _walk(node: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.name.startswith(".") or child.name == "__pycache__":
            continue
        rel = f"{prefix}{child.name}"
        if child.is_dir():
            yield from _walk(child, rel + "/")
        else:
            yield rel, child


def skill_files(root: Traversable | None = None) -> dict[str, dict[str, bytes]]:
    """{skill name: {relative path: content}} for every skill directory holding a SKILL.md."""
    root = root or packaged_skills()
    if not root.is_dir():
        raise InstallError(f"the packaged skills are missing ({root}); reinstall loom-mcp")
    skills = {}
    for child in sorted(root.iterdir(), key=lambda c: c.name):
        if child.is_dir() and (child / "SKILL.md").is_file():
            skills[child.name] = {rel: f.read_bytes() for rel, f in _walk(child)}
    return skills


def _tree(path: Path) -> dict[str, bytes]:
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(path).parts)
    }


def install_skills(dest_root: Path, dry_run: bool) -> list[str]:
    notes = []
    for name, files in skill_files().items():
        dest = dest_root / name
        if dest.is_symlink():
            # Someone linked a checkout's skill here on purpose; not ours to replace.
            notes.append(f"skill {name}: {dest} is a symlink to {os.readlink(dest)}; left as is")
            continue
        if dest.is_dir() and _tree(dest) == files:
            notes.append(f"skill {name}: {dest} is up to date")
            continue
        verb = "replace" if dest.exists() else "copy"
        if dry_run:
            notes.append(f"skill {name}: would {verb} {dest}")
            continue
        dest_root.mkdir(parents=True, exist_ok=True)
        # Build beside it, then swap, so a client never reads half a skill; the staging names
        # start with a dot, which skill discovery skips.
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.new-", dir=dest_root))
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp makes it 0700; skills are not private
        try:
            for rel, content in files.items():
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            if dest.exists():
                old = dest_root / f".{name}.old-{os.getpid()}-{time.monotonic_ns()}"
                os.replace(dest, old)
                os.replace(staging, dest)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, dest)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        notes.append(
            f"skill {name}: replaced {dest} (its content differed)"
            if verb == "replace"
            else f"skill {name}: copied to {dest}"
        )
    return notes
