"""What the server offers to read rather than to call: the resources behind the tools' results
(full trace analyses, run and campaign records, reports, full output schemas) and the loop
prompt. `add_resources` registers them on the server `build_server` made, after its tools."""

from __future__ import annotations

from pathlib import Path

import orjson
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError

from loom_mcp.config import LoomConfig
from loom_mcp.errors import LoomError
from loom_mcp.runtime import Services, config_notes


def add_resources(server: MCPServer, config: LoomConfig, services: Services) -> None:
    def analysis_path(analysis_id: str, name: str) -> Path:
        from loom_mcp.profiling.analysis import analysis_file

        try:
            return analysis_file(config, analysis_id, name)
        except LoomError as exc:
            raise ResourceNotFoundError(str(exc)) from exc

    @server.resource(
        "loom://traces/{analysis_id}/analysis",
        name="trace_analysis",
        title="Full trace analysis (JSON tables)",
        mime_type="application/json",
    )
    def trace_analysis_resource(analysis_id: str) -> str:
        return analysis_path(analysis_id, "analysis.json").read_text()

    @server.resource(
        "loom://traces/{analysis_id}/breakdown.png",
        name="trace_breakdown",
        title="Time breakdown plot",
        mime_type="image/png",
    )
    def trace_breakdown_resource(analysis_id: str) -> bytes:
        return analysis_path(analysis_id, "breakdown.png").read_bytes()

    @server.resource(
        "loom://campaigns/{campaign_id}/report",
        name="campaign_report",
        title="Campaign report (Markdown)",
        mime_type="text/markdown",
    )
    def campaign_report_resource(campaign_id: str) -> str:
        path = config.home / "reports" / campaign_id / "report.md"
        if not path.is_file():
            raise ResourceNotFoundError(f"no report for {campaign_id!r} yet; call campaign_report")
        return path.read_text()

    @server.resource(
        "loom://runs/{run_id}", name="run", title="Full validation/benchmark record", mime_type="application/json"
    )
    def run_resource(run_id: str) -> str:
        row = services.ledger.run(run_id)
        if row is None:
            raise ResourceNotFoundError(f"no run {run_id!r}")
        return services.artifacts.get_bytes(row["record_sha"]).decode()

    @server.resource(
        "loom://campaigns/{campaign_id}", name="campaign", title="Campaign record", mime_type="application/json"
    )
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

    @server.resource(
        "loom://schemas/{tool}",
        name="output_schema",
        mime_type="application/json",
        title="A tool's full output schema (tools/list publishes nested objects untyped)",
    )
    def output_schema_resource(tool: str) -> str:
        if tool not in full_output_schemas:
            raise ResourceNotFoundError(f"no tool {tool!r}; the tools are: {', '.join(full_output_schemas)}")
        return orjson.dumps(full_output_schemas[tool], option=orjson.OPT_INDENT_2).decode()
