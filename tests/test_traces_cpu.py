"""analyze_trace on a trace recorded on CPU (no GPU activity): it ranks the host ops and names
findings, as `profile` does, through the real protocol."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server
from loom_mcp.traces.api import analyze_trace_file

CPU_TRACE = Path(__file__).parent / "fixtures" / "traces_cpu" / "kineto_cpu_rmsnorm.json"


@pytest.mark.anyio
async def test_analyze_trace_of_a_cpu_trace_lists_top_ops_and_findings(tmp_path):
    roots = f"{tmp_path}:{CPU_TRACE.parent}"
    server = build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": roots}))
    async with Client(server) as client:
        result = await client.call_tool("analyze_trace", {"trace": str(CPU_TRACE)})
        assert result.is_error is False, result.content
        data = result.structured_content
        full = await client.read_resource(f"loom://traces/{data['analysis_id']}/analysis")
        png = await client.read_resource(f"loom://traces/{data['analysis_id']}/breakdown.png")
    # The full tables and the plot are of the host ops too.
    assert [o["name"] for o in json.loads(full.contents[0].text)["ops"][:2]] == ["aten::pow", "aten::mul"]
    assert png.contents[0].mime_type == "image/png"
    analysis = data["analysis"]
    assert analysis["timeline"]["gpu_events"] == 0
    names = [op["name"] for op in analysis["top_ops"]]
    # The three costly ops of the eager RMSNorm, not the profiler's step marker around them.
    assert {"aten::pow", "aten::mul", "aten::mean"} <= set(names), names
    assert not any(n.startswith("ProfilerStep#") for n in names)
    assert sum(op["pct"] for op in analysis["top_ops"]) == pytest.approx(100, abs=0.5)
    kinds = {f["kind"] for f in analysis["findings"]}
    assert {"host_hotspot", "unfused_elementwise"} <= kinds, analysis["findings"]
    assert analysis["linking"]["partial"] is False
    assert "host op time" in data["next_step"]


def test_nested_ops_are_counted_once():
    """Top-level host time only: aten::mean's own aten::sum inside it is not counted again,
    so the shares add up to the host op time, not more."""
    summary = analyze_trace_file(CPU_TRACE, top_k=20)
    names = [op.name for op in summary.top_ops]
    assert "aten::sum" not in names and "aten::fill_" not in names, names
    total = sum(op.us for op in summary.top_ops)
    assert all(op.pct == pytest.approx(100 * op.us / total, abs=0.1) for op in summary.top_ops)
