"""Freezing the agent's change: the files it names (or every changed path), read from the working
tree once, at submit time, into an immutable FrozenChange.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import orjson
from pydantic import BaseModel, ConfigDict, Field

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.gitops.runner import (
    _config_bool,
    _err,
    _git,
    _open_repo,
    _out,
    _Repo,
    _resolve_commit,
    _split_z,
)
from loom_mcp.sandbox import safefs

# A binary file above this is almost certainly a build output or dataset, not a kernel change.
MAX_BINARY_BYTES = 5 * 1024 * 1024
# The frozen change lives in memory and in the ledger; bound it so a stray log cannot blow either up.
MAX_CHANGE_BYTES = 64 * 1024 * 1024


_MODE_FILE = "100644"
_MODE_EXEC = "100755"
_MODE_LINK = "120000"
_MODE_GITLINK = "160000"


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
                raise LoomError(ErrorCode.BAD_INPUT, f"path {text} is outside the repository {info.top}") from None
        rel_text = rel.as_posix()
    else:
        rel_text = os.path.normpath(text).replace(os.sep, "/")
    parts = PurePosixPath(rel_text).parts
    if not parts or rel_text in (".", "") or parts[0] == "..":
        raise LoomError(ErrorCode.BAD_INPUT, f"path {text!r} is outside the repository {info.top}")
    if any(part.lower() == ".git" for part in parts):
        raise LoomError(ErrorCode.BAD_INPUT, f"path {text!r} is inside .git; submit source files only")
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


def _read_entry(info: _Repo, rel: str, filemode: bool, base_mode: str | None) -> _Frozen | None | str:
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
                f"{rel!r} is a symlink to {target!r}, outside the repository; pass explicit paths that leave it out",
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
    candidates = {p for p in _split_z(diff.stdout) + _split_z(untracked.stdout) if not p.endswith("/")}
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
    ancestors = sorted(
        {"/".join(PurePosixPath(rel).parts[:i]) for rel in rels for i in range(1, len(PurePosixPath(rel).parts))}
    )
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
    rels = sorted({_repo_relative(info, p) for p in paths}) if paths is not None else _changed_paths(info, base)
    base_tree = _ls_tree(info.top, base, rels)
    if explicit:
        _refuse_nested_repositories(info, base, rels)
    filemode = _config_bool(info.top, "core.filemode", default=True)

    states: dict[str, _Frozen | None] = {}
    for rel in rels:
        base_entry = base_tree.get(rel)
        if base_entry is not None and base_entry[0] in (_MODE_GITLINK, "040000"):
            if explicit:
                raise LoomError(ErrorCode.BAD_INPUT, f"{rel!r} is a directory or submodule; list files instead")
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
            res = _git(info.top, "hash-object", "-w", "--stdin", *how, input=state.data, env=scratch)
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
            if state.mode != _MODE_LINK and len(state.data) > MAX_BINARY_BYTES and _is_binary(state.data):
                raise LoomError(
                    ErrorCode.BAD_INPUT,
                    f"{rel!r} is a {len(state.data)} byte binary file, over the "
                    f"{MAX_BINARY_BYTES} byte limit; leave build outputs and data out of the change",
                )
        if total > MAX_CHANGE_BYTES:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"the change is {total} bytes, over the {MAX_CHANGE_BYTES} byte limit; pass explicit paths",
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
                raise LoomError(ErrorCode.BAD_INPUT, f"symlink {rel!r} has a non-UTF-8 target") from exc
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
