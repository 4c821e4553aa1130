"""kernels/tools/model_ab.py: the model program A/B'd through loom's own benchmark_command, over a real
stdio server, on the CPU (the tiny config): both arms run, every metric is compared, and the
revisions each arm ran are reported."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "kernels" / "tools" / "model_ab.py"


def load_tool():
    """kernels/tools/ as an import root; the tool puts benchmarks/ on sys.path for kernels_campaign."""
    if str(TOOL.parent) not in sys.path:
        sys.path.insert(0, str(TOOL.parent))
    return importlib.import_module("model_ab")


def namespace(**given) -> argparse.Namespace:
    defaults = {"env": [], "baseline_env": [], "baseline_revision": None, "revision": None, "runs": 5, "warmup": 1}
    return argparse.Namespace(**(defaults | given))


def test_arms_are_built_from_settings_and_revisions():
    tool = load_tool()
    bench = ["--random-config", "tiny"]
    arguments = tool.tool_arguments(namespace(env=["LOOM_Q4K_STAGES=16:3,56:4"]), bench)
    assert arguments["command"][1:3] == ["LOOM_Q4K_STAGES=16:3,56:4", sys.executable]
    assert arguments["baseline_command"] == [sys.executable, "-m", "kernels.llama_q4k.bench", *bench]
    assert "baseline_revision" not in arguments and arguments["cwd"] == str(REPO)
    # the same command at two revisions: no baseline command, the repository named
    arguments = tool.tool_arguments(namespace(baseline_revision="HEAD~1"), bench)
    assert "baseline_command" not in arguments
    assert (arguments["baseline_revision"], arguments["revision"], arguments["repo"]) == ("HEAD~1", "HEAD", str(REPO))
    for wrong in (namespace(), namespace(revision="HEAD"), namespace(env=["STAGES"]), namespace(env=["1X=2"])):
        with pytest.raises(SystemExit):
            tool.tool_arguments(wrong, bench)


@pytest.mark.slow
def test_the_model_program_at_two_revisions_through_a_stdio_server(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    child = subprocess.run(
        [sys.executable, str(TOOL), "--baseline-revision", "HEAD", "--baseline-env", "LOOM_Q4K_PDL=0",
         "--runs", "3", "--warmup", "0", "--out", str(tmp_path), "--home", str(tmp_path / "home"), "--",
         "--random-config", "tiny", "--prompt-len", "16", "--gen", "4", "--runs", "1", "--device", "cpu",
         "--reference", "none"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    recorded = json.loads((tmp_path / "model_ab.json").read_text())
    result = recorded["result"]
    assert recorded["arguments"]["baseline_command"][1] == "LOOM_Q4K_PDL=0"
    assert result["runs_per_arm"] == 3 and not result["failed_runs"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert result["revisions"] == {"baseline": head, "candidate": head}
    names = {m["name"]: m for m in result["metrics"]}
    assert set(names) == {spec.split(":")[0] for spec in load_tool().METRICS}
    decode = names["decode_tokens_per_s"]
    assert decode["higher_is_better"] and decode["baseline"]["median"] > 0 and decode["candidate"]["median"] > 0
    assert decode["ratio"]["ci_low"] <= decode["ratio"]["estimate"] <= decode["ratio"]["ci_high"]
    assert "| decode_tokens_per_s |" in child.stdout
    # the server removed the revision checkouts when it was done
    assert not any((tmp_path / "home" / "worktrees" / "_revisions").glob("*/*"))
