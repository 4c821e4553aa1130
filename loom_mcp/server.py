"""MCP wiring only: each tool validates its arguments, calls a domain function, and returns a model.

Every call is written to the ledger before it runs and when it ends. Domain errors
(`LoomError`) become `ToolError("[CODE] message")`; anything unexpected is logged to
stderr with its traceback and reported as `[INTERNAL]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import anyio
import orjson
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from loom_mcp import __version__
from loom_mcp.campaigns import start_campaign as start_campaign_impl
from loom_mcp.config import LoomConfig, load_config
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.inventory import device_info as device_info_impl
from loom_mcp.models import Budgets, DeviceInfoResult, StartCampaignResult
from loom_mcp.store import ArtifactStore, Ledger

log = logging.getLogger("loom_mcp")

INSTRUCTIONS = (
    "loom-mcp runs the GPU optimization loop and owns the verdict. Loop: device_info -> "
    "start_campaign(repo, goal) -> profile / analyze_trace to find where time goes -> write a "
    "candidate -> compile_kernel -> run_validation -> benchmark -> submit_candidate (the only way "
    "a change is accepted; the server re-checks everything itself) -> campaign_report. "
    "Errors start with a [CODE]; fix what they name. Trust only numbers with CIs."
)

T = TypeVar("T")


@dataclass
class Services:
    config: LoomConfig
    ledger: Ledger
    artifacts: ArtifactStore


@dataclass
class CallScope:
    """Per-call accounting handed to domain code (device seconds come from leases held)."""

    device_s: float = 0.0
    campaign_id: str | None = None
    notes: list[str] = field(default_factory=list)


def open_services(config: LoomConfig) -> Services:
    for directory in (config.home, config.jobs_dir, config.locks_dir, config.cache_dir):
        directory.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(config.ledger_path)
    if ledger.interrupted_on_open:
        log.warning("%d call(s) from a previous server were interrupted", ledger.interrupted_on_open)
    return Services(config=config, ledger=ledger, artifacts=ArtifactStore(config.artifacts_dir, ledger))


async def run_recorded(
    services: Services,
    tool: str,
    arguments: dict[str, Any],
    body: Callable[[CallScope], Awaitable[T]],
    campaign_id: str | None = None,
) -> T:
    """Ledger bookkeeping and error translation around one tool call."""
    scope = CallScope(campaign_id=campaign_id)
    call_id = services.ledger.begin_call(tool, arguments, campaign_id)
    try:
        result = await body(scope)
    except LoomError as exc:
        services.ledger.end_call(
            call_id, "error", error_code=exc.code.value, device_s=scope.device_s,
            campaign_id=scope.campaign_id,
        )
        raise ToolError(str(exc)) from exc
    except anyio.get_cancelled_exc_class():
        # Shielded: the ledger write must happen even though this task is being cancelled.
        with anyio.CancelScope(shield=True):
            services.ledger.end_call(call_id, "cancelled", error_code=ErrorCode.CANCELLED.value,
                                     device_s=scope.device_s, campaign_id=scope.campaign_id)
        raise
    except Exception as exc:
        log.exception("tool %s failed", tool)
        services.ledger.end_call(call_id, "error", error_code=ErrorCode.INTERNAL.value,
                                 device_s=scope.device_s, campaign_id=scope.campaign_id)
        raise ToolError(
            f"[INTERNAL] {tool} failed unexpectedly ({type(exc).__name__}); the server log has details"
        ) from exc
    services.ledger.end_call(call_id, "ok", device_s=scope.device_s, campaign_id=scope.campaign_id)
    return result


READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                            open_world_hint=False)
RECORDS = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                          open_world_hint=False)


def build_server(config: LoomConfig | None = None) -> MCPServer:
    config = config or load_config()
    services = open_services(config)

    @asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[Services]:
        log.info("loom-mcp %s serving; home %s", __version__, config.home)
        yield services

    server = MCPServer(
        "loom-mcp",
        title="loom-mcp",
        version=__version__,
        instructions=INSTRUCTIONS,
        lifespan=lifespan,
    )

    @server.tool(title="Device info", annotations=READ_ONLY)
    async def device_info(
        ctx: Context,
        refresh: Annotated[bool, Field(description="Re-probe torch/triton instead of the cached facts")] = False,
    ) -> DeviceInfoResult:
        """List the GPUs (NVIDIA via NVML, AMD via amdsmi) and CPU this server can use: name, arch
        (sm_90, gfx942), memory, clocks, throttle state, driver and CUDA/ROCm versions, datasheet peaks
        (bandwidth, FLOP/s by dtype) and whether a loom job holds the device now; plus the toolchain
        (python, torch, triton, nvcc/hipcc, ncu/nsys/rocprofv3). Call it first; backends explains any
        vendor library that is missing."""

        async def body(scope: CallScope) -> DeviceInfoResult:
            await ctx.report_progress(0, total=1, message="probing devices and toolchain")
            result = await device_info_impl(config, refresh=refresh)
            await ctx.report_progress(1, total=1, message="done")
            return result

        return await run_recorded(services, "device_info", {"refresh": refresh}, body)

    @server.tool(title="Start campaign", annotations=RECORDS)
    async def start_campaign(
        repo: Annotated[str, Field(description="Absolute path of the git repository to optimize (its root)")],
        goal: Annotated[str, Field(min_length=1, max_length=2000,
                                   description="What to improve, e.g. 'decode tokens/s of llama_q4k at batch 1'")],
        task: Annotated[str | None, Field(description="Task file (KernelBench format), absolute or repo-relative")] = None,
        gpu_seconds: Annotated[float | None, Field(gt=0, description="Device-seconds budget; capped by the server's config")] = None,
        max_candidates: Annotated[int | None, Field(gt=0, le=10000, description="submit_candidate budget; capped by config")] = None,
        wall_seconds: Annotated[float | None, Field(gt=0, description="Wall-time budget; capped by config")] = None,
    ) -> StartCampaignResult:
        """Bind a git repository and a goal into a campaign: records the base commit (HEAD), the
        server's config fingerprint and the budgets (GPU-seconds, candidates, wall time; you may ask for
        less than the configured ceiling, never more). The repo must be inside the allowed roots. Your
        working tree and branch are never touched; accepted changes go to branch loom/<campaign_id>.
        Returns campaign_id for every later call."""
        arguments = {"repo": repo, "goal": goal, "task": task, "gpu_seconds": gpu_seconds,
                     "max_candidates": max_candidates, "wall_seconds": wall_seconds}

        async def body(scope: CallScope) -> StartCampaignResult:
            requested = None
            if gpu_seconds or max_candidates or wall_seconds:
                ceiling = config.budgets
                requested = Budgets(
                    gpu_seconds=gpu_seconds or ceiling.gpu_seconds,
                    candidates=max_candidates or ceiling.candidates,
                    wall_seconds=wall_seconds or ceiling.wall_seconds,
                )
            result = await anyio.to_thread.run_sync(
                start_campaign_impl, config, services.ledger, repo, goal, task, requested
            )
            scope.campaign_id = result.campaign_id
            return result

        return await run_recorded(services, "start_campaign", arguments, body)

    @server.resource("loom://campaigns/{campaign_id}", name="campaign", title="Campaign record",
                     mime_type="application/json")
    def campaign_resource(campaign_id: str) -> str:
        row = services.ledger.campaign(campaign_id)
        if row is None:
            raise ResourceNotFoundError(f"no campaign {campaign_id!r}")
        row["budgets"] = orjson.loads(row.pop("budgets_json"))
        calls = services.ledger.calls(campaign_id=campaign_id)
        row["calls"] = [c.model_dump(exclude={"pid"}) for c in calls]
        return orjson.dumps(row, option=orjson.OPT_INDENT_2).decode()

    @server.prompt(title="Optimization loop")
    def optimization_loop(goal: str, repo: str = ".") -> str:
        """The loop playbook for one goal."""
        return (
            f"Goal: {goal}\nRepository: {repo}\n\n"
            "1. device_info: know the device, its peaks and toolchain.\n"
            "2. start_campaign(repo, goal): note the campaign_id.\n"
            "3. Find where the time goes (profile, analyze_trace); pick the op with the largest "
            "Amdahl ceiling.\n"
            "4. Write a candidate ModelNew for the task; compile_kernel, then run_validation until it "
            "passes, then benchmark against the baseline.\n"
            "5. submit_candidate: the server re-runs everything and decides. Never edit the task's "
            "reference; never chase a result inside the confidence interval.\n"
            "6. campaign_report when done."
        )

    return server
