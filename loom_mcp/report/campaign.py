"""campaign_report: the campaign from the ledger alone — accepted chain, every attempt with its
reasons, failure rates per tool, budgets used, fingerprints, patches and reproduction commands.

Written as JSON (versioned; unknown values null), Markdown and PNG plots under
LOOM_HOME/reports/<campaign_id>/. Every number comes from a stored record.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from loom_mcp import __version__
from loom_mcp.config import LoomConfig
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.fields import optional
from loom_mcp.store import ArtifactStore, Ledger

REPORT_SCHEMA = "loom.campaign_report/1"


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Attempt(_M):
    submission_id: str
    status: str
    task: str
    candidate: str
    config_fingerprint: str | None = optional("The policy in force when this attempt was judged (null: not recorded)")
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    reasons: list[str] = Field(default_factory=list)
    validation_id: str | None = None
    benchmark_id: str | None = None
    commit: str | None = None


class ToolRates(_M):
    calls: int
    errors: int
    by_code: dict[str, int]


class DeviceUse(_M):
    """The campaign's jobs on one device, from their records' placements."""

    executor: str
    node: str
    device: str
    jobs: int
    busy_s: float = Field(description="Seconds the device was held for this campaign's jobs")
    queued_s: float = Field(description="Seconds those jobs waited for it, in all")
    max_queued_s: float


class CampaignReport(_M):
    schema_version: str = REPORT_SCHEMA
    campaign_id: str
    goal: str
    repo: str
    base_commit: str
    branch: str
    branch_tip: str | None
    accepted: list[Attempt]
    cumulative_speedup: float | None = Field(description="Product of accepted geomeans (each vs its own baseline)")
    attempts: list[Attempt]
    outcome_rates: dict[str, float] = Field(
        description="Share of submissions: accept, reject_compile, reject_validation, reject_noise, reject_other, needs_review, interrupted/error"
    )
    tools: dict[str, ToolRates]
    budgets: dict[str, dict[str, float]]
    fingerprint: dict[str, Any]
    reproduce: list[str]
    files: dict[str, str]
    devices: list[DeviceUse] = Field(default_factory=list, description="Jobs per device and their queue waits")


def _verdict(row: dict) -> dict:
    return orjson.loads(row["verdict_json"]) if row.get("verdict_json") else {}


def classify(row: dict) -> str:
    status = row["status"]
    if status != "reject":
        return status
    codes = set(_verdict(row).get("reason_codes", []))
    if any(c.startswith("compile.") for c in codes):
        return "reject_compile"
    if any(c.startswith("validation.") for c in codes):
        return "reject_validation"
    if codes and codes <= {"speedup.insufficient", "shape.regression"}:
        return "reject_noise"
    return "reject_other"


def _attempt(row: dict) -> Attempt:
    v = _verdict(row)
    return Attempt(
        submission_id=row["id"],
        status=row["status"],
        task=row["task"],
        candidate=row["candidate"],
        config_fingerprint=row.get("config_fingerprint"),
        speedup=v.get("speedup"),
        ci_low=v.get("speedup_ci_low"),
        ci_high=v.get("speedup_ci_high"),
        reasons=v.get("reasons", [])[:6],
        validation_id=row["validation_id"],
        benchmark_id=row["benchmark_id"],
        commit=row["commit_sha"],
    )


def _record(ledger: Ledger, artifacts: ArtifactStore, run_id: str | None) -> dict | None:
    if not run_id:
        return None
    row = ledger.run(run_id)
    return orjson.loads(artifacts.get_bytes(row["record_sha"])) if row else None


def device_use(ledger: Ledger, artifacts: ArtifactStore, campaign_id: str) -> list[DeviceUse]:
    """Validation and benchmark jobs per (executor, node, device), with their queue waits."""
    uses: dict[tuple[str, str, str], DeviceUse] = {}
    for kind in ("validation", "benchmark"):
        for row in ledger.runs_of(campaign_id, kind):
            placement = (_record(ledger, artifacts, row["id"]) or {}).get("placement")
            if not isinstance(placement, dict):
                continue  # recorded before placements were
            key = (str(placement.get("executor")), str(placement.get("node")), str(placement.get("device")))
            use = uses.setdefault(
                key,
                DeviceUse(
                    executor=key[0], node=key[1], device=key[2], jobs=0, busy_s=0.0, queued_s=0.0, max_queued_s=0.0
                ),
            )
            queued = float(placement.get("queued_s") or 0.0)
            use.jobs += 1
            use.queued_s = round(use.queued_s + queued, 3)
            use.max_queued_s = max(use.max_queued_s, queued)
            if placement.get("ended_at"):
                use.busy_s = round(use.busy_s + float(placement["ended_at"]) - float(placement["started_at"]), 3)
    return sorted(uses.values(), key=lambda u: (u.executor, u.node, u.device))


def build_report(config: LoomConfig, ledger: Ledger, artifacts: ArtifactStore, campaign_id: str) -> CampaignReport:
    campaign = ledger.campaign(campaign_id)
    if campaign is None:
        raise LoomError(ErrorCode.NOT_FOUND, f"no campaign {campaign_id!r}")
    from loom_mcp import gitops
    from loom_mcp.submissions import budget_usage, campaign_budgets

    repo = Path(campaign["repo"])
    rows = ledger.submissions(campaign_id)
    attempts = [_attempt(r) for r in rows]
    accepted = [a for a in attempts if a.status == "accept"]
    cumulative = math.prod(a.speedup for a in accepted if a.speedup) if accepted else None
    classes = [classify(r) for r in rows]
    rates = {k: round(classes.count(k) / len(classes), 3) for k in sorted(set(classes))} if classes else {}
    tools: dict[str, ToolRates] = {}
    for call in ledger.calls(campaign_id=campaign_id):
        if call.outcome == "running":
            continue  # this very report, or a call still in flight: not an outcome yet
        t = tools.setdefault(call.tool, ToolRates(calls=0, errors=0, by_code={}))
        t.calls += 1
        if call.outcome != "ok":
            t.errors += 1
            code = call.error_code or call.outcome
            t.by_code[code] = t.by_code.get(code, 0) + 1
    in_force, warnings = campaign_budgets(campaign, config.budgets)  # never above loom.toml's ceilings
    budgets = in_force.model_dump()
    drift = config.drift()
    if drift:
        warnings.append(drift)
    if campaign["config_fingerprint"] != config.fingerprint():
        warnings.append(
            f"the campaign was started under config fingerprint {campaign['config_fingerprint']}; "
            f"the server that wrote this report enforces {config.fingerprint()}"
        )
    used = budget_usage(ledger, campaign)
    tip = gitops.campaign_tip(repo, campaign["branch"], campaign["base_commit"])
    last_bench = next((_record(ledger, artifacts, a.benchmark_id) for a in reversed(attempts) if a.benchmark_id), None)
    toolchain_file = config.cache_dir / "toolchain.json"
    toolchain = orjson.loads(toolchain_file.read_bytes()) if toolchain_file.is_file() else None
    fingerprint = {
        "loom_mcp": __version__,
        "python": sys.version.split()[0],
        "config_fingerprint": campaign["config_fingerprint"],
        "server_config_fingerprint": config.fingerprint(),
        "device": {
            k: v
            for k, v in ((last_bench or {}).get("device") or {}).items()
            if k in ("vendor", "name", "arch", "driver_version", "runtime_version", "memory_total_bytes", "uuid")
            and v is not None
        }
        or None,
        "toolchain": _compact_toolchain((toolchain or {}).get("toolchain", toolchain)),
        "base_commit": campaign["base_commit"],
        "branch_tip": tip if tip != campaign["base_commit"] else None,
    }
    policies = list(dict.fromkeys(a.config_fingerprint for a in attempts if a.config_fingerprint))
    if len(policies) > 1:
        warnings.append(
            "the policy changed during the campaign: attempts were judged under "
            f"config fingerprints {', '.join(policies)} (see each attempt's)"
        )
    if warnings:
        fingerprint["warnings"] = warnings
    from loom_mcp.campaigns import campaign_task_globals

    reproduce = []
    for a in accepted:
        reproduce += reproduce_commands(config, repo, a, campaign_task_globals(campaign))
    return CampaignReport(
        campaign_id=campaign_id,
        goal=campaign["goal"],
        repo=str(repo),
        base_commit=campaign["base_commit"],
        branch=campaign["branch"],
        branch_tip=fingerprint["branch_tip"],
        accepted=accepted,
        cumulative_speedup=cumulative,
        attempts=attempts,
        outcome_rates=rates,
        tools=tools,
        budgets={"limit": budgets, "used": {k: round(v, 3) for k, v in used.items()}},
        fingerprint=fingerprint,
        reproduce=reproduce,
        files={},
        devices=device_use(ledger, artifacts, campaign_id),
    )


def _compact_toolchain(toolchain: Any) -> Any:
    """The toolchain as found: tools that were looked for and are absent are named in one list,
    and no null field is kept."""
    if not isinstance(toolchain, dict):
        return toolchain
    compact = dict(toolchain)
    tools = compact.pop("tools", None)
    if isinstance(tools, list):
        found = [t for t in tools if isinstance(t, dict) and t.get("found")]
        missing = [str(t.get("name")) for t in tools if isinstance(t, dict) and not t.get("found")]
        compact["tools"] = [{k: v for k, v in t.items() if k != "found"} for t in found]
        if missing:
            compact["not_found"] = missing
    return _without_nulls(compact)


def _without_nulls(value: Any) -> Any:
    """`value` with null entries dropped, and the containers left empty by that, recursively."""
    if isinstance(value, dict):
        kept = {k: _without_nulls(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, {}, [])} or None
    if isinstance(value, list):
        return [_without_nulls(v) for v in value if v is not None]
    return value


def reproduce_commands(config: LoomConfig, repo: Path, attempt: Attempt, task_globals: dict[str, Any]) -> list[str]:
    """Shell lines that re-judge an accepted attempt from its commit, runnable as printed: the
    worktree (and the task's directory, when the task is outside the repository) are made
    allowed roots for that one command, since `loom-mcp check` refuses any other path, and
    the report's LOOM_HOME is named so its loom.toml policy applies."""
    worktree = f"/tmp/loom-{attempt.submission_id}"
    roots = [worktree]
    task_rel = _inside(repo, attempt.task)
    # A task never committed (judged from its snapshot) is not in the worktree: use it in place.
    if task_rel is not None and _committed(repo, attempt.commit, task_rel):
        task = f"{worktree}/{task_rel}"
    else:
        task = attempt.task
        roots.append(str(Path(attempt.task).parent))
    candidate = f"{worktree}/{_repo_rel(repo, attempt.candidate)}"
    sets = "".join(f" --set {shlex.quote(f'{k}={orjson.dumps(v).decode()}')}" for k, v in task_globals.items())
    q = shlex.quote
    return [
        f"git -C {q(str(repo))} worktree add --detach {q(worktree)} {attempt.commit}",
        f"LOOM_ALLOWED_ROOTS={q(os.pathsep.join(roots))} loom-mcp --home {q(str(config.home))} "
        f"check --task {q(task)} --candidate {q(candidate)}{sets}"
        "   # validation + benchmark under this LOOM_HOME's policy; prints JSON",
        f"git -C {q(str(repo))} worktree remove --force {q(worktree)}",
    ]


def _committed(repo: Path, commit: str | None, rel: str) -> bool:
    import git

    try:
        git.Repo(repo).commit(commit).tree.join(rel)
    except (KeyError, ValueError, git.GitError):
        return False
    return True


def _inside(repo: Path, path: str) -> str | None:
    try:
        return Path(path).resolve().relative_to(repo.resolve()).as_posix()
    except ValueError:
        return None


def _repo_rel(repo: Path, path: str) -> str:
    try:
        return Path(path).resolve().relative_to(repo).as_posix()
    except ValueError:
        return f"loom_candidates/{Path(path).name}"


def write_report(config: LoomConfig, ledger: Ledger, artifacts: ArtifactStore, campaign_id: str) -> CampaignReport:
    from loom_mcp import gitops
    from loom_mcp.report.plots import roofline_plot, speedup_plot

    report = build_report(config, ledger, artifacts, campaign_id)
    out = config.home / "reports" / campaign_id
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    shapes = []
    for a in report.accepted:
        rec = _record(ledger, artifacts, a.benchmark_id)
        if rec:
            label = f"task {_short_path(report.repo, a.task)}, {Path(a.candidate).name} ({a.submission_id})"
            shapes.append((label, rec["evidence"]["shapes"]))
    if shapes:
        files["speedup_png"] = str(speedup_plot(shapes, out / "speedup.png", f"Campaign {campaign_id}: {report.goal}"))
        roofline = roofline_plot(shapes, out / "roofline.png")
        if roofline:
            files["roofline_png"] = str(roofline)
    breakdown = latest_breakdown(config, ledger, campaign_id)
    if breakdown:
        (out / "breakdown.png").write_bytes(breakdown.read_bytes())
        files["breakdown_png"] = str(out / "breakdown.png")
    if report.branch_tip:
        patch = gitops.format_patch(Path(report.repo), report.base_commit, report.branch)
        (out / "accepted.patch").write_text(patch)
        files["patch"] = str(out / "accepted.patch")
    files["json"] = str(out / "report.json")
    files["markdown"] = str(out / "report.md")
    report.files = files
    (out / "report.json").write_bytes(orjson.dumps(report.model_dump(), option=orjson.OPT_INDENT_2))
    (out / "report.md").write_text(render_markdown(report))
    return report


def latest_breakdown(config: LoomConfig, ledger: Ledger, campaign_id: str) -> Path | None:
    """The time-breakdown plot of the campaign's latest profiled trace, when one was analyzed."""
    for row in reversed(ledger.runs_of(campaign_id, "trace")):
        for summary in (config.cache_dir / "traces").glob("*/summary.json"):
            if orjson.loads(summary.read_bytes()).get("trace", "").startswith(row["record_sha"]):
                png = summary.with_name("breakdown.png")
                if png.is_file():
                    return png
    return None


# Reasons per attempt in the Markdown table; the JSON report has them whole.
REASONS_CHARS = 400


def clip_words(text: str, limit: int) -> str:
    """`text` cut at a word boundary to at most `limit` characters, an ellipsis marking the cut."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ;,.:") + "…"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _short_path(repo: str, path: str) -> str:
    """A path relative to the campaign repository when inside it, else as given."""
    inside = _inside(Path(repo), path)
    return inside if inside is not None else path


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def render_markdown(r: CampaignReport) -> str:
    lines = [
        f"# Campaign {r.campaign_id}",
        "",
        f"**Goal:** {r.goal}",
        "",
        f"Repository `{r.repo}`, base `{r.base_commit[:12]}`, branch `{r.branch}`"
        + (f" at `{r.branch_tip[:12]}`" if r.branch_tip else " (nothing accepted yet)"),
        "",
    ]
    lines += ["## Accepted chain", ""]
    if r.accepted:
        lines += ["| submission | task | candidate | speedup | 95% CI | commit |", "|---|---|---|---|---|---|"]
        lines += [
            f"| {a.submission_id} | `{_cell(_short_path(r.repo, a.task))}` | "
            f"`{_cell(_short_path(r.repo, a.candidate))}` | {_fmt(a.speedup)}x | "
            f"[{_fmt(a.ci_low)}, {_fmt(a.ci_high)}] | `{(a.commit or '')[:12]}` |"
            for a in r.accepted
        ]
        lines += ["", f"Cumulative (product of accepted geomeans): **{_fmt(r.cumulative_speedup)}x**", ""]
    else:
        lines += ["None.", ""]
    lines += [
        "## Every attempt",
        "",
        "| submission | task | candidate | verdict | speedup | policy | reasons |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {a.submission_id} | `{_cell(_short_path(r.repo, a.task))}` | "
        f"`{_cell(_short_path(r.repo, a.candidate))}` | {a.status} | {_fmt(a.speedup)} | "
        f"{f'`{a.config_fingerprint[:12]}`' if a.config_fingerprint else '—'} | "
        f"{_cell(clip_words('; '.join(a.reasons), REASONS_CHARS)) or '—'} |"
        for a in r.attempts
    ]
    lines += ["", "## Outcomes and tools", ""]
    lines += [f"- {k}: {v:.0%}" for k, v in r.outcome_rates.items()] or ["- no submissions"]
    lines += ["", "| tool | calls | errors | by code |", "|---|---|---|---|"]
    lines += [
        f"| {k} | {t.calls} | {t.errors} | {', '.join(f'{c}: {n}' for c, n in t.by_code.items()) or '—'} |"
        for k, t in sorted(r.tools.items())
    ]
    if r.devices:
        lines += [
            "",
            "## Devices",
            "",
            "| executor | node | device | jobs | busy s | queued s (max) |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {u.executor} | {_cell(u.node)} | {u.device} | {u.jobs} | {u.busy_s:.1f} | "
            f"{u.queued_s:.1f} ({u.max_queued_s:.1f}) |"
            for u in r.devices
        ]
    lim, used = r.budgets["limit"], r.budgets["used"]
    lines += ["", "## Budgets", "", "| budget | used | limit |", "|---|---|---|"]
    lines += [f"| {k} | {used[k]:.1f} | {lim[k]:.1f} |" for k in ("gpu_seconds", "candidates", "wall_seconds")]
    lines += [
        "",
        "## Fingerprint",
        "",
        "```json",
        orjson.dumps(r.fingerprint, option=orjson.OPT_INDENT_2).decode(),
        "```",
    ]
    if r.reproduce:
        lines += ["", "## Reproduce", "", "```bash", *r.reproduce, "```"]
    if r.files:
        lines += ["", "## Files", ""] + [f"- {k}: `{v}`" for k, v in r.files.items()]
    return "\n".join(lines) + "\n"
