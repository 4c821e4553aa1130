"""profile and analyze_trace through the real protocol: a real torch.profiler run in the sandbox,
real fixtures from H100/H200/MI300X, the cache, the resources, and the missing-toolchain path."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server
from loom_mcp.traces.api import analyze_trace_file

from .conftest import REAL_TRACES

REDTEAM = Path(__file__).parent / "redteam"
TRACES = REAL_TRACES


@pytest.fixture
def server(tmp_path):
    roots = f"{tmp_path}:{REDTEAM}:{TRACES}"
    return build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": roots}))


@pytest.mark.anyio
async def test_analyze_real_fixture_and_read_its_resources(server):
    async with Client(server) as client:
        result = await client.call_tool("analyze_trace", {"trace": str(TRACES / "h100_bert_small.json.gz")})
        assert result.is_error is False, result.content
        data = result.structured_content
        analysis = data["analysis"]
        assert analysis["source_format"] == "kineto" and "H100" in (analysis["device"] or "")
        assert analysis["timeline"]["busy_us"] > 0 and analysis["findings"]
        assert len(json.dumps(data)) < 6000
        full = await client.read_resource(f"loom://traces/{data['analysis_id']}/analysis")
        assert json.loads(full.contents[0].text)
        png = await client.read_resource(f"loom://traces/{data['analysis_id']}/breakdown.png")
        assert png.contents[0].mime_type == "image/png"
        t0 = time.perf_counter()
        again = await client.call_tool("analyze_trace", {"trace": str(TRACES / "h100_bert_small.json.gz")})
        assert time.perf_counter() - t0 < 1.0
        assert again.structured_content["analysis_id"] == data["analysis_id"]


@pytest.mark.anyio
async def test_diff_of_two_vendors(server):
    async with Client(server) as client:
        result = await client.call_tool("analyze_trace", {
            "trace": str(TRACES / "mi300_bert_small.json.gz"),
            "baseline": str(TRACES / "h100_bert_small.json.gz"), "top_k": 5})
        assert result.is_error is False, result.content
        diff = result.structured_content["analysis"]["diff"]
        assert diff["categories"] and diff["base_total_us"] > 0


@pytest.mark.anyio
@pytest.mark.slow
async def test_profile_a_task_then_analyze_by_id(server):
    async with Client(server) as client:
        result = await client.call_tool("profile", {
            "task": str(REDTEAM / "task_rmsnorm.py"), "warmup": 1, "active": 2})
        assert result.is_error is False, result.content
        prof = result.structured_content
        assert prof["trace_id"].startswith("t") and prof["trace_bytes"] > 0
        assert prof["top_ops"], prof  # CPU ops are recorded even without a GPU
        analyzed = await client.call_tool("analyze_trace", {"trace": prof["trace_id"]})
        assert analyzed.is_error is False, analyzed.content
        analysis = analyzed.structured_content["analysis"]
        assert analysis["source_format"] == "kineto"
        # profile's headline and analyze_trace rank the same ops, on a GPU run or a CPU one.
        assert [o["name"] for o in analysis["top_ops"][:3]] == [o["name"] for o in prof["top_ops"][:3]]
        assert analysis["findings"], analysis


@pytest.mark.anyio
async def test_errors_carry_codes(server, tmp_path):
    async with Client(server) as client:
        missing = await client.call_tool("analyze_trace", {"trace": str(tmp_path / "nope.json")})
        assert missing.is_error and "[NOT_FOUND]" in missing.content[0].text
        outside = await client.call_tool("analyze_trace", {"trace": "/etc/hostname"})
        assert outside.is_error and "[NOT_ALLOWED]" in outside.content[0].text
        bad_shape = await client.call_tool("profile", {"task": str(REDTEAM / "task_rmsnorm.py"), "shape": "nope"})
        assert bad_shape.is_error and "[BAD_INPUT]" in bad_shape.content[0].text
        if shutil.which("nsys") is None:
            nsys = await client.call_tool("profile", {"profiler": "nsys", "command": ["true"]})
            assert nsys.is_error and "[TOOLCHAIN_MISSING]" in nsys.content[0].text


# ---- analyze_trace on a CPU trace
# analyze_trace on a trace recorded on CPU (no GPU activity): it ranks the host ops and names
# findings, as `profile` does, through the real protocol.

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
