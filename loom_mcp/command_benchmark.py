"""`benchmark_command`: two whole programs (or one command at two git revisions) compared in the
sandbox, leased on the device, and recorded in the ledger with every run's samples."""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson

from loom_mcp import judge
from loom_mcp.bench.command import benchmark_commands
from loom_mcp.bench.command_models import Arm, CommandBenchmarkResult
from loom_mcp.bench.metrics import ParserName
from loom_mcp.bench.revisions import revision_checkouts, revisions_root, uncommitted_finding
from loom_mcp.config import LoomConfig
from loom_mcp.dispatch import campaign_kind
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.models import Placement
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import safefs
from loom_mcp.sandbox.runner import Progress
from loom_mcp.store import ArtifactStore, Ledger, new_run_id


async def run_command_benchmark(
    config: LoomConfig,
    ledger: Ledger,
    artifacts: ArtifactStore,
    *,
    command: list[str],
    baseline_command: list[str] | None,
    metrics: list[str] | None,
    runs: int,
    parser: ParserName,
    metrics_file: str | None,
    cwd: str | None,
    warmup: int,
    baseline_revision: str | None,
    revision: str | None,
    repo: str | None,
    campaign_id: str | None,
    progress: Progress | None,
) -> CommandBenchmarkResult:
    if baseline_revision is None and (revision is not None or repo is not None):
        raise LoomError(ErrorCode.BAD_INPUT, "revision and repo need baseline_revision")
    if baseline_revision is None and baseline_command is None:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            "give baseline_command, or baseline_revision to run `command` at two revisions",
        )
    cwd_path = config.check_allowed(Path(cwd), "cwd") if cwd else None
    run_id = new_run_id("benchmark")
    target = await judge.pick_target(config)

    placements: list[Placement] = []  # each ends (ended_at) when its lease does

    async def measure(where: Path | dict[Arm, Path] | None) -> CommandBenchmarkResult:
        kind = campaign_kind(ledger, artifacts, campaign_id)
        async with judge.Leased(config, target, progress, kind) as held:
            if held.target.placement:
                placements.append(held.target.placement)
            # On a GPU the commands see only the GPU the lease holds, as every other job does.
            gpu = job_placement(held.target.torch_device)[2] if held.target.is_gpu else None
            result = await benchmark_commands(
                baseline=baseline_command or command,
                candidate=command,
                metrics=metrics,
                runs=runs,
                # the server's settings, none of them the caller's
                gate=config.gate,
                job_dir=config.jobs_dir / run_id,
                timeout_s=config.job_timeout_s,
                # how the caller's commands run
                cwd=where,
                parser=parser,
                metrics_file=metrics_file,
                warmup=warmup,
                progress=progress,
                visible_devices=gpu,
            )
        return result

    if baseline_revision is None:
        result = await measure(cwd_path)
    else:
        repo_path = config.check_allowed(Path(repo), "repo") if repo else cwd_path
        if repo_path is None and campaign_id is not None:
            campaign = ledger.campaign(campaign_id)
            repo_path = Path(campaign["repo"]) if campaign else None
        if repo_path is None:
            raise LoomError(ErrorCode.BAD_INPUT, "revisions need repo (or cwd, or a campaign) to name the repository")
        wanted: dict[Arm, str] = {"baseline": baseline_revision, "candidate": revision or "HEAD"}
        root = revisions_root(config.home, run_id)
        async with revision_checkouts(repo_path, wanted, root, cwd_path) as checkouts:
            result = await measure(checkouts.cwds)
        result.revisions = checkouts.commits
        result.findings += await anyio.to_thread.run_sync(
            uncommitted_finding, repo_path, checkouts.commits["candidate"]
        )
    result.benchmark_id = run_id

    samples_path = Path(result.samples_file)  # in the run's job directory: no link followed
    samples = orjson.loads(safefs.read_bytes(samples_path.parent, samples_path.name, 256 << 20))
    judge.store_record(
        ledger,
        artifacts,
        run_id,
        "benchmark",
        {
            "mode": "command",
            "samples": samples,
            "result": result.model_dump(),
            "placement": placements[-1].model_dump() if placements else None,
        },
        result,
        campaign_id,
    )
    return result
