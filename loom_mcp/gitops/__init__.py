"""Git operations for submissions: freeze the agent's change, judge it in a server-owned worktree,
and on accept commit it to `loom/<campaign>` with a compare-and-swap on the branch.

The user's checkout is read-only to this package: nothing here writes the user's HEAD, branch,
index or working-tree files. Writes go only to (a) objects in the shared object store, (b)
`refs/heads/loom/*` and its reflog, and (c) linked worktrees under a server-owned directory plus
their admin entries in `<common-dir>/worktrees/`.

- `runner`: calling git (clean environment, safe config), repository and ref lookups;
- `freeze`: the agent's change read once into a FrozenChange;
- `worktrees`: a worktree per submission, the accept commit, removal and sweeping;
- `history`: a campaign's patch and a commit's trailers, read back.
"""

from loom_mcp.gitops.freeze import MAX_BINARY_BYTES, FrozenChange, change_digest, freeze_change
from loom_mcp.gitops.history import commit_trailers, format_patch
from loom_mcp.gitops.runner import campaign_tip
from loom_mcp.gitops.worktrees import (
    BranchMoved,
    checkout_revision,
    cleanup_stale_worktrees,
    commit_accepted,
    main_worktree,
    prepare_worktree,
    remove_worktree,
    repository_root,
    uncommitted_paths,
)

__all__ = [
    "MAX_BINARY_BYTES",
    "BranchMoved",
    "FrozenChange",
    "campaign_tip",
    "change_digest",
    "checkout_revision",
    "cleanup_stale_worktrees",
    "commit_accepted",
    "commit_trailers",
    "format_patch",
    "freeze_change",
    "main_worktree",
    "prepare_worktree",
    "remove_worktree",
    "repository_root",
    "uncommitted_paths",
]
