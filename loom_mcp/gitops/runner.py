"""Calling git: one subprocess helper with a clean environment and safe per-command config, and
the repository and ref lookups built on it.

Git is driven through this helper rather than gitpython's command wrapper because that wrapper
always inherits `os.environ` (a `GIT_DIR` / `GIT_INDEX_FILE` leaked from a git hook or a parent
git process would silently point commands at another repository or index, and it cannot unset
them), and because freezing needs byte-exact stdin/stdout, which its str-decoding layer gets in
the way of. gitpython is still the source of the git executable, so `GIT_PYTHON_GIT_EXECUTABLE`
applies.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loom_mcp.errors import ErrorCode, LoomError

_GIT_TIMEOUT_S = 300


# Variables git treats as repository-local (`git rev-parse --local-env-vars`). Inherited from a hook or
# a parent git process they would redirect our commands; every command here names its repo by cwd.
_REPO_LOCAL_ENV = (
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_CONFIG",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
    "GIT_OBJECT_DIRECTORY",
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_IMPLICIT_WORK_TREE",
    "GIT_GRAFT_FILE",
    "GIT_INDEX_FILE",
    "GIT_NO_REPLACE_OBJECTS",
    "GIT_REPLACE_REF_BASE",
    "GIT_PREFIX",
    "GIT_INTERNAL_SUPER_PREFIX",
    "GIT_SHALLOW_FILE",
    "GIT_COMMON_DIR",
)

# Per-command config that keeps server plumbing away from user-configured side effects: no hooks
# (a post-checkout or reference-transaction hook is user code we did not agree to run), no fsmonitor
# daemon spawned on server-owned worktrees, no split-index files written into the shared git dir,
# and no background gc/maintenance kicked off in the user's repository.
_SAFE_CONFIG = (
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "core.splitIndex=false",
    "-c", "gc.auto=0",
    "-c", "maintenance.auto=false",
)  # fmt: skip


@dataclass(frozen=True)
class _Repo:
    top: Path
    git_dir: Path
    common_dir: Path


# --------------------------------------------------------------------------------------------------
# git runner


@functools.cache
def _git_executable() -> str:
    try:
        import git  # gitpython resolves and validates the executable (GIT_PYTHON_GIT_EXECUTABLE)

        return str(git.Git.GIT_PYTHON_GIT_EXECUTABLE or "git")
    except Exception:  # a broken gitpython install should not hide a working git
        return "git"


def _git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _REPO_LOCAL_ENV}
    # Read-only commands must not refresh the user's index as a side effect.
    env["GIT_OPTIONAL_LOCKS"] = "0"
    # Paths are data, never globs: a file named `*.cu` must mean that file.
    env["GIT_LITERAL_PATHSPECS"] = "1"
    env["GIT_TERMINAL_PROMPT"] = "0"
    if extra:
        env.update(extra)
    return env


def _git(
    cwd: Path,
    *args: str,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    cmd = [_git_executable(), *_SAFE_CONFIG, *args]
    try:
        result = subprocess.run(
            cmd,
            cwd=cwd,
            input=input,
            env=_git_env(env),
            capture_output=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise LoomError(ErrorCode.TIMEOUT, f"git {args[0]} in {cwd} took more than {_GIT_TIMEOUT_S}s") from exc
    except FileNotFoundError as exc:
        raise LoomError(ErrorCode.TOOLCHAIN_MISSING, "git is not installed or not on PATH") from exc
    if check and result.returncode != 0:
        raise LoomError(ErrorCode.INTERNAL, f"git {' '.join(args[:2])} failed in {cwd}: {_err(result)}")
    return result


def _err(result: subprocess.CompletedProcess[bytes]) -> str:
    text = (result.stderr or result.stdout or b"").decode("utf-8", "replace").strip()
    return text[-2000:] or f"exit status {result.returncode}"


def _out(result: subprocess.CompletedProcess[bytes]) -> str:
    return result.stdout.decode("utf-8", "replace").strip()


def _split_z(data: bytes) -> list[str]:
    out = []
    for raw in data.split(b"\0"):
        if not raw:
            continue
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"path {raw!r} is not valid UTF-8; rename it before submitting",
            ) from exc
    return out


# --------------------------------------------------------------------------------------------------
# repository, commits, refs


def _open_repo(repo: Path | str) -> _Repo:
    path = Path(repo)
    if not path.is_dir():
        raise LoomError(ErrorCode.NOT_FOUND, f"repo {path} does not exist or is not a directory")
    refusal = f"{path} is not a git repository with a working tree"
    top, git_dir, common = _git_paths(path, "--show-toplevel", "--git-dir", "--git-common-dir", refusal=refusal)
    if top != Path(os.path.realpath(path)):
        raise LoomError(ErrorCode.BAD_INPUT, f"{path} is inside the repository {top}; pass the repository root")
    return _Repo(top=top, git_dir=git_dir, common_dir=common)


def _git_paths(cwd: Path, *which: str, refusal: str) -> list[Path]:
    """`git rev-parse --path-format=absolute <which...>` in `cwd`: the real path of each, or
    [BAD_INPUT] `refusal` with git's reason."""
    res = _git(cwd, "rev-parse", "--path-format=absolute", *which, check=False)
    lines = res.stdout.decode("utf-8", "surrogateescape").splitlines()
    if res.returncode != 0 or len(lines) != len(which):
        raise LoomError(ErrorCode.BAD_INPUT, f"{refusal}: {_err(res)}")
    return [Path(os.path.realpath(line)) for line in lines]


def _resolve_commit(cwd: Path, rev: str, what: str) -> str:
    if not rev or rev.startswith("-"):
        raise LoomError(ErrorCode.BAD_INPUT, f"{what} {rev!r} is not a commit")
    res = _git(cwd, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if res.returncode != 0:
        raise LoomError(ErrorCode.NOT_FOUND, f"{what} {rev!r} is not a commit in {cwd}")
    return _out(res)


def _branch_ref(cwd: Path, branch: str) -> str:
    name = branch.removeprefix("refs/heads/")
    ref = f"refs/heads/{name}"
    if not name or name.startswith("-") or _git(cwd, "check-ref-format", ref, check=False).returncode:
        raise LoomError(ErrorCode.BAD_INPUT, f"{branch!r} is not a valid branch name")
    return ref


def _ref_sha(cwd: Path, ref: str) -> str | None:
    res = _git(cwd, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    return _out(res) if res.returncode == 0 else None


def _config(cwd: Path, key: str) -> str | None:
    res = _git(cwd, "config", "--get", key, check=False)
    value = _out(res)
    return value if res.returncode == 0 and value else None


def _config_bool(cwd: Path, key: str, default: bool) -> bool:
    res = _git(cwd, "config", "--type=bool", "--get", key, check=False)
    return _out(res) == "true" if res.returncode == 0 else default


def campaign_tip(repo: Path, branch: str, base_commit: str) -> str:
    """The commit a new candidate stacks on: the campaign branch tip, or the base before any accept."""
    info = _open_repo(repo)
    base = _resolve_commit(info.top, base_commit, "base commit")
    return _ref_sha(info.top, _branch_ref(info.top, branch)) or base
