"""MCP wiring only: each tool validates its arguments, calls a domain function, and returns a model.

Every call is written to the ledger before it runs and when it ends. Domain errors
(`LoomError`) become `ToolError("[CODE] message")`; a full disk or a read-only LOOM_HOME
anywhere in the call becomes [DISK_FULL] / [READ_ONLY] (even when the ledger itself can no
longer record the call); anything else unexpected is logged to stderr with its traceback and
reported as `[INTERNAL]`. When loom.toml changed on disk since the server started, every
result says so; the server keeps the rules it started with.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import anyio
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.types import ToolAnnotations
from pydantic import Field

from loom_mcp import __version__, dispatch
from loom_mcp.bench.command_models import CommandBenchmarkResult
from loom_mcp.campaigns import start_campaign as start_campaign_impl
from loom_mcp.config import LoomConfig, load_config
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.inventory import device_info as device_info_impl
from loom_mcp.models import (
    BenchmarkResult,
    Budgets,
    CampaignReportResult,
    CompileResult,
    DeviceInfoResult,
    ProfileResult,
    RunValidationResult,
    StartCampaignResult,
    SubmitResult,
)
from loom_mcp.profiling.analysis import AnalyzeTraceResult
from loom_mcp.runtime import CallScope, Services, ToolArguments, open_services, recorded
from loom_mcp.server_base import LoomServer

log = logging.getLogger("loom_mcp")

INSTRUCTIONS = (
    "loom-mcp runs the GPU optimization loop and owns the verdict. Loop: device_info -> "
    "start_campaign(repo, goal) -> profile / analyze_trace to find where time goes -> write a "
    "candidate -> compile_kernel -> run_validation -> benchmark -> submit_candidate (the only way "
    "a change is accepted; the server re-checks everything itself) -> campaign_report. "
    "Errors start with a [CODE]; fix what they name. Trust only numbers with CIs. Paths are "
    "absolute, or relative to the campaign's repo when a call gives campaign_id."
)


ShapeNames = Annotated[list[str] | None, Field(description="Subset of the task's SHAPES names; default all")]
TaskGlobals = Annotated[
    dict[str, bool | int | float | str | list[int | float]] | None,
    Field(
        max_length=64,
        description="Module-level names the task's input functions read (batch_size, dim, ...), e.g. "
        '{"batch_size": 2}; default: the campaign\'s',
    ),
]
CampaignId = Annotated[
    str | None, Field(description="Campaign to record this under; relative paths then resolve in its repo")
]
CampaignRef = Annotated[str, Field(description="From start_campaign")]

# Hints at their spec defaults (readOnly false, idempotent false; destructive/idempotent mean
# nothing for a read-only tool) are left out: every tools/list byte is agent context.
READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
RECORDS = ToolAnnotations(destructive_hint=False, open_world_hint=False)

ToolFunction = Callable[..., Awaitable[Any]]


def _ray_importable() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def build_server(config: LoomConfig | None = None) -> MCPServer:
    config = config or load_config()
    services = open_services(config)
    if config.executor.kind == "ray" and not _ray_importable():
        raise LoomError(
            ErrorCode.TOOLCHAIN_MISSING,
            "loom.toml sets [executor] kind = \"ray\", and Ray is not installed: pip install 'loom-mcp[ray]'",
        )

    @asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[Services]:
        log.info("loom-mcp %s serving; home %s", __version__, config.home)
        await dispatch.start_executor(config)  # joins (or starts) Ray now, not in a tool call
        try:
            yield services
        finally:
            await anyio.to_thread.run_sync(dispatch.stop_executor)

    server = LoomServer(
        "loom-mcp",
        title="loom-mcp",
        version=__version__,
        instructions=INSTRUCTIONS,
        lifespan=lifespan,
    )
    server.services = services

    def tool(title: str, annotations: ToolAnnotations) -> Callable[[ToolFunction], ToolFunction]:
        """Registers a tool whose every call is recorded in the ledger under the tool's name."""

        def register(fn: ToolFunction) -> ToolFunction:
            return server.tool(title=title, annotations=annotations)(recorded(services, fn.__name__)(fn))

        return register

    @tool("Device info", READ_ONLY)
    async def device_info(
        ctx: Context,
        refresh: Annotated[bool, Field(description="Re-probe torch/triton instead of the cached facts")] = False,
    ) -> DeviceInfoResult:
        """The GPUs (NVIDIA via NVML, AMD via amdsmi) and CPU this server can use: arch, memory,
        clocks, throttle state, driver and runtime versions, datasheet peaks, whether a loom job holds
        each now; plus the toolchain (torch, triton, nvcc/hipcc, profilers). Call it first."""

        await ctx.report_progress(0, total=1, message="probing devices and toolchain")
        result = await device_info_impl(config, refresh=refresh)
        await ctx.report_progress(1, total=1, message="done")
        return result

    @tool("Start campaign", RECORDS)
    async def start_campaign(
        scope: CallScope,  # names the campaign this call made
        repo: Annotated[str, Field(description="Absolute path of the git repository to optimize (its root)")],
        goal: Annotated[
            str,
            Field(
                min_length=1,
                max_length=2000,
                description="What to improve, e.g. 'decode tokens/s of llama_q4k at batch 1'",
            ),
        ],
        task: Annotated[
            str | None, Field(description="Task file (KernelBench format), absolute or repo-relative")
        ] = None,
        gpu_seconds: Annotated[float | None, Field(gt=0, description="Device-seconds budget; capped by config")] = None,
        max_candidates: Annotated[
            int | None, Field(gt=0, le=10000, description="submit_candidate budget; capped by config")
        ] = None,
        wall_seconds: Annotated[float | None, Field(gt=0, description="Wall-time budget; capped by config")] = None,
        task_globals: TaskGlobals = None,
    ) -> StartCampaignResult:
        """Bind a git repository (inside the allowed roots) and a goal into a campaign: records
        the base commit (HEAD), config fingerprint and budgets (at most the configured ceilings).
        Your working tree and branch are never touched; accepts go to branch loom/<campaign_id>."""
        requested = None
        if gpu_seconds or max_candidates or wall_seconds:
            ceiling = config.budgets
            requested = Budgets(
                gpu_seconds=gpu_seconds or ceiling.gpu_seconds,
                candidates=max_candidates or ceiling.candidates,
                wall_seconds=wall_seconds or ceiling.wall_seconds,
            )
        result = await anyio.to_thread.run_sync(
            start_campaign_impl, config, services.ledger, repo, goal, task, requested, task_globals
        )
        scope.campaign_id = result.campaign_id
        return result

    async def judged(
        run: Callable[..., Awaitable[tuple[Any, ...]]],
        ctx: Context,
        task: str,
        candidate: str,
        shapes: list[str] | None,
        campaign_id: str | None,
        task_globals: dict[str, Any] | None,
        **kwargs: Any,
    ) -> Any:
        """The result `run` (judge.run_validation, judge.run_benchmark) reports for `candidate`,
        with the call's task_globals, or the campaign's when the call names none."""
        from loom_mcp.campaigns import resolve_task_globals
        from loom_mcp.judge import JudgeCall

        campaign = services.ledger.campaign(campaign_id) if campaign_id else None
        task_globals = resolve_task_globals(campaign, task_globals)
        call = JudgeCall(task, candidate, shapes, campaign_id, progress=progress_of(ctx), task_globals=task_globals)
        return (await run(config, services.ledger, services.artifacts, call, **kwargs))[0]

    def progress_of(ctx: Context) -> Callable[[str], Awaitable[None]]:
        """Progress messages for long jobs (clients that did not ask for progress ignore them)."""
        step = 0

        async def report(message: str) -> None:
            nonlocal step
            step += 1
            await ctx.report_progress(step, total=None, message=message)

        return report

    @tool("Compile kernel", READ_ONLY)
    async def compile_kernel(
        ctx: Context,
        source: Annotated[
            str, Field(description="Path of the kernel source: .py with @triton.jit kernels, .cu, or .hip")
        ],
        language: Annotated[Literal["triton", "cuda", "hip"], Field(description="Source language")],
        target: Annotated[
            str | None, Field(max_length=32, description="sm_90, gfx942, ...; default: this server's device")
        ] = None,
        flags: Annotated[
            list[str] | None, Field(max_length=32, description="Extra nvcc/hipcc flags (e.g. -O3, -std=c++17)")
        ] = None,
        task: Annotated[
            str | None,
            Field(
                description="Triton only: a task file; the candidate runs its first shape so kernels compile for real"
            ),
        ] = None,
        task_globals: TaskGlobals = None,
    ) -> CompileResult:
        """Compile a kernel in the sandbox; per kernel: registers, spills, shared memory,
        warps/stages, occupancy estimate. Triton: runs the file's ModelNew on the task's first shape
        (pass task=); CUDA: nvcc -Xptxas -v; HIP: hipcc remarks. Errors are [COMPILE_ERROR] with your
        file:line. Cached by content hash."""
        from loom_mcp import judge  # numpy/scipy: loaded on first use, not at start

        result, _ = await judge.compile_kernel(
            config,
            services.artifacts,
            source=source,
            language=language,
            target=target,
            flags=flags or [],
            task=task,
            progress=progress_of(ctx),
            task_globals=task_globals,
        )
        if not result.ok:
            where = "; ".join(
                f"{d.file or source}:{d.line or '?'}: {d.message[:400]}"
                for d in result.diagnostics
                if d.severity == "error"
            )
            raise LoomError(ErrorCode.COMPILE_ERROR, where or "compilation failed")
        return result

    @tool("Run validation", RECORDS)
    async def run_validation(
        ctx: Context,
        task: Annotated[
            str,
            Field(
                description="Task file (KernelBench format: Model, get_inputs, get_init_inputs; optional SHAPES, TOLERANCE)"
            ),
        ],
        candidate: Annotated[
            str, Field(description="Candidate file defining ModelNew with Model's constructor and forward signature")
        ],
        seeds: Annotated[
            int | None, Field(ge=1, le=50, description="Seeds per shape (at least the server's policy, default 5)")
        ] = None,
        shapes: ShapeNames = None,
        campaign_id: CampaignId = None,
        task_globals: TaskGlobals = None,
    ) -> RunValidationResult:
        """Check a candidate against the task's reference over every shape x seed (secret seeds;
        normal, heavy-tailed, scaled inputs) in float64 with per-dtype tolerances, plus behaviour
        checks (NaN/Inf parity, aliasing, input mutation, determinism, late writes) and static checks.
        Returns passed, failing cases and findings; full table at loom://runs/{validation_id}."""
        from loom_mcp import judge

        return await judged(judge.run_validation, ctx, task, candidate, shapes, campaign_id, task_globals, seeds=seeds)

    @tool("Benchmark", RECORDS)
    async def benchmark(
        ctx: Context,
        task: Annotated[str, Field(description="Task file; its Model is the default baseline")],
        candidate: Annotated[str, Field(description="Candidate file defining ModelNew")],
        baseline: Annotated[
            str | None, Field(description="A candidate file (ModelNew) to compare against instead of the task's Model")
        ] = None,
        shapes: ShapeNames = None,
        campaign_id: CampaignId = None,
        task_globals: TaskGlobals = None,
    ) -> BenchmarkResult:
        """Time candidate vs baseline (the task's Model, or baseline=) interleaved ABBA in warm
        sandboxed workers (L2 flushed, inputs rotated, graph replay for short kernels, throttled pairs
        dropped) until 0.5 % standard error or a time cap. Returns per-shape medians and speedups with
        bootstrap 95 % CIs, roofline fraction, the geomean with its CI, and whether the candidate's own
        kernels ran."""
        from loom_mcp import judge

        return await judged(
            judge.run_benchmark, ctx, task, candidate, shapes, campaign_id, task_globals, baseline=baseline
        )

    @tool("Profile", RECORDS)
    async def profile(
        ctx: Context,
        profiler: Annotated[
            Literal["torch", "rocprofv3", "nsys"],
            Field(description="torch: a task, candidate or script; rocprofv3/nsys: wrap command"),
        ] = "torch",
        task: Annotated[
            str | None, Field(description="Task file whose Model (or candidate's ModelNew) is profiled")
        ] = None,
        candidate: Annotated[str | None, Field(description="Profile this ModelNew instead of the task's Model")] = None,
        shape: Annotated[str | None, Field(description="Task shape name; default the first")] = None,
        script: Annotated[
            str | None, Field(description="torch only: a Python script run under the profiler instead of a task")
        ] = None,
        args: Annotated[list[str] | None, Field(max_length=64, description="Arguments for script")] = None,
        command: Annotated[
            list[str] | None, Field(max_length=256, description="rocprofv3/nsys: the command to run, as argv")
        ] = None,
        warmup: Annotated[int, Field(ge=0, le=1000, description="Untraced calls first")] = 3,
        active: Annotated[int, Field(ge=1, le=100, description="Traced calls")] = 5,
        campaign_id: CampaignId = None,
    ) -> ProfileResult:
        """Run a workload under a profiler in the sandbox; the scrubbed trace is stored. torch: the
        task's Model, a candidate's ModelNew or a script (CUDA, ROCm, CPU); rocprofv3 / nsys: wrap
        `command` ([TOOLCHAIN_MISSING] when absent). Returns trace_id and a headline; then analyze_trace."""
        from loom_mcp import judge
        from loom_mcp.dispatch import campaign_kind
        from loom_mcp.profiling.runner import profile_workload

        task_path = judge.check_file(config, task, "task") if task else None
        cand_path = judge.check_file(config, candidate, "candidate") if candidate else None
        script_path = judge.check_file(config, script, "script") if script else None
        kind = campaign_kind(services.ledger, services.artifacts, campaign_id)
        progress = progress_of(ctx)  # one reporter for the whole call: its steps only increase
        async with judge.Leased(config, await judge.pick_target(config), progress, kind) as held:
            # torch runs on the slot it was given; a vendor profiler's command picks its own device.
            device = held.target.torch_device if profiler == "torch" else "auto"
            result = await profile_workload(
                config,
                services.ledger,
                services.artifacts,
                profiler=profiler,
                task=task_path,
                candidate=cand_path,
                shape=shape,
                script=script_path,
                args=args or [],
                command=command,
                warmup=warmup,
                active=active,
                device=device,
                campaign_id=campaign_id,
                progress=progress,
            )
        return result

    @tool("Analyze trace", READ_ONLY)
    async def analyze_trace(
        ctx: Context,
        trace: Annotated[
            str,
            Field(
                description="A trace_id from profile, or a trace file: Kineto JSON (.json/.json.gz), rocprofv3 JSON, nsys SQLite"
            ),
        ],
        baseline: Annotated[
            str | None, Field(description="Another trace id or path: report what got faster or slower")
        ] = None,
        top_k: Annotated[int, Field(ge=1, le=50, description="Top ops to list")] = 10,
    ) -> AnalyzeTraceResult:
        """Where the time goes and what is most to win: the GPU timeline (compute, exposed
        communication/memcpy, idle), kernels linked to their ops, categories (GEMM, attention, ...),
        top ops with FLOPs/bytes and % of roofline, and findings ranked by Amdahl ceiling, each naming
        the next tool. With baseline: deltas. Full tables: loom://traces/{analysis_id}/analysis."""
        from loom_mcp.profiling.analysis import analyze

        await ctx.report_progress(0, total=1, message="analyzing trace")
        result = await anyio.to_thread.run_sync(
            analyze, config, services.ledger, services.artifacts, trace, baseline, top_k
        )
        await ctx.report_progress(1, total=1, message="done")
        return result

    @tool("Submit candidate", RECORDS)
    async def submit_candidate(
        arguments: ToolArguments,
        ctx: Context,
        campaign_id: CampaignRef,
        task: Annotated[str, Field(description="Task file (KernelBench format) the candidate is judged against")],
        candidate: Annotated[
            str, Field(description="Candidate file defining ModelNew (inside the campaign repo, or anywhere allowed)")
        ],
        paths: Annotated[
            list[str] | None,
            Field(max_length=200, description="Other repo-relative files of the change; frozen with the candidate"),
        ] = None,
        task_globals: TaskGlobals = None,
    ) -> SubmitResult:
        """The gate, the only way a change is accepted. The server freezes the candidate (content
        hash + a worktree at the campaign tip; later edits do not count), re-runs compile, validation
        and benchmark itself, and decides with the human's thresholds: accept iff validation passes and
        the geomean speedup's CI lower bound clears 1 + min_gain with no shape clearly slower;
        needs_review when implausible. Accepts commit to loom/<campaign_id>. Failures that are not the
        candidate's spend no candidate (device time held still counts)."""
        from loom_mcp.submissions import submit_candidate as submit

        result, _ = await submit(config, services.ledger, services.artifacts, **arguments, progress=progress_of(ctx))
        return result

    @tool("Campaign report", READ_ONLY)
    async def campaign_report(
        campaign_id: CampaignRef,
    ) -> CampaignReportResult:
        """The campaign from the ledger: accepted chain and cumulative speedup, every attempt
        with verdict and reasons, outcome rates, per-tool errors, budgets used, fingerprints, the
        accepted patch and reproduction commands. Markdown at loom://campaigns/{id}/report."""

        from loom_mcp.report.campaign import write_report

        report = await anyio.to_thread.run_sync(write_report, config, services.ledger, services.artifacts, campaign_id)
        return CampaignReportResult(
            campaign_id=campaign_id,
            accepted=len(report.accepted),
            attempts=len(report.attempts),
            cumulative_speedup=report.cumulative_speedup,
            branch=report.branch,
            branch_tip=report.branch_tip,
            outcome_rates=report.outcome_rates,
            budgets=report.budgets,
            files=report.files,
            next_step=f"read loom://campaigns/{campaign_id}/report or {report.files.get('markdown')}",
        )

    @tool("Benchmark commands", RECORDS)
    async def benchmark_command(
        arguments: ToolArguments,
        ctx: Context,
        command: Annotated[
            list[str],
            Field(
                min_length=1, max_length=256, description="The candidate, as argv; with revisions, what both arms run"
            ),
        ],
        baseline_command: Annotated[
            list[str] | None,
            Field(
                min_length=1, max_length=256, description="The baseline, as argv; with revisions, defaults to `command`"
            ),
        ] = None,
        metrics: Annotated[
            list[str] | None,
            Field(
                max_length=20,
                description="Metrics to compare (name, or name:higher / name:lower); default: the parser's headline ones",
            ),
        ] = None,
        runs: Annotated[int, Field(ge=3, le=200, description="Runs per arm, interleaved ABBA")] = 5,
        parser: Annotated[
            Literal["auto", "json", "vllm", "sglang"],
            Field(description="json: last JSON object on stdout; vllm / sglang: their benchmark result JSON"),
        ] = "auto",
        metrics_file: Annotated[
            str | None, Field(description="Read metrics from this file (relative to cwd) instead of stdout")
        ] = None,
        cwd: Annotated[
            str | None,
            Field(description="Working directory of both commands; with revisions, the same path inside each worktree"),
        ] = None,
        warmup: Annotated[int, Field(ge=0, le=10, description="Unrecorded runs per arm first")] = 0,
        baseline_revision: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=256,
                description="A git revision (commit, branch, tag): each arm then runs in a fresh worktree of `repo` at its own revision (committed content only)",
            ),
        ] = None,
        revision: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=256,
                description="The candidate arm's revision (default HEAD); needs baseline_revision",
            ),
        ] = None,
        repo: Annotated[
            str | None, Field(description="The git repository of the revisions (default: cwd, else the campaign's)")
        ] = None,
        campaign_id: CampaignId = None,
    ) -> CommandBenchmarkResult:
        """Compare two whole programs (a model server benchmark, a script), or one command at
        two git revisions, `runs` times each interleaved ABBA in the sandbox (loopback network only):
        per metric they print (JSON; vLLM/SGLang results understood) each arm's median and the
        improvement factor with bootstrap CIs (> 1 = candidate better)."""
        from loom_mcp.command_benchmark import run_command_benchmark

        return await run_command_benchmark(
            config, services.ledger, services.artifacts, **arguments, progress=progress_of(ctx)
        )

    from loom_mcp.server_resources import add_resources

    add_resources(server, config, services)
    return server
