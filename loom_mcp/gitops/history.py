"""Reading a campaign's history back: its patch against the base commit, a commit's trailers."""

from __future__ import annotations

from pathlib import Path

from loom_mcp.gitops.runner import _branch_ref, _git, _open_repo, _ref_sha, _resolve_commit

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
