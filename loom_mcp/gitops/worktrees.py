"""Judging a change in a server-owned worktree, and committing an accepted one to
`loom/<campaign>` with a compare-and-swap on the branch; removing and sweeping worktrees.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.gitops.freeze import (
    _MODE_EXEC,
    _MODE_LINK,
    FrozenChange,
    _changed_paths,
    _check_no_symlinked_parent,
    _entries_of,
    _ls_tree,
)
from loom_mcp.gitops.runner import (
    _branch_ref,
    _config,
    _err,
    _git,
    _git_paths,
    _open_repo,
    _out,
    _ref_sha,
    _Repo,
    _resolve_commit,
)
from loom_mcp.sandbox import safefs

LOOM_NAME = "loom-mcp"
LOOM_EMAIL = "loom@localhost"
_META_FILE = "loom-submission.json"


_SUBMISSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TRAILER_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")


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
        raise LoomError(ErrorCode.BAD_INPUT, f"worktrees root {root} must be outside the repository {info.top}")
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
                f"{rel!r} needs directory {parent.relative_to(wt).as_posix()!r}, which is a file at the start commit",
            )
        parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            if target.is_dir() and not target.is_symlink():
                raise LoomError(ErrorCode.BAD_INPUT, f"{rel!r} is a directory at the start commit, not a file")
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
    admin, common = _git_paths(
        Path(worktree), "--git-dir", "--git-common-dir", refusal=f"{worktree} is not a git worktree"
    )
    if common != info.common_dir or admin.parent != info.common_dir / "worktrees":
        raise LoomError(ErrorCode.BAD_INPUT, f"{worktree} is not a linked worktree of {info.top}")
    return admin


def _load_meta(info: _Repo, worktree: Path) -> _SubmissionMeta:
    meta = _admin_dir(info, worktree) / _META_FILE
    try:
        return _SubmissionMeta.model_validate_json(meta.read_bytes())
    except FileNotFoundError:
        raise LoomError(ErrorCode.BAD_INPUT, f"{worktree} was not prepared by prepare_worktree") from None


def _add_detached(info: _Repo, worktrees_root: Path, name: str, rev: str, labels: tuple[str, str]) -> tuple[Path, str]:
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
            f"worktree {wt} already exists; names must be unique (stale ones are removed by cleanup_stale_worktrees)",
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
    wt, start = _add_detached(info, worktrees_root, submission_id, start_commit, ("submission id", "start commit"))
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
            raise LoomError(ErrorCode.BAD_INPUT, f"trailer key {key!r} must be letters, digits and -")
        if not value or "\n" in value or "\r" in value:
            raise LoomError(ErrorCode.BAD_INPUT, f"trailer {key!r} needs a one-line, non-empty value")
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
        raise LoomError(ErrorCode.BAD_INPUT, f"{where} is not inside a git repository with a working tree")
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
        rel for rel in candidates if rel in tree and (info.top / rel).is_file() and not (info.top / rel).is_symlink()
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
