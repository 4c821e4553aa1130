"""Git revisions as the two arms of the command mode of benchmark: each arm's revision checked
out into its own worktree under the run's job directory, the command run there, the worktrees
removed afterwards (also when the benchmark fails or is cancelled)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from loom_mcp import gitops
from loom_mcp.bench.command_models import Arm
from loom_mcp.errors import ErrorCode, LoomError

log = logging.getLogger(__name__)

ARMS: tuple[Arm, Arm] = ("baseline", "candidate")


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
    """Check out `revisions` of the repository `repo` lies in, under `root` (outside it).

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
    made: list[Path] = []
    try:
        cwds: dict[Arm, Path] = {}
        commits: dict[Arm, str] = {}
        for arm in ARMS:
            worktree, commits[arm] = await anyio.to_thread.run_sync(
                gitops.checkout_revision, top, root, arm, revisions[arm]
            )
            made.append(worktree)
            cwds[arm] = worktree / sub
            if not cwds[arm].is_dir():
                raise LoomError(
                    ErrorCode.NOT_FOUND,
                    f"{sub.as_posix()} is not a directory at {arm} revision {revisions[arm]!r}",
                )
        yield Checkouts(cwds=cwds, commits=commits)
    finally:
        with anyio.CancelScope(shield=True):
            for worktree in made:
                try:
                    await anyio.to_thread.run_sync(gitops.remove_worktree, top, worktree)
                except LoomError as exc:  # never hide the benchmark's own outcome behind this
                    log.warning("could not remove the revision worktree %s: %s", worktree, exc)
