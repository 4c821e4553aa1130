"""Git revisions as the two arms of the command mode of benchmark: each arm's revision checked
out into its own worktree under LOOM_HOME/worktrees/_revisions/<pid>-<run>, the command run
there, the worktrees removed afterwards (also when the benchmark fails or is cancelled), and
those of a server that died mid-run removed by the next one to start (`sweep_stale_revisions`)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from loom_mcp import gitops
from loom_mcp.bench.command_models import Arm
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import Finding

log = logging.getLogger(__name__)

ARMS: tuple[Arm, Arm] = ("baseline", "candidate")
# beside the campaigns' worktree folders, which are named by campaign id
REVISIONS_DIR = "_revisions"


def revisions_root(home: Path, run_id: str) -> Path:
    """Where one run's two checkouts go: named by this process, so a later server can tell the
    checkouts of a dead one from those of a live one sharing LOOM_HOME."""
    return Path(home) / "worktrees" / REVISIONS_DIR / f"{os.getpid()}-{run_id}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _remove_checkouts(repo: Path, run_dir: Path) -> list[str]:
    """Everything in `run_dir`, the checkouts and their git metadata included, then the folder."""
    removed = gitops.cleanup_stale_worktrees(repo, run_dir)
    try:
        run_dir.rmdir()  # only if empty: what cleanup leaves (a repository) is not ours
    except OSError:
        pass
    return removed


def sweep_stale_revisions(home: Path) -> list[str]:
    """Remove the checkouts of runs whose server process is gone; return what was removed."""
    root = Path(home) / "worktrees" / REVISIONS_DIR
    removed: list[str] = []
    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        pid = run_dir.name.split("-", 1)[0]
        if not run_dir.is_dir() or (pid.isdigit() and _alive(int(pid))):
            continue
        # the checkouts name their repository; with none left to ask, they go as plain folders
        repos = (gitops.main_worktree(child) for child in sorted(run_dir.iterdir()))
        repo = next((r for r in repos if r is not None), run_dir / "no-repository")
        try:
            removed += [f"{run_dir.name}/{name}" for name in _remove_checkouts(repo, run_dir)]
        except LoomError as exc:
            log.warning("left %s in place: %s", run_dir, exc)
    return removed


@dataclass(frozen=True)
class Checkouts:
    cwds: dict[Arm, Path]  # where each arm's command runs
    commits: dict[Arm, str]  # the full sha each arm's revision resolved to


def _nearest_directory(path: Path) -> Path:
    path = path.resolve()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


@asynccontextmanager
async def revision_checkouts(
    repo: Path, revisions: Mapping[Arm, str], root: Path, cwd: Path | None = None
) -> AsyncIterator[Checkouts]:
    """Check out `revisions` of the repository `repo` lies in, under `root` (outside it, and
    this call's own: emptied and removed on the way out).

    Each arm runs in its worktree, or in the subdirectory `cwd` is of the repository's top, if
    `cwd` is given; that directory must exist at both revisions, not in the working tree. Only
    committed content takes part: the working tree's uncommitted edits are in neither arm.
    """
    # `repo` may be a directory that exists only at the revisions: its nearest existing parent
    # names the repository as well
    top = await anyio.to_thread.run_sync(gitops.repository_root, _nearest_directory(Path(repo)))
    sub = Path(".")
    if cwd is not None:
        try:
            sub = Path(cwd).resolve().relative_to(top)
        except ValueError:
            raise LoomError(
                ErrorCode.BAD_INPUT, f"cwd {cwd} is outside the repository {top} of the revisions"
            ) from None
    try:
        cwds: dict[Arm, Path] = {}
        commits: dict[Arm, str] = {}
        for arm in ARMS:
            worktree, commits[arm] = await anyio.to_thread.run_sync(
                gitops.checkout_revision, top, root, arm, revisions[arm]
            )
            cwds[arm] = worktree / sub
            if not cwds[arm].is_dir():
                raise LoomError(
                    ErrorCode.NOT_FOUND,
                    f"{sub.as_posix()} is not a directory at {arm} revision {revisions[arm]!r}",
                )
        yield Checkouts(cwds=cwds, commits=commits)
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(_remove_checkouts, top, root)
            except LoomError as exc:  # never hide the benchmark's own outcome behind this
                log.warning("could not remove the revision checkouts in %s: %s", root, exc)


def uncommitted_finding(repo: Path, candidate_commit: str) -> list[Finding]:
    """A warning when the candidate arm ran HEAD's commit while the working tree holds edits:
    whoever asked most likely meant to measure them, and neither arm saw them."""
    try:
        paths = gitops.uncommitted_paths(_nearest_directory(Path(repo)), head=candidate_commit)
    except LoomError as exc:  # a note about the working tree never costs the measurement
        log.warning("could not compare the working tree with HEAD: %s", exc)
        return []
    if not paths:
        return []
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return [
        Finding(
            check="bench.command.uncommitted",
            severity="warning",
            message=f"the candidate arm ran HEAD ({candidate_commit[:12]}), but the working tree "
            f"differs from it in {len(paths)} file(s): {shown}. Neither arm ran those edits; "
            "commit them to measure them",
        )
    ]
