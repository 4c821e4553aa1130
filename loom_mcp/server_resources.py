"""What the server offers to read rather than to call: the resources behind the tools' results
(full trace analyses, run and campaign records, reports, full output schemas) and the loop
prompt. `add_resources` registers them on the server `build_server` made, after its tools."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError

from loom_mcp.config import LoomConfig
from loom_mcp.errors import LoomError
from loom_mcp.runtime import Services, config_notes

JSON = "application/json"  # most resources are JSON records
Reader = Callable[..., str | bytes]  # a resource's reader: its URI's parameters in, the content out


def add_resources(server: MCPServer, config: LoomConfig, services: Services) -> None:
    def resource(uri: str, name: str, title: str, mime_type: str = JSON) -> Callable[[Reader], Reader]:
        return server.resource(uri, name=name, title=title, mime_type=mime_type)

    def analysis_path(analysis_id: str, name: str) -> Path:
        from loom_mcp.profiling.analysis import analysis_file

        try:
            return analysis_file(config, analysis_id, name)
        except LoomError as exc:
            raise ResourceNotFoundError(str(exc)) from exc

    @resource("loom://traces/{analysis_id}/analysis", "trace_analysis", "Full trace analysis (JSON tables)")
    def trace_analysis_resource(analysis_id: str) -> str:
        return analysis_path(analysis_id, "analysis.json").read_text()

    @resource("loom://traces/{analysis_id}/breakdown.png", "trace_breakdown", "Time breakdown plot", "image/png")
    def trace_breakdown_resource(analysis_id: str) -> bytes:
        return analysis_path(analysis_id, "breakdown.png").read_bytes()

    @resource("loom://campaigns/{campaign_id}/report", "campaign_report", "Campaign report (Markdown)", "text/markdown")
    def campaign_report_resource(campaign_id: str) -> str:
        path = config.home / "reports" / campaign_id / "report.md"
        if not path.is_file():
            raise ResourceNotFoundError(f"no report for {campaign_id!r} yet; call campaign_report")
        return path.read_text()

    @resource("loom://runs/{run_id}", "run", "Full validation/benchmark record")
    def run_resource(run_id: str) -> str:
        row = services.ledger.run(run_id)
        if row is None:
            raise ResourceNotFoundError(f"no run {run_id!r}")
        return services.artifacts.get_bytes(row["record_sha"]).decode()

    @resource("loom://campaigns/{campaign_id}", "campaign", "Campaign record")
    def campaign_resource(campaign_id: str) -> str:
        row = services.ledger.campaign(campaign_id)
        if row is None:
            raise ResourceNotFoundError(f"no campaign {campaign_id!r}")
        from loom_mcp.submissions import campaign_budgets

        in_force, warnings = campaign_budgets(row, config.budgets)
        row["budgets"] = orjson.loads(row.pop("budgets_json"))  # as recorded
        row["budgets_in_force"] = in_force.model_dump()  # never above the configured ceilings
        warnings += config_notes(services)
        if warnings:
            row["warnings"] = warnings
        calls = services.ledger.calls(campaign_id=campaign_id)
        row["calls"] = [c.model_dump(exclude={"pid"}) for c in calls]
        return orjson.dumps(row, option=orjson.OPT_INDENT_2).decode()

    @server.prompt(title="Optimization loop")
    def optimization_loop(goal: str, repo: str = "") -> str:
        """The loop playbook for one goal (repo: the repository's absolute path)."""
        # Tools refuse relative paths (they would resolve against the server's directory).
        where = repo if repo.startswith("/") else "(its absolute path: tools refuse relative ones)"
        return (
            f"Goal: {goal}\nRepository: {where}\n\n"
            "1. device_info: know the device, its peaks and toolchain.\n"
            "2. start_campaign(repo=<absolute path>, goal): note the campaign_id; later paths may "
            "be relative to that repository.\n"
            "3. Find where the time goes (profile, analyze_trace); pick the op with the largest "
            "Amdahl ceiling.\n"
            "4. Write a candidate ModelNew for the task; compile_kernel, then run_validation until it "
            "passes, then benchmark against the baseline.\n"
            "5. submit_candidate: the server re-runs everything and decides. Never edit the task's "
            "reference; never chase a result inside the confidence interval.\n"
            "6. campaign_report when done."
        )

    from loom_mcp.tool_contract import tighten_tools

    full_output_schemas = tighten_tools(server._tool_manager.list_tools())

    @resource(
        "loom://schemas/{tool}",
        "output_schema",
        "A tool's full output schema (tools/list publishes nested objects untyped)",
    )
    def output_schema_resource(tool: str) -> str:
        if tool not in full_output_schemas:
            raise ResourceNotFoundError(f"no tool {tool!r}; the tools are: {', '.join(full_output_schemas)}")
        return orjson.dumps(full_output_schemas[tool], option=orjson.OPT_INDENT_2).decode()
