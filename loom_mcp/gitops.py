"""Git operations for submissions: freeze the agent's change, judge it in a server-owned worktree,
and on accept commit it to `loom/<campaign>` with a compare-and-swap on the branch.

The user's checkout is read-only to this module: nothing here writes the user's HEAD, branch, index
or working-tree files. Writes go only to (a) objects in the shared object store, (b) `refs/heads/loom/*`
and its reflog, and (c) linked worktrees under a server-owned directory plus their admin entries in
`<common-dir>/worktrees/`.

Git is driven through one small subprocess helper rather than gitpython's command wrapper because
that wrapper always inherits `os.environ` (a `GIT_DIR` / `GIT_INDEX_FILE` leaked from a git hook or a
parent git process would silently point commands at another repository or index, and it cannot unset
them), and because freezing needs byte-exact stdin/stdout, which its str-decoding layer gets in the
way of. gitpython is still the source of the git executable, so `GIT_PYTHON_GIT_EXECUTABLE` applies.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import orjson
from pydantic import BaseModel, ConfigDict, Field

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox import safefs

# A binary file above this is almost certainly a build output or dataset, not a kernel change.
MAX_BINARY_BYTES = 5 * 1024 * 1024
# The frozen change lives in memory and in the ledger; bound it so a stray log cannot blow either up.
MAX_CHANGE_BYTES = 64 * 1024 * 1024

LOOM_NAME = "loom-mcp"
LOOM_EMAIL = "loom@localhost"

_GIT_TIMEOUT_S = 300
_META_FILE = "loom-submission.json"
_MODE_FILE = "100644"
_MODE_EXEC = "100755"
_MODE_LINK = "120000"
_MODE_GITLINK = "160000"
_SUBMISSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TRAILER_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")

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


class FrozenChange(BaseModel):
    """An immutable snapshot of the agent's change, read from the working tree at submit time.

    `files` maps repo-relative posix paths to the new content (None = deleted). Content is UTF-8 text
    for text files. Three optional lists refine that without changing the primary contract:
    `binary` (value is base64 of the raw bytes: a NUL byte or invalid UTF-8), `symlinks` (value is
    the link target) and `executable` (written with mode 100755). Use `entry()` for raw bytes.
    """

    model_config = ConfigDict(frozen=True)

    files: dict[str, str | None]
    patch: str
    digest: str
    base_commit: str = ""
    binary: list[str] = Field(default_factory=list)
    executable: list[str] = Field(default_factory=list)
    symlinks: list[str] = Field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return sorted(self.files)

    def entry(self, path: str) -> tuple[str, bytes] | None:
        """(git mode, raw bytes) for `path`, or None when the change deletes it."""
        value = self.files[path]
        if value is None:
            return None
        if path in self.symlinks:
            return _MODE_LINK, value.encode("utf-8")
        data = base64.b64decode(value) if path in self.binary else value.encode("utf-8")
        return (_MODE_EXEC if path in self.executable else _MODE_FILE), data

    def content_bytes(self, path: str) -> bytes | None:
        found = self.entry(path)
        return None if found is None else found[1]


class BranchMoved(LoomError):
    """The campaign branch is not where the caller said it was; nothing was written to it."""

    def __init__(self, ref: str, expected: str, actual: str | None, detail: str) -> None:
        super().__init__(ErrorCode.INTERNAL, detail)
        self.ref = ref
        self.expected = expected
        self.actual = actual


class _SubmissionMeta(BaseModel):
    """Stored in the worktree's admin dir, so it disappears with the worktree."""

    version: int = 1
    submission_id: str
    start_commit: str
    tree: str
    digest: str
    paths: list[str]


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
        raise LoomError(
            ErrorCode.TIMEOUT, f"git {args[0]} in {cwd} took more than {_GIT_TIMEOUT_S}s"
        ) from exc
    except FileNotFoundError as exc:
        raise LoomError(ErrorCode.TOOLCHAIN_MISSING, "git is not installed or not on PATH") from exc
    if check and result.returncode != 0:
        raise LoomError(
            ErrorCode.INTERNAL, f"git {' '.join(args[:2])} failed in {cwd}: {_err(result)}"
        )
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
    res = _git(
        path,
        "rev-parse",
        "--path-format=absolute",
        "--show-toplevel",
        "--git-dir",
        "--git-common-dir",
        check=False,
    )
    lines = res.stdout.decode("utf-8", "surrogateescape").splitlines()
    if res.returncode != 0 or len(lines) != 3:
        raise LoomError(
            ErrorCode.BAD_INPUT, f"{path} is not a git repository with a working tree: {_err(res)}"
        )
    top, git_dir, common = (Path(line) for line in lines)
    if os.path.realpath(top) != os.path.realpath(path):
        raise LoomError(
            ErrorCode.BAD_INPUT, f"{path} is inside the repository {top}; pass the repository root"
        )
    return _Repo(
        top=Path(os.path.realpath(top)),
        git_dir=Path(os.path.realpath(git_dir)),
        common_dir=Path(os.path.realpath(common)),
    )


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
    if (
        not name
        or name.startswith("-")
        or _git(cwd, "check-ref-format", ref, check=False).returncode
    ):
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


# --------------------------------------------------------------------------------------------------
# freezing


@dataclass
class _Frozen:
    mode: str
    data: bytes


def _repo_relative(info: _Repo, raw: str | os.PathLike[str]) -> str:
    text = os.fspath(raw)
    if not text or "\0" in text:
        raise LoomError(ErrorCode.BAD_INPUT, f"path {text!r} is empty or malformed")
    path = Path(text)
    if path.is_absolute():
        norm = Path(os.path.normpath(path))
        try:
            rel = norm.relative_to(info.top)
        except ValueError:
            # The repo may have been named through a symlinked prefix (/tmp vs /private/tmp).
            try:
                rel = Path(os.path.realpath(norm.parent)).relative_to(info.top) / norm.name
            except ValueError:
                raise LoomError(
                    ErrorCode.BAD_INPUT, f"path {text} is outside the repository {info.top}"
                ) from None
        rel_text = rel.as_posix()
    else:
        rel_text = os.path.normpath(text).replace(os.sep, "/")
    parts = PurePosixPath(rel_text).parts
    if not parts or rel_text in (".", "") or parts[0] == "..":
        raise LoomError(ErrorCode.BAD_INPUT, f"path {text!r} is outside the repository {info.top}")
    if any(part.lower() == ".git" for part in parts):
        raise LoomError(
            ErrorCode.BAD_INPUT, f"path {text!r} is inside .git; submit source files only"
        )
    return "/".join(parts)


def _check_no_symlinked_parent(top: Path, rel: str, what: str) -> None:
    # Git never tracks a path beyond a symlink, and following one could read or write outside `top`.
    parent = PurePosixPath(rel).parent
    current = top
    for part in parent.parts:
        current = current / part
        if current.is_symlink():
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"path {rel!r} goes through the symlink {part!r} in {what}; name the real path",
            )


def _read_entry(
    info: _Repo, rel: str, filemode: bool, base_mode: str | None
) -> _Frozen | None | str:
    """The working-tree state of `rel`: _Frozen, None if absent, or a reason string to skip it."""
    _check_no_symlinked_parent(info.top, rel, "the repository")
    full = info.top / rel
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(full)
        resolved = Path(os.path.realpath(full))
        if resolved != info.top and info.top not in resolved.parents:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{rel!r} is a symlink to {target!r}, outside the repository; "
                "pass explicit paths that leave it out",
            )
        return _Frozen(_MODE_LINK, os.fsencode(target))
    if stat.S_ISDIR(st.st_mode):
        return "a directory (a submodule or nested repository?)"
    if not stat.S_ISREG(st.st_mode):
        raise LoomError(ErrorCode.BAD_INPUT, f"{rel!r} is not a regular file")
    if st.st_size > MAX_CHANGE_BYTES:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{rel!r} is {st.st_size} bytes, over the {MAX_CHANGE_BYTES} byte limit for a change; "
            "gitignore it or pass explicit paths",
        )
    # The path was a regular file at lstat; opened beneath the top with no link followed on the
    # way (a directory swapped for a link since the check above is refused too), as a regular
    # file within the size limit. Hard links are the user's business in their own repository.
    with safefs.open_read(info.top, rel, max_bytes=MAX_CHANGE_BYTES, allow_hardlinks=True) as f:
        data = f.read(MAX_CHANGE_BYTES + 1)
        mode_bits = os.fstat(f.fileno()).st_mode
    if len(data) > MAX_CHANGE_BYTES:
        raise LoomError(ErrorCode.BAD_INPUT, f"{rel!r} grew past {MAX_CHANGE_BYTES} bytes")
    if filemode:
        executable = bool(mode_bits & stat.S_IXUSR)
    else:
        # core.fileMode=false: the filesystem's x bit is meaningless; keep what git recorded.
        executable = base_mode == _MODE_EXEC
    return _Frozen(_MODE_EXEC if executable else _MODE_FILE, data)


def _is_binary(data: bytes) -> bool:
    if b"\0" in data:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _ls_tree(cwd: Path, commit: str, rels: Iterable[str]) -> dict[str, tuple[str, str]]:
    """{path: (mode, object id)} in `commit` for those of `rels` that are present."""
    rels = list(rels)
    found: dict[str, tuple[str, str]] = {}
    for i in range(0, len(rels), 500):  # bounded argv
        res = _git(cwd, "ls-tree", "-z", "--full-tree", commit, "--", *rels[i : i + 500])
        for record in res.stdout.split(b"\0"):
            if not record:
                continue
            meta, _, name = record.partition(b"\t")
            mode, _kind, oid = meta.decode().split(" ")
            found[name.decode("utf-8", "surrogateescape")] = (mode, oid)
    return found


def _changed_paths(info: _Repo, base: str) -> list[str]:
    """Tracked paths whose working-tree state may differ from `base`, plus untracked non-ignored files.

    Plumbing only: `git status` / `git diff` may rewrite the user's index to refresh stat data. The
    list can contain stat-only changes; the caller compares content.
    """
    diff = _git(info.top, "diff-index", "-z", "--name-only", "--no-renames", base, "--")
    untracked = _git(info.top, "ls-files", "-z", "--others", "--exclude-standard")
    # A nested repository shows up as "dir/": it is not a file we can freeze.
    candidates = {
        p for p in _split_z(diff.stdout) + _split_z(untracked.stdout) if not p.endswith("/")
    }
    missing = sorted(p for p in candidates if not os.path.lexists(info.top / p))
    if missing:
        # Sparse checkout: a skip-worktree entry is absent on disk on purpose, not deleted.
        listed = _git(info.top, "ls-files", "-t", "-z", "--", *missing).stdout
        for record in _split_z(listed):
            tag, _, name = record.partition(" ")
            if tag == "S":
                candidates.discard(name)
    return sorted(candidates)


def _ignored(cwd: Path, rels: list[str]) -> set[str]:
    if not rels:
        return set()
    # check-ignore rejects the 'literal' pathspec magic (git 2.39); its --stdin paths are plain names.
    res = _git(
        cwd,
        "check-ignore",
        "-z",
        "--stdin",
        input=b"\0".join(r.encode() for r in rels) + b"\0",
        env={"GIT_LITERAL_PATHSPECS": "0"},
        check=False,
    )
    if res.returncode not in (0, 1):
        raise LoomError(ErrorCode.INTERNAL, f"git check-ignore failed: {_err(res)}")
    return set(_split_z(res.stdout))


def change_digest(
    files: Mapping[str, str | None],
    binary: Iterable[str] = (),
    executable: Iterable[str] = (),
    symlinks: Iterable[str] = (),
) -> str:
    """sha256 over the sorted (path, content) pairs, as JSON; the identity of a change.

    For a plain text change this is exactly `sha256(orjson.dumps(sorted(files.items())))`, so a
    caller building a FrozenChange by hand gets the same digest. The binary/executable/symlink lists
    join the hash only when present, since they change what the same strings mean.
    """
    payload: list = sorted(files.items())
    binary, executable, symlinks = sorted(binary), sorted(executable), sorted(symlinks)
    if binary or executable or symlinks:
        payload = [payload, binary, executable, symlinks]
    return hashlib.sha256(orjson.dumps(payload)).hexdigest()


def _entries_of(change: FrozenChange) -> dict[str, _Frozen | None]:
    out: dict[str, _Frozen | None] = {}
    for rel in change.files:
        found = change.entry(rel)
        out[rel] = None if found is None else _Frozen(*found)
    return out


def _refuse_nested_repositories(info: _Repo, base: str, rels: list[str]) -> None:
    """[BAD_INPUT] for a path inside a submodule or another repository nested in this one: its
    files belong to that repository, and a commit here could only record a pointer to it."""
    ancestors = sorted({"/".join(PurePosixPath(rel).parts[:i]) for rel in rels
                        for i in range(1, len(PurePosixPath(rel).parts))})
    gitlinks = {a for a, (mode, _) in _ls_tree(info.top, base, ancestors).items() if mode == _MODE_GITLINK}
    nested = gitlinks | {a for a in ancestors if os.path.lexists(info.top / a / ".git")}
    for rel in rels:
        inside = [a for a in nested if rel.startswith(a + "/")]
        if inside:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{rel!r} is inside {min(inside)!r}, a git submodule or nested repository: a campaign "
                "commits to its own repository only; put the candidate in the campaign repository "
                "(outside the submodule), or start a campaign on the submodule's repository",
            )


def freeze_change(repo: Path, base_commit: str, paths: list[str] | None) -> FrozenChange:
    """Snapshot the change between `base_commit` and the working tree, reading file bytes now.

    `paths` None means every path that differs (tracked modifications and deletions, untracked
    non-ignored files). Explicit paths may be repo-relative or absolute inside the repo; listed paths
    whose content equals the base are dropped. Nothing in the user's repository is written: blobs for
    the patch go to a throwaway object directory and a throwaway index.
    """
    info = _open_repo(repo)
    base = _resolve_commit(info.top, base_commit, "base commit")
    explicit = paths is not None
    rels = (
        sorted({_repo_relative(info, p) for p in paths})
        if paths is not None
        else _changed_paths(info, base)
    )
    base_tree = _ls_tree(info.top, base, rels)
    if explicit:
        _refuse_nested_repositories(info, base, rels)
    filemode = _config_bool(info.top, "core.filemode", default=True)

    states: dict[str, _Frozen | None] = {}
    for rel in rels:
        base_entry = base_tree.get(rel)
        if base_entry is not None and base_entry[0] in (_MODE_GITLINK, "040000"):
            if explicit:
                raise LoomError(
                    ErrorCode.BAD_INPUT, f"{rel!r} is a directory or submodule; list files instead"
                )
            continue  # submodule pointer changes cannot be frozen as file content
        state = _read_entry(info, rel, filemode, base_entry[0] if base_entry else None)
        if isinstance(state, str):
            if base_entry is not None:
                state = None  # a file of the base replaced by a directory: the file is deleted
            elif explicit:
                raise LoomError(ErrorCode.BAD_INPUT, f"{rel!r} is {state}; list files instead")
            else:
                continue
        if state is None and base_entry is None:
            if explicit:
                raise LoomError(
                    ErrorCode.BAD_INPUT,
                    f"{rel!r} exists neither in the working tree nor in the base commit",
                )
            continue
        states[rel] = state

    if explicit:
        new_files = [r for r, s in states.items() if s is not None and r not in base_tree]
        ignored = _ignored(info.top, new_files)
        if ignored:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{sorted(ignored)} are ignored by .gitignore and would not be committed; "
                "un-ignore them or leave them out",
            )

    with tempfile.TemporaryDirectory(prefix="loom-freeze-") as tmp:
        objects = Path(tmp) / "objects"
        objects.mkdir()
        # Blobs land in a private object dir that borrows the repo's objects read-only.
        scratch = {
            "GIT_OBJECT_DIRECTORY": str(objects),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(info.common_dir / "objects"),
            "GIT_INDEX_FILE": str(Path(tmp) / "index"),
        }
        changed: dict[str, _Frozen | None] = {}
        oids: dict[str, str] = {}
        for rel, state in states.items():
            base_entry = base_tree.get(rel)
            if state is None:
                changed[rel] = None
                continue
            # --path applies the clean filters (eol, ident, ...) `git add` would, so stat-only and
            # line-ending-only differences compare equal exactly as git itself would see them.
            how = ["--no-filters"] if state.mode == _MODE_LINK else [f"--path={rel}"]
            res = _git(
                info.top, "hash-object", "-w", "--stdin", *how, input=state.data, env=scratch
            )
            oid = _out(res)
            if base_entry is not None and base_entry == (state.mode, oid):
                continue
            changed[rel] = state
            oids[rel] = oid

        if not changed:
            where = "the listed paths" if explicit else "the working tree"
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"nothing to submit: {where} match the base commit {base[:12]}",
            )
        total = 0
        for rel, state in changed.items():
            if state is None:
                continue
            total += len(state.data)
            if (
                state.mode != _MODE_LINK
                and len(state.data) > MAX_BINARY_BYTES
                and _is_binary(state.data)
            ):
                raise LoomError(
                    ErrorCode.BAD_INPUT,
                    f"{rel!r} is a {len(state.data)} byte binary file, over the "
                    f"{MAX_BINARY_BYTES} byte limit; leave build outputs and data out of the change",
                )
        if total > MAX_CHANGE_BYTES:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"the change is {total} bytes, over the {MAX_CHANGE_BYTES} byte limit; "
                "pass explicit paths",
            )

        _git(info.top, "read-tree", base, env=scratch)
        zero = "0" * len(base)
        lines = [f"0 {zero}\t{rel}" for rel, s in changed.items() if s is None]
        lines += [f"{s.mode} {oids[rel]}\t{rel}" for rel, s in changed.items() if s is not None]
        _git(
            info.top,
            "update-index",
            "--add",
            "--remove",
            "-z",
            "--index-info",
            input="".join(line + "\0" for line in lines).encode("utf-8"),
            env=scratch,
        )
        diff = _git(
            info.top,
            "diff-index",
            "--cached",
            "-p",
            "--binary",
            "--no-renames",
            "--no-ext-diff",
            "--no-textconv",
            "--no-color",
            "--src-prefix=a/",
            "--dst-prefix=b/",
            base,
            "--",
            env=scratch,
        )

    files: dict[str, str | None] = {}
    binary, executable, symlinks = [], [], []
    for rel in sorted(changed):
        state = changed[rel]
        if state is None:
            files[rel] = None
        elif state.mode == _MODE_LINK:
            try:
                files[rel] = state.data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise LoomError(
                    ErrorCode.BAD_INPUT, f"symlink {rel!r} has a non-UTF-8 target"
                ) from exc
            symlinks.append(rel)
        elif _is_binary(state.data):
            files[rel] = base64.b64encode(state.data).decode("ascii")
            binary.append(rel)
        else:
            files[rel] = state.data.decode("utf-8")
        if state is not None and state.mode == _MODE_EXEC:
            executable.append(rel)
    return FrozenChange(
        files=files,
        # The patch is for the record: non-UTF-8 text bytes are shown replaced. `files` is exact.
        patch=diff.stdout.decode("utf-8", "replace"),
        digest=change_digest(files, binary, executable, symlinks),
        base_commit=base,
        binary=binary,
        executable=executable,
        symlinks=symlinks,
    )


# --------------------------------------------------------------------------------------------------
# worktrees


def _within(child: Path, parent: Path) -> bool:
    child_r, parent_r = Path(os.path.realpath(child)), Path(os.path.realpath(parent))
    return child_r == parent_r or parent_r in child_r.parents


def _check_root(info: _Repo, worktrees_root: Path) -> Path:
    root = Path(os.path.realpath(Path(worktrees_root).absolute()))
    # Inside the user's tree it would show up in their `git status`; containing the repo, cleanup
    # would treat the repo as a stray child.
    if _within(root, info.top) or _within(root, info.common_dir) or _within(info.top, root):
        raise LoomError(
            ErrorCode.BAD_INPUT, f"worktrees root {root} must be outside the repository {info.top}"
        )
    return root


def _apply_change(wt: Path, change: FrozenChange) -> list[str]:
    """Write the change into a fresh worktree with exact bytes; return the paths git must stage."""
    to_stage: list[str] = []
    entries = _entries_of(change)
    # Deletions first, so a file may be replaced by a directory of the same name and vice versa.
    for rel in sorted(r for r, e in entries.items() if e is None):
        _check_no_symlinked_parent(wt, rel, "the worktree")
        target = wt / rel
        if not os.path.lexists(target):
            continue
        if target.is_dir() and not target.is_symlink():
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"the change deletes file {rel!r}, but it is a directory at the start commit",
            )
        target.unlink()
        to_stage.append(rel)
        parent = target.parent
        while parent != wt and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    for rel in sorted(r for r, e in entries.items() if e is not None):
        entry = entries[rel]
        assert entry is not None
        _check_no_symlinked_parent(wt, rel, "the worktree")
        target = wt / rel
        parent = target.parent
        if parent.exists() and not parent.is_dir():
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{rel!r} needs directory {parent.relative_to(wt).as_posix()!r}, "
                "which is a file at the start commit",
            )
        parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            if target.is_dir() and not target.is_symlink():
                raise LoomError(
                    ErrorCode.BAD_INPUT, f"{rel!r} is a directory at the start commit, not a file"
                )
            # Unlink rather than overwrite: writing through a symlink would change its target.
            target.unlink()
        if entry.mode == _MODE_LINK:
            os.symlink(os.fsdecode(entry.data), target)
        else:
            mode = 0o755 if entry.mode == _MODE_EXEC else 0o644
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(target, flags, mode)
            try:
                view = memoryview(entry.data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)  # the umask must not decide the executable bit
            finally:
                os.close(fd)
        to_stage.append(rel)
    return to_stage


def _admin_dir(info: _Repo, worktree: Path) -> Path:
    """The worktree's entry in `<common>/worktrees/`, after checking it belongs to `info`."""
    if not Path(worktree).is_dir():
        raise LoomError(ErrorCode.NOT_FOUND, f"worktree {worktree} does not exist")
    res = _git(
        Path(worktree),
        "rev-parse",
        "--path-format=absolute",
        "--git-dir",
        "--git-common-dir",
        check=False,
    )
    lines = res.stdout.decode("utf-8", "surrogateescape").splitlines()
    if res.returncode != 0 or len(lines) != 2:
        raise LoomError(ErrorCode.BAD_INPUT, f"{worktree} is not a git worktree")
    admin, common = Path(os.path.realpath(lines[0])), Path(os.path.realpath(lines[1]))
    if common != info.common_dir or admin.parent != info.common_dir / "worktrees":
        raise LoomError(ErrorCode.BAD_INPUT, f"{worktree} is not a linked worktree of {info.top}")
    return admin


def _load_meta(info: _Repo, worktree: Path) -> _SubmissionMeta:
    meta = _admin_dir(info, worktree) / _META_FILE
    try:
        return _SubmissionMeta.model_validate_json(meta.read_bytes())
    except FileNotFoundError:
        raise LoomError(
            ErrorCode.BAD_INPUT, f"{worktree} was not prepared by prepare_worktree"
        ) from None


def _add_detached(
    info: _Repo, worktrees_root: Path, name: str, rev: str, labels: tuple[str, str]
) -> tuple[Path, str]:
    """`<worktrees_root>/<name>`, a new linked worktree of `info` detached at `rev`, and the
    commit `rev` resolved to. `labels` name `name` and `rev` in errors."""
    if not _SUBMISSION_ID.match(name):
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{labels[0]} {name!r} must be 1-128 of [A-Za-z0-9._-], not starting with . or -",
        )
    sha = _resolve_commit(info.top, rev, labels[1])
    root = _check_root(info, worktrees_root)
    root.mkdir(parents=True, exist_ok=True)
    wt = root / name
    if os.path.lexists(wt):
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"worktree {wt} already exists; names must be unique (stale ones are removed by "
            "cleanup_stale_worktrees)",
        )
    _git(info.top, "worktree", "add", "--detach", "--quiet", str(wt), sha)
    return wt, sha


def prepare_worktree(
    repo: Path, worktrees_root: Path, submission_id: str, start_commit: str, change: FrozenChange
) -> Path:
    """Create `<worktrees_root>/<submission_id>` detached at `start_commit` and apply the change.

    The change is staged in the worktree's own index right away and the resulting tree recorded, so
    `commit_accepted` commits exactly the bytes written here even if judging leaves build outputs
    behind or rewrites files. A change that leaves the start commit's tree unchanged is refused.
    """
    info = _open_repo(repo)
    wt, start = _add_detached(
        info, worktrees_root, submission_id, start_commit, ("submission id", "start commit")
    )
    try:
        to_stage = _apply_change(wt, change)
        if to_stage:
            _git(
                wt,
                "add",
                "-A",
                "-f",  # freeze already refused ignored files; this index is ours
                "--pathspec-from-file=-",
                "--pathspec-file-nul",
                input=b"".join(p.encode("utf-8") + b"\0" for p in to_stage),
            )
        tree = _out(_git(wt, "write-tree"))
        if tree == _out(_git(wt, "rev-parse", f"{start}^{{tree}}")):
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"the change is already contained in {start[:12]}; there is nothing new to judge",
            )
        meta = _SubmissionMeta(
            submission_id=submission_id,
            start_commit=start,
            tree=tree,
            digest=change.digest,
            paths=sorted(change.files),
        )
        (_admin_dir(info, wt) / _META_FILE).write_text(meta.model_dump_json())
    except BaseException:
        try:
            _remove(info, wt)
        except Exception:  # best effort: the original error matters; cleanup runs again on start
            pass
        raise
    return wt


def _compose_message(message: str, trailers: Mapping[str, str]) -> bytes:
    body = message.strip()
    if not body:
        raise LoomError(ErrorCode.BAD_INPUT, "commit message must not be empty")
    lines = []
    for key, value in trailers.items():
        value = str(value).strip()
        if not _TRAILER_KEY.match(key):
            raise LoomError(
                ErrorCode.BAD_INPUT, f"trailer key {key!r} must be letters, digits and -"
            )
        if not value or "\n" in value or "\r" in value:
            raise LoomError(
                ErrorCode.BAD_INPUT, f"trailer {key!r} needs a one-line, non-empty value"
            )
        lines.append(f"{key}: {value}")
    text = body + "\n"
    if lines:
        # Its own last paragraph, so `git interpret-trailers` and %(trailers) recognise the block.
        text += "\n" + "\n".join(lines) + "\n"
    return text.encode("utf-8")


def _identity_env(info: _Repo) -> dict[str, str]:
    """Author = the user's configured identity (the change is theirs to merge and sign off; CLA/DCO
    checks look at the author), falling back to loom-mcp. Committer = loom-mcp, always, so every
    commit the server made is recognisable in `git log --format=%cn`."""
    name, email = _config(info.top, "user.name"), _config(info.top, "user.email")
    if not (name and email):
        name, email = LOOM_NAME, LOOM_EMAIL
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": LOOM_NAME,
        "GIT_COMMITTER_EMAIL": LOOM_EMAIL,
    }


def commit_accepted(
    repo: Path,
    worktree: Path,
    branch: str,
    expected_tip: str,
    message: str,
    trailers: dict[str, str],
) -> str:
    """Commit the prepared change on top of its start commit and move `branch` there atomically.

    `expected_tip` must be the start commit the worktree was prepared on (the candidate was judged on
    that parent). The branch moves only if it still points at `expected_tip`, or does not exist yet;
    `git update-ref <ref> <new> <old>` does the compare-and-swap under git's ref lock, so two racing
    accepts can never fork or drop a commit. On failure, raises BranchMoved (code INTERNAL) and the
    branch is left as it was; the new commit object is unreferenced and harmless.
    """
    info = _open_repo(repo)
    ref = _branch_ref(info.top, branch)
    meta = _load_meta(info, Path(worktree))
    expected = _resolve_commit(info.top, expected_tip, "expected tip")
    if expected != meta.start_commit:
        raise BranchMoved(
            ref,
            expected,
            _ref_sha(info.top, ref),
            f"submission {meta.submission_id} was prepared and judged on {meta.start_commit[:12]}, "
            f"but the expected tip of {ref} is {expected[:12]}; prepare it again on the current tip",
        )
    current = _ref_sha(info.top, ref)
    if current is not None and current != expected:
        raise BranchMoved(
            ref,
            expected,
            current,
            f"{ref} is at {current[:12]}, not the expected {expected[:12]}; nothing was committed",
        )
    body = _compose_message(message, trailers)
    new = _out(
        _git(
            info.top,
            "commit-tree",
            meta.tree,
            "-p",
            meta.start_commit,
            "--no-gpg-sign",  # a server cannot answer a pinentry prompt
            "-F",
            "-",
            input=body,
            env=_identity_env(info),
        )
    )
    # Zero old value = "must not exist yet", so a branch created concurrently is not overwritten.
    old = current if current is not None else "0" * len(expected)
    res = _git(
        info.top,
        "update-ref",
        "-m",
        f"loom: accept {meta.submission_id}",
        ref,
        new,
        old,
        check=False,
    )
    if res.returncode != 0:
        now = _ref_sha(info.top, ref)
        raise BranchMoved(
            ref,
            expected,
            now,
            f"compare-and-swap on {ref} failed (expected {old[:12]}, now "
            f"{now[:12] if now else 'absent'}); another accept won or a second server is running. "
            f"The branch was not changed: {_err(res)}",
        )
    return new


def _worktree_entries(info: _Repo) -> list[tuple[Path, Path]]:
    """(admin dir, worktree path) for every linked worktree git has metadata for."""
    admin_root = info.common_dir / "worktrees"
    if not admin_root.is_dir():
        return []
    out = []
    for admin in sorted(admin_root.iterdir()):
        try:
            gitfile = _small_file(admin, "gitdir")
        except (OSError, LoomError, UnicodeDecodeError):
            continue  # not provably ours; `git worktree prune` owns broken entries
        out.append((admin, Path(gitfile).parent))
    return out


def _small_file(directory: Path, name: str) -> str:
    """A small git link file (`.git`, `gitdir`), read as a regular file without following a
    link: a command run in a checkout could have replaced it with a link or a FIFO."""
    return safefs.read_bytes(directory, name, 1 << 16, allow_hardlinks=True).decode().strip()


def _points_into(info: _Repo, directory: Path) -> bool | None:
    """True/False if `directory/.git` links into / away from this repo's worktrees; None if no link."""
    try:
        text = _small_file(directory, ".git")
    except (OSError, LoomError, UnicodeDecodeError):
        return None  # absent, a directory, a link, a FIFO: not a worktree's link file
    if not text.startswith("gitdir:"):
        return False
    target = Path(text.removeprefix("gitdir:").strip())
    if not target.is_absolute():
        target = directory / target
    return Path(os.path.realpath(target)).parent == info.common_dir / "worktrees"


def _same(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _rmtree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _remove(info: _Repo, wt: Path) -> bool:
    """Remove worktree `wt` and only its git metadata. True if there was anything to remove."""
    entries = [admin for admin, path in _worktree_entries(info) if _same(path, wt)]
    if entries:
        # Handles a vanished directory too: git then drops just this entry, unlike a global prune
        # that would also forget the user's own temporarily-unmounted worktrees.
        res = _git(info.top, "worktree", "remove", "--force", "--force", str(wt), check=False)
        if res.returncode != 0:
            _rmtree(wt)
        for admin in entries:
            if admin.exists():
                shutil.rmtree(admin)
        return True
    if os.path.lexists(wt):
        _rmtree(wt)
        return True
    return False


def remove_worktree(repo: Path, worktree: Path) -> None:
    """Remove a server-owned worktree and its git metadata. Refuses anything that is not one."""
    info = _open_repo(repo)
    wt = Path(os.path.realpath(Path(worktree).absolute()))
    if _within(info.top, wt) or _within(wt, info.common_dir):
        raise LoomError(ErrorCode.BAD_INPUT, f"{worktree} is the repository itself, not a worktree")
    known = any(_same(path, wt) for _, path in _worktree_entries(info))
    if not known and os.path.lexists(wt) and _points_into(info, wt) is not True:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{worktree} is not a worktree of {info.top}; refusing to delete it",
        )
    _remove(info, wt)


def repository_root(path: Path) -> Path:
    """The top of the git work tree that `path` (a directory) lies in."""
    where = Path(path)
    if not where.is_dir():
        raise LoomError(ErrorCode.NOT_FOUND, f"{where} does not exist or is not a directory")
    res = _git(where, "rev-parse", "--path-format=absolute", "--show-toplevel", check=False)
    if res.returncode != 0 or not _out(res):
        raise LoomError(
            ErrorCode.BAD_INPUT, f"{where} is not inside a git repository with a working tree"
        )
    return Path(os.path.realpath(_out(res)))


def uncommitted_paths(path: Path, head: str | None = None) -> list[str]:
    """Repo-relative paths of the repository `path` lies in whose working-tree content is not
    HEAD's: tracked files edited or deleted, and untracked files git does not ignore. What a run
    at HEAD's commit leaves out; with `head`, none unless HEAD is that commit (the edits are then
    to some other commit). Reads the repository and the changed files only (the content is
    hashed as `git add` would store it), and writes nothing."""
    info = _open_repo(repository_root(path))
    at = _ref_sha(info.top, "HEAD")
    if at is None or (head is not None and at != head):
        return []  # no commit yet, or not the commit asked about: nothing to compare with
    candidates = _changed_paths(info, "HEAD")
    tree = _ls_tree(info.top, "HEAD", candidates)
    # stat-only differences (a touched file) are not changes: hash what is there and compare
    regular = [
        rel for rel in candidates
        if rel in tree and (info.top / rel).is_file() and not (info.top / rel).is_symlink()
    ]
    hashed: dict[str, str] = {}
    if regular:
        res = _git(info.top, "hash-object", "--stdin-paths", input="\n".join(regular).encode() + b"\n")
        hashed = dict(zip(regular, _out(res).split(), strict=False))
    return sorted(rel for rel in candidates if rel not in tree or hashed.get(rel) != tree[rel][1])


def checkout_revision(repo: Path, worktrees_root: Path, name: str, rev: str) -> tuple[Path, str]:
    """A linked worktree `<worktrees_root>/<name>` of `repo`, detached at `rev`, and the commit's
    full sha: a revision as it was committed (the user's uncommitted edits are not in it), for
    running a command there. `remove_worktree` takes it away."""
    return _add_detached(_open_repo(repo), worktrees_root, name, rev, ("worktree name", "revision"))


def main_worktree(worktree: Path) -> Path | None:
    """The repository a linked worktree belongs to (its main working tree), or None if git
    cannot tell (not a worktree, or the repository is gone)."""
    if not (Path(worktree) / ".git").is_file():
        return None
    res = _git(Path(worktree), "worktree", "list", "--porcelain", check=False)
    first = _out(res).splitlines()[:1] if res.returncode == 0 else []
    return Path(first[0].removeprefix("worktree ")) if first and first[0].startswith("worktree ") else None


def _kept(name: str, keep: Iterable[str]) -> bool:
    # A submission may own siblings of its worktree, e.g. `<id>.task.py` for a task outside the repo.
    return any(name == k or name.startswith(k + ".") for k in keep)


def cleanup_stale_worktrees(
    repo: Path, worktrees_root: Path, keep: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """Remove everything under `worktrees_root` not owned by a submission in `keep`; return names.

    `keep` holds submission ids; `<id>` and `<id>.<anything>` are kept. Covers worktrees git knows
    about, directories git no longer knows (metadata lost) and metadata whose directory vanished.
    Only direct children of `worktrees_root` and their own metadata are touched: a directory linked
    to another repository's worktrees, or a repository itself, is left alone, so a root shared by
    several repositories is safe. If the repository itself is gone, its worktrees are orphans and
    are removed as plain directories.
    """
    root = Path(os.path.realpath(Path(worktrees_root).absolute()))
    try:
        info: _Repo | None = _open_repo(repo)
    except LoomError:
        info = None
    removed: set[str] = set()
    if info is not None:
        _check_root(info, root)
        for _admin, path in _worktree_entries(info):
            if Path(os.path.realpath(path)).parent != root or _kept(path.name, keep):
                continue
            if _remove(info, root / path.name):
                removed.add(path.name)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if _kept(child.name, keep) or not os.path.lexists(child):
                continue
            if child.is_dir() and not child.is_symlink():
                if (child / ".git").is_dir():
                    continue  # a repository, never something we created
                if info is not None and _points_into(info, child) is False:
                    continue  # another repository's worktree
            _rmtree(child)
            removed.add(child.name)
    return sorted(removed)


# --------------------------------------------------------------------------------------------------
# reports


def format_patch(repo: Path, base_commit: str, branch: str) -> str:
    """`git format-patch --stdout base..branch`: every accepted commit, appliable with `git am`.

    Empty when the branch does not exist (nothing accepted yet). Options that user config could turn
    on (signatures, attachments, threading, sign-off, cover letter) are pinned off so the text is the
    same on every machine.
    """
    info = _open_repo(repo)
    base = _resolve_commit(info.top, base_commit, "base commit")
    ref = _branch_ref(info.top, branch)
    if _ref_sha(info.top, ref) is None:
        return ""
    res = _git(
        info.top,
        "format-patch",
        "--stdout",
        "--binary",
        "--no-signature",
        "--no-attach",
        "--no-thread",
        "--no-signoff",
        "--no-cover-letter",
        f"{base}..{ref}",
        "--",
    )
    return res.stdout.decode("utf-8", "replace")


def commit_trailers(repo: Path, sha: str) -> dict[str, str]:
    """The trailers of commit `sha`, parsed by git itself (last value wins for a repeated key)."""
    info = _open_repo(repo)
    commit = _resolve_commit(info.top, sha, "commit")
    raw = _git(info.top, "cat-file", "commit", commit).stdout
    _headers, _, message = raw.partition(b"\n\n")
    # --parse ignores trailer.* config, so only what is in the message is returned.
    parsed = _git(info.top, "interpret-trailers", "--parse", input=message).stdout
    trailers: dict[str, str] = {}
    for line in parsed.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            trailers[key.strip()] = value.strip()
    return trailers
