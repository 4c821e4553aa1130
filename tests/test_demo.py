"""The README's main job: `loom-mcp demo` drives the loop through a real stdio server and ends with
the cheat rejected, the candidate accepted and a report; every tool result stays compact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loom_mcp.demo import wall_clock_notice, write_config

LOOM = str(Path(sys.executable).with_name("loom-mcp"))


@pytest.mark.slow
def test_demo_runs_the_whole_loop(tmp_path):
    done = subprocess.run([LOOM, "demo", "--workdir", str(tmp_path / "demo")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-2])
    assert summary["cheat"] == "reject"
    assert summary["candidate"] == "accept"
    report = Path(summary["report"]).read_text()
    assert "Accepted chain" in report and "Every attempt" in report
    assert "speedup_png" in report and "breakdown_png" in report  # plots for people
    for step in ("device_info", "start_campaign", "profile", "analyze_trace", "compile_kernel",
                 "run_validation", "benchmark", "submit_candidate", "campaign_report"):
        assert step in summary["largest_result_bytes"], step
    too_big = {k: v for k, v in summary["largest_result_bytes"].items() if v > 4096}
    assert not too_big, f"tool results over 4 KB: {too_big}"
    if summary["wall_clock_accepts_allowed"]:  # a CPU-only machine: the demo must say why it accepts
        assert "sets [gate] accept_wall_clock = true" in done.stdout
        assert "only because this demo's loom.toml allows it" in done.stdout


def test_demo_config_says_when_it_allows_wall_clock_accepts(tmp_path):
    write_config(tmp_path / "cpu", tmp_path, cpu_only=True)
    notice = wall_clock_notice(tmp_path / "cpu")
    assert notice and "accept_wall_clock = true" in notice and "needs_review" in notice
    write_config(tmp_path / "gpu", tmp_path, cpu_only=False)
    assert wall_clock_notice(tmp_path / "gpu") is None
