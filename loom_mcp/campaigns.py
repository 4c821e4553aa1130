"""Campaigns: a target git repository, a goal, a base commit and budgets, recorded in the ledger."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import orjson

from loom_mcp.config import LoomConfig
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.models import Budgets, StartCampaignResult
from loom_mcp.store import Ledger


def new_campaign_id() -> str:
    return time.strftime("c%Y%m%d-") + secrets.token_hex(3)


def cap_budgets(requested: Budgets | None, ceiling: Budgets) -> Budgets:
    """The agent may ask for less than the configured budget, never more."""
    if requested is None:
        return ceiling
    return Budgets(
        gpu_seconds=min(requested.gpu_seconds, ceiling.gpu_seconds),
        candidates=min(requested.candidates, ceiling.candidates),
        wall_seconds=min(requested.wall_seconds, ceiling.wall_seconds),
    )


def start_campaign(
    config: LoomConfig,
    ledger: Ledger,
    repo: str,
    goal: str,
    task: str | None = None,
    budgets: Budgets | None = None,
    task_globals: dict[str, Any] | None = None,
) -> StartCampaignResult:
    import git  # gitpython: imported here so `--help` and `--version` stay fast

    repo_path = config.check_allowed(Path(repo), "repo")
    if not repo_path.is_dir():
        raise LoomError(ErrorCode.NOT_FOUND, f"repo {repo_path} does not exist or is not a directory")
    try:
        repository = git.Repo(repo_path, search_parent_directories=False)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError) as exc:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"{repo_path} is not the top of a git repository; run `git init` there and commit, "
            "or pass the repository root",
        ) from exc
    if repository.bare:
        raise LoomError(ErrorCode.BAD_INPUT, f"{repo_path} is a bare repository; pass a working clone")
    try:
        base = repository.head.commit
    except ValueError as exc:
        raise LoomError(
            ErrorCode.BAD_INPUT, f"{repo_path} has no commits yet; commit the code to optimize first"
        ) from exc
    base_branch = None if repository.head.is_detached else repository.active_branch.name

    task_path: str | None = None
    if task is not None:
        candidate = Path(task)
        if not candidate.is_absolute():
            candidate = repo_path / candidate
        resolved = config.check_allowed(candidate, "task")
        if not resolved.is_file():
            raise LoomError(ErrorCode.NOT_FOUND, f"task file {resolved} does not exist")
        task_path = str(resolved)
    if task_globals:
        if task_path is None:
            raise LoomError(ErrorCode.BAD_INPUT, "task_globals override a task's module-level names; name the task too")
        from loom_mcp.judge import checked_task_globals

        task_globals = checked_task_globals(Path(task_path), task_globals)

    if not goal.strip():
        raise LoomError(ErrorCode.BAD_INPUT, "goal must say what to optimize, e.g. 'decode tokens/s'")

    campaign_id = new_campaign_id()
    effective = cap_budgets(budgets, config.budgets)
    fingerprint = config.fingerprint()
    branch = f"loom/{campaign_id}"
    ledger.insert_campaign(
        {
            "id": campaign_id,
            "created_at": time.time(),
            "repo": str(repo_path),
            "goal": goal.strip(),
            "task": task_path,
            "base_commit": base.hexsha,
            "base_branch": base_branch,
            "branch": branch,
            "config_fingerprint": fingerprint,
            "budgets_json": orjson.dumps(effective.model_dump()).decode(),
            "task_globals_json": orjson.dumps(task_globals).decode() if task_globals else None,
        }
    )
    dirty = repository.is_dirty(untracked_files=False)
    next_step = "profile the workload or run analyze_trace on a trace you have"
    if dirty:
        next_step = (
            "note: the repo has uncommitted changes; the campaign base is the last commit "
            f"{base.hexsha[:12]}, not your working tree. " + next_step
        )
    return StartCampaignResult(
        campaign_id=campaign_id,
        repo=str(repo_path),
        base_commit=base.hexsha,
        base_branch=base_branch,
        branch=branch,
        goal=goal.strip(),
        task=task_path,
        task_globals=task_globals or {},
        budgets=effective,
        config_fingerprint=fingerprint,
        next_step=next_step,
    )


def campaign_task_globals(campaign: dict[str, Any]) -> dict[str, Any]:
    """The task_globals a campaign was started with ({} when none)."""
    raw = campaign.get("task_globals_json")
    return orjson.loads(raw) if raw else {}


def resolve_task_globals(campaign: dict[str, Any] | None, given: dict[str, Any] | None) -> dict[str, Any] | None:
    """A call's task_globals: the campaign's when the call names none."""
    if given or campaign is None:
        return given
    return campaign_task_globals(campaign) or None
