"""submit_candidate: the gate. The server freezes the candidate, re-runs compile -> validate ->
benchmark itself in a server-owned worktree, decides, and on accept commits to loom/<campaign>.

Nothing the agent says is evidence: thresholds come from the config, numbers from this run.
Submissions to one campaign are serialized by a lock shared across server processes, so the
branch stays linear; a submission row is written before any work, so a crash leaves it marked
`interrupted` on the next start, and its worktree is removed then.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import orjson

from loom_mcp import gitops
from loom_mcp.config import CONFIG_FILE, LoomConfig
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import CompileEvidence, Diagnostic, Verdict
from loom_mcp.models import Budgets, SubmitResult
from loom_mcp.sandbox import safefs
from loom_mcp.sandbox.lease import DeviceLease
from loom_mcp.sandbox.runner import Progress
from loom_mcp.sandbox.sources import declared_sources
from loom_mcp.store import ArtifactStore, Ledger, new_run_id

log = logging.getLogger("loom_mcp")


# Errors a candidate can cause while it is judged (it hangs, exhausts a sandbox limit, kills its
# worker, does not compile): such a submission spends a candidate like any verdict.
CANDIDATE_ERRORS = frozenset(
    {ErrorCode.TIMEOUT, ErrorCode.RESOURCE_LIMIT, ErrorCode.WORKER_CRASHED, ErrorCode.COMPILE_ERROR}
)


def candidate_failure(exc: BaseException) -> bool:
    return isinstance(exc, LoomError) and exc.code in CANDIDATE_ERRORS


def budget_usage(ledger: Ledger, campaign: dict) -> dict[str, float]:
    calls = ledger.calls(campaign_id=campaign["id"])
    charged = [s for s in ledger.submissions(campaign["id"]) if s["status"] != "void"]
    return {
        "gpu_seconds": sum(c.device_s for c in calls),
        "candidates": float(len(charged)),
        "wall_seconds": time.time() - campaign["created_at"],
    }


BUDGET_KEYS = ("gpu_seconds", "candidates", "wall_seconds")


def campaign_budgets(campaign: dict, ceiling: Budgets | None) -> tuple[Budgets, list[str]]:
    """The budgets in force for a campaign: what its ledger row records, never more than the
    ceilings of the human's loom.toml this server started with. The ledger is a file an agent
    might reach; the ceilings are re-applied at every check, and a row that claims more (or no
    longer parses) is reported rather than obeyed."""
    notes: list[str] = []
    try:
        recorded = Budgets.model_validate(orjson.loads(campaign["budgets_json"]))
    except (ValueError, TypeError):
        if ceiling is None:
            raise
        notes.append(
            f"campaign {campaign['id']}'s budgets in the ledger do not parse; the server's configured ceilings apply"
        )
        return ceiling, notes
    if ceiling is None:
        return recorded, notes
    from loom_mcp.campaigns import cap_budgets

    effective = cap_budgets(recorded, ceiling)
    raised = [
        f"{k} {getattr(recorded, k):g} > {getattr(ceiling, k):g}"
        for k in BUDGET_KEYS
        if getattr(recorded, k) > getattr(ceiling, k)
    ]
    if raised:
        notes.append(
            f"the ledger records budgets above this server's ceilings for campaign "
            f"{campaign['id']} ({', '.join(raised)}): the ledger was edited, or loom.toml "
            "lowered them since; the configured ceilings apply"
        )
    return effective, notes


def budget_left(ledger: Ledger, campaign: dict, ceiling: Budgets | None = None) -> dict[str, float]:
    budgets, _ = campaign_budgets(campaign, ceiling)
    used = budget_usage(ledger, campaign)
    return {k: round(getattr(budgets, k) - used[k], 3) for k in BUDGET_KEYS}


def check_budgets(ledger: Ledger, campaign: dict, ceiling: Budgets | None = None) -> dict[str, float]:
    """BUDGET_EXHAUSTED once any budget is spent; `ceiling` (the server's config.budgets) caps
    whatever the campaign's ledger row says."""
    _, notes = campaign_budgets(campaign, ceiling)
    for note in notes:
        log.warning("%s", note)
    left = budget_left(ledger, campaign, ceiling)
    spent = [k for k, v in left.items() if v <= 0]
    if spent:
        raise LoomError(
            ErrorCode.BUDGET_EXHAUSTED,
            f"campaign {campaign['id']} has used its {', '.join(spent)} budget "
            f"(left: {left}); campaign_report summarizes it, a human can raise budgets in loom.toml "
            "for a new campaign" + "".join(f" (note: {n})" for n in notes),
        )
    return left


def _frozen_outside_change(candidate: Path) -> gitops.FrozenChange:
    """A candidate file outside the repo (and the sources it declares, in their places beside
    it) is committed under loom_candidates/ when accepted."""
    files: dict[str, str | None] = {f"loom_candidates/{candidate.name}": safefs.read_resolved_text(candidate)}
    for source in declared_sources(candidate):
        rel = source.relative_to(candidate.parent).as_posix()
        data = _source_bytes(safefs.read_resolved_bytes(source), source, "declared source")
        files[f"loom_candidates/{rel}"] = data.decode("utf-8")
    return gitops.FrozenChange(files=files, patch="", digest=gitops.change_digest(files))


def _source_bytes(data: bytes, path: Path, what: str) -> bytes:
    """`data` when it is UTF-8 text; else [BAD_INPUT] before the submission is recorded."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LoomError(
            ErrorCode.BAD_INPUT, f"{what} {path} is not UTF-8 text (byte {exc.start}); a {what} is a Python source file"
        ) from None
    return data


def _materialize_task(worktree: Path, task_rel: str, task_bytes: bytes, declared_baseline: str | None) -> str | None:
    """Write a task missing from the worktree (and the BASELINE it names, when that is missing
    too) beside where it lives in the repo; None when that directory is not in the worktree
    (the caller then puts the task beside the worktree)."""
    where = worktree / task_rel
    if not where.parent.is_dir() or where.parent.is_symlink():
        return None
    safefs.write_bytes(worktree, task_rel, task_bytes)
    if declared_baseline is not None:
        baseline = Path(declared_baseline)
        rel = str(Path(task_rel).parent / baseline.name)
        if not (worktree / rel).is_file() and baseline.is_file():
            safefs.write_bytes(worktree, rel, safefs.read_resolved_bytes(baseline))
    return task_rel


def _relative_in(repo: Path, path: Path) -> str | None:
    try:
        return path.resolve().relative_to(repo).as_posix()
    except ValueError:
        return None


async def submit_candidate(
    config: LoomConfig,
    ledger: Ledger,
    artifacts: ArtifactStore,
    *,
    campaign_id: str,
    task: str,
    candidate: str,
    paths: list[str] | None,
    progress: Progress | None,
    task_globals: dict | None = None,
) -> tuple[SubmitResult, float]:
    from loom_mcp import judge
    from loom_mcp.gate import decide, review_explanation

    campaign = ledger.campaign(campaign_id)
    if campaign is None:
        raise LoomError(ErrorCode.NOT_FOUND, f"no campaign {campaign_id!r}; start_campaign first")
    repo = Path(campaign["repo"])
    task_path = judge.check_file(config, task, "task")
    cand_path = judge.check_file(config, candidate, "candidate")
    # The campaign's overrides are part of the yardstick: a submission may not judge itself on others.
    from loom_mcp.campaigns import campaign_task_globals

    recorded = campaign_task_globals(campaign)
    task_globals = judge.checked_task_globals(task_path, task_globals) or recorded
    if task_globals != recorded:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"task_globals {task_globals} differ from the campaign's {recorded or '{}'}: "
            "submissions are judged with the campaign's; start a new campaign for others",
        )
    worktrees_root = config.home / "worktrees" / campaign_id
    device_seconds = 0.0

    # One submission per campaign at a time, across coroutines and server processes.
    async with DeviceLease(config.locks_dir, f"campaign:{campaign_id}", timeout_s=config.lease_timeout_s):
        check_budgets(ledger, campaign, config.budgets)
        cand_rel = _relative_in(repo, cand_path)
        if cand_rel is not None:
            # The sources the candidate declares are part of it: frozen with it, unasked.
            sources = [_relative_in(repo, p) for p in declared_sources(cand_path)]
            wanted = sorted({cand_rel, *(paths or []), *(s for s in sources if s is not None)})
            change = gitops.freeze_change(repo, campaign["base_commit"], wanted)
        else:
            change = _frozen_outside_change(cand_path)
            cand_rel = next(iter(change.files))
        task_rel = _relative_in(repo, task_path)
        # The task (and the baseline it names) define the verdict; a submission may not edit them.
        guarded: set[str] = set()
        if task_rel:
            declared = judge.task_baseline(task_path)
            guarded = {task_rel, *([str(Path(task_rel).parent / Path(declared).name)] if declared else [])}
        touched = sorted(guarded & set(change.files))
        if touched:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"the submission changes {', '.join(touched)}: the task and its baseline are "
                "the yardstick, not part of the candidate; submit only the candidate's files",
            )
        task_bytes = _source_bytes(safefs.read_resolved_bytes(task_path), task_path, "task")
        task_sha = artifacts.put_bytes(task_bytes, kind="task", name=task_path.name)
        frozen_bytes = change.content_bytes(cand_rel) if cand_rel in change.files else None
        # Unchanged since the base (only other paths changed): the file as it is now is the candidate.
        cand_bytes = frozen_bytes if frozen_bytes is not None else safefs.read_resolved_bytes(cand_path)
        cand_sha = artifacts.put_bytes(
            _source_bytes(cand_bytes, cand_path, "candidate"), kind="candidate", name=cand_rel
        )
        declared_baseline = judge.task_baseline(task_path) if task_rel else None
        submission_id = new_run_id("submission")
        ledger.insert_submission(
            {
                "id": submission_id,
                "campaign_id": campaign_id,
                "created_at": time.time(),
                "status": "running",
                "task": str(task_path),
                "task_sha": task_sha,
                "candidate": str(cand_path),
                "candidate_sha": cand_sha,
                "pid": os.getpid(),
                "config_fingerprint": config.fingerprint(),
            }
        )
        tip = gitops.campaign_tip(repo, campaign["branch"], campaign["base_commit"])
        worktree = None
        try:
            if progress:
                await progress("freezing the candidate in a server-owned worktree")
            worktree = gitops.prepare_worktree(repo, worktrees_root, submission_id, tip, change)
            ledger.update_submission(submission_id, worktree=str(worktree))
            frozen_cand = worktree / cand_rel
            if task_rel is not None and not (worktree / task_rel).is_file():
                # Not committed at the campaign tip (written after start_campaign, or untracked):
                # judged from the bytes snapshotted above, in its place; never committed.
                task_rel = _materialize_task(worktree, task_rel, task_bytes, declared_baseline)
            frozen_task = worktree / task_rel if task_rel else worktree.parent / f"{submission_id}.task.py"
            if task_rel is None:
                safefs.write_bytes(worktree.parent, frozen_task.name, artifacts.get_bytes(task_sha))

            compile_evidence = CompileEvidence(ok=True, language="python")
            # Beneath the worktree, following no link: the frozen candidate is a file of the change.
            source = safefs.read_text(worktree, cand_rel, safefs.MAX_SOURCE_BYTES, allow_hardlinks=True)
            if "@triton.jit" in source or "@triton.autotune" in source:
                if progress:
                    await progress("compiling")
                compiled, secs = await judge.compile_kernel(
                    config,
                    artifacts,
                    source=str(frozen_cand),
                    language="triton",
                    target=None,
                    flags=[],
                    task=str(frozen_task),
                    progress=progress,
                    task_globals=task_globals,
                )
                device_seconds += secs
                compile_evidence = CompileEvidence(
                    ok=compiled.ok,
                    language="triton",
                    artifact_id=compiled.artifact_id,
                    diagnostics=[Diagnostic(**d.model_dump()) for d in compiled.diagnostics],
                )
            # Each accepted step must beat the previous one, not just the reference: the chain's
            # speedups then multiply into a true cumulative figure.
            previous = last_accepted(ledger, campaign_id, task_sha)
            baseline_file = None
            if previous is not None:
                baseline_file = worktree.parent / f"{submission_id}.baseline.py"
                safefs.write_bytes(worktree.parent, baseline_file.name, artifacts.get_bytes(previous["candidate_sha"]))
            validation = benchmark = None
            validation_id = benchmark_id = None
            # The frozen files, judged on every shape (and, validated, at the policy's seeds).
            judged = judge.JudgeCall(
                str(frozen_task),
                str(frozen_cand),
                campaign_id=campaign_id,
                progress=progress,
                task_globals=task_globals,
            )
            if compile_evidence.ok:
                # A full validation of these exact bytes on this device and software (the agent's
                # own run_validation before submitting, say) is evidence already: reuse it.
                reused = await judge.reusable_validation(
                    config,
                    ledger,
                    artifacts,
                    task=frozen_task,
                    candidate=frozen_cand,
                    task_globals=task_globals,
                    campaign_id=campaign_id,
                )
                if reused is not None:
                    validation_id, validation = reused
                    if progress:
                        await progress(
                            f"reusing validation {validation_id}: same task and candidate "
                            "bytes, device, software and policy"
                        )
                else:
                    v_result, validation, secs = await judge.run_validation(config, ledger, artifacts, judged)
                    device_seconds += secs
                    validation_id = v_result.validation_id
                if validation.passed:
                    b_result, benchmark, _, secs = await judge.run_benchmark(
                        config, ledger, artifacts, judged, baseline=str(baseline_file) if baseline_file else None
                    )
                    device_seconds += secs
                    benchmark_id = b_result.benchmark_id
            verdict: Verdict = decide(compile_evidence, validation, benchmark, config.gate)
            commit = None
            if verdict.verdict == "accept":
                if progress:
                    await progress("accepted: committing to " + campaign["branch"])
                commit = gitops.commit_accepted(
                    repo,
                    worktree,
                    campaign["branch"],
                    tip,
                    message=f"loom: {Path(cand_rel).name} x{verdict.speedup:.3f} for {task_path.name}\n\n"
                    f"Campaign {campaign_id}: {campaign['goal']}",
                    trailers=trailers(verdict, validation_id, benchmark_id, benchmark, task_globals),
                )
            ledger.update_submission(
                submission_id,
                status=verdict.verdict,
                finished_at=time.time(),
                validation_id=validation_id,
                benchmark_id=benchmark_id,
                verdict_json=verdict.model_dump_json(),
                commit_sha=commit,
            )
        except BaseException as exc:
            # A failure that is not the candidate's (ours, the infrastructure's, a cancelled call)
            # is recorded as `void` and spends no candidate budget.
            status = "error" if candidate_failure(exc) else "void"
            ledger.update_submission(submission_id, status=status, finished_at=time.time())
            raise
        finally:
            if worktree is not None:
                gitops.remove_worktree(repo, worktree)
                for leftover in worktree.parent.glob(f"{submission_id}.*.py"):
                    leftover.unlink(missing_ok=True)
                ledger.update_submission(submission_id, worktree=None)

    if verdict.verdict == "accept":
        next_step = f"accepted on {campaign['branch']}; optimize the next hotspot or campaign_report"
    elif verdict.verdict == "reject":
        next_step = "fix the reasons listed, then submit again"
    else:
        next_step = review_explanation(list(verdict.reason_codes), str(config.home / CONFIG_FILE))
    result = SubmitResult(
        submission_id=submission_id,
        verdict=verdict.verdict,
        reasons=verdict.reasons,
        reason_codes=list(verdict.reason_codes),
        speedup=verdict.speedup,
        speedup_ci_low=verdict.speedup_ci_low,
        speedup_ci_high=verdict.speedup_ci_high,
        validation_id=validation_id,
        benchmark_id=benchmark_id,
        commit=commit,
        branch=campaign["branch"],
        change_digest=change.digest,
        budget_left=budget_left(ledger, campaign, config.budgets),
        next_step=next_step,
    )
    return result, device_seconds


def last_accepted(ledger: Ledger, campaign_id: str, task_sha: str) -> dict | None:
    accepted = [r for r in ledger.submissions(campaign_id) if r["status"] == "accept" and r["task_sha"] == task_sha]
    return accepted[-1] if accepted else None


def trailers(
    verdict: Verdict, validation_id, benchmark_id, benchmark, task_globals: dict | None = None
) -> dict[str, str]:
    device = benchmark.device if benchmark else "unknown"
    extra = {"Loom-Task-Globals": orjson.dumps(task_globals).decode()} if task_globals else {}
    return {
        **extra,
        "Loom-Verdict": verdict.verdict,
        "Loom-Speedup": f"{verdict.speedup:.4f}x [{verdict.speedup_ci_low:.4f}, {verdict.speedup_ci_high:.4f}] "
        f"{int(round((verdict.ci_level or 0.95) * 100))}% CI",
        "Loom-Evidence": f"{validation_id}, {benchmark_id}",
        "Loom-Device": f"{device} ({benchmark.timer})" if benchmark else device,
    }


def recover_interrupted(config: LoomConfig, ledger: Ledger) -> list[str]:
    """On start: submissions whose process died become `interrupted`, and every worktree under
    LOOM_HOME/worktrees that no live submission owns is removed. Scanning the directories (not
    only rows that recorded a worktree) also covers a kill between creating one and recording it."""
    for row in ledger.interrupted_submissions():
        ledger.clear_worktree(row["id"])
    cleaned: list[str] = []
    root = config.home / "worktrees"
    for campaign_dir in sorted(root.iterdir()) if root.is_dir() else []:
        if not campaign_dir.is_dir() or not any(campaign_dir.iterdir()):
            continue
        campaign = ledger.campaign(campaign_dir.name)
        if campaign is None:
            continue
        keep = ledger.live_submissions(campaign_dir.name)
        cleaned += gitops.cleanup_stale_worktrees(Path(campaign["repo"]), campaign_dir, keep=keep)
    return cleaned
