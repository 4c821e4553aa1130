"""Red team, degenerate outputs: on a softmax over 20-30k columns every probability is below
fp32's atol (1e-4) and far below bf16's (1e-2), so all zeros, the row mean everywhere, or the
answer times 1e-3 met |out - ref| <= atol + rtol |ref| on every element. The tolerance is now
relative to the reference's scale (atol capped at its RMS, plus a normwise bound); each such
output must be rejected with `validation.mismatch`, and honest candidates, among them the
reference's own code copied into ModelNew, must still pass. Through the real MCP protocol and
sandboxed workers, on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server

REDTEAM = Path(__file__).parent / "redteam"
TASK = "task_softmax_wide.py"

CHEATS = {
    "cheat_zero_softmax.py": "all zeros",
    "cheat_constant_output.py": "the row mean everywhere",
    "cheat_scaled_copy.py": "the answer times 1e-3",
}
HONEST = ["honest_softmax_wide.py", "honest_softmax_wide_fused.py"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("degenerate")
    shutil.copytree(REDTEAM, root / "redteam")
    return root


@pytest.fixture(scope="module")
def server(workspace):
    return build_server(load_config(workspace / "home", environ={"LOOM_ALLOWED_ROOTS": str(workspace)}))


async def validate(server, workspace: Path, candidate: str) -> tuple[dict, dict]:
    """(the tool's result, the full evidence from loom://runs/{id})."""
    async with Client(server) as client:
        result = await client.call_tool("run_validation", {
            "task": str(workspace / "redteam" / TASK),
            "candidate": str(workspace / "redteam" / candidate)})
        assert result.is_error is False, result.content
        report = result.structured_content
        record = await client.read_resource(f"loom://runs/{report['validation_id']}")
    return report, json.loads(record.contents[0].text)["evidence"]


@pytest.mark.anyio
@pytest.mark.parametrize("candidate", sorted(CHEATS))
@pytest.mark.slow
async def test_degenerate_outputs_are_rejected_as_mismatch(server, workspace, candidate):
    report, evidence = await validate(server, workspace, candidate)
    errors = {f["check"]: f["message"] for f in report["findings"] if f["severity"] == "error"}
    assert report["passed"] is False, f"{CHEATS[candidate]} passed validation"
    assert "validation.mismatch" in errors, errors
    message = errors["validation.mismatch"]
    assert "normwise relative error" in message and "reference RMS" in message, message
    # Every fp32 case fails (bf16 on nearly uniform rows may not: there a constant is as close to
    # the float64 answer as the bf16 reference itself is). The evidence carries both numbers.
    fp32 = [c for c in evidence["cases"] if c["dtype"] == "fp32"]
    assert fp32 and not any(c["passed"] for c in fp32)
    for case in fp32:
        assert case["norm_rel_err"] > case["norm_rel_bound"] >= 1e-4
        assert case["ref_norm_rel_err"] is not None and case["ref_norm_rel_err"] < 1e-5
        assert case["atol_effective"] < case["atol"]  # the RMS (~4e-5) caps atol's 1e-4
        assert 1e-5 < case["ref_rms"] < 1e-4


@pytest.mark.anyio
@pytest.mark.parametrize("candidate", HONEST)
async def test_honest_wide_softmax_passes_in_fp32_and_bf16(server, workspace, candidate):
    report, evidence = await validate(server, workspace, candidate)
    assert report["passed"] is True, report
    assert report["cases_failed"] == 0 and report["cases_total"] == 3 * 5
    assert {c["dtype"] for c in evidence["cases"]} == {"fp32", "bf16"}
    for case in evidence["cases"]:
        assert case["norm_rel_err"] <= case["norm_rel_bound"]
        if candidate == "honest_softmax_wide.py":  # the reference's own arithmetic, to the bit
            assert case["norm_rel_err"] == pytest.approx(case["ref_norm_rel_err"])
