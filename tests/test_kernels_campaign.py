"""benchmarks/kernels_campaign.py: the repository it builds, and one real run over stdio MCP."""

from __future__ import annotations

import importlib.util
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "kernels_campaign.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("kernels_campaign", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_select_tasks_names_what_it_skips(tmp_path):
    tool = load_tool()
    for name, files in {"a": ("task.py", "candidate.py"), "b": ("task.py",), "c": ()}.items():
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("")
    assert tool.select_tasks(None, tmp_path) == (["a"], [])
    tasks, notes = tool.select_tasks("a,b,zz,a", tmp_path)
    assert tasks == ["a"]
    assert notes == [
        "b: kernels/b/ has no candidate.py, skipped",
        "zz: no kernels/zz/ directory, skipped",
    ]


def test_repo_leaves_the_candidate_as_the_change_and_cuts_shapes(tmp_path):
    tool = load_tool()
    repo, head = tool.make_repo(tmp_path, ROOT / "kernels", ["silu_mul"], 2)
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    assert "kernels/silu_mul/task.py" in tracked and "kernels/rmsnorm/candidate.py" in tracked
    assert "kernels/silu_mul/candidate.py" not in tracked and "__pycache__" not in tracked
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True
    ).stdout
    assert status.strip() == "?? kernels/silu_mul/candidate.py"
    original = runpy.run_path(str(ROOT / "kernels" / "silu_mul" / "task.py"))
    cut = runpy.run_path(str(repo / "kernels" / "silu_mul" / "task.py"))
    cheapest = sorted(original["SHAPES"], key=lambda s: original["bytes_moved"](**s))[:2]
    assert cut["SHAPES"] == cheapest


@pytest.mark.slow
def test_one_task_through_the_real_server(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tasks",
            "silu_mul",
            "--max-shapes",
            "1",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "kernels_campaign.json").read_text())
    (row,) = doc["results"]
    assert row["verdict"] in ("accept", "reject", "needs_review")
    assert row["submission_id"].startswith("s") and row["validation_id"].startswith("v")
    assert row["validation"]["cases_total"] > 0
    md = (out / "kernels_campaign.md").read_text()
    assert f"| silu_mul | {row['verdict']} |" in md and row["submission_id"] in md
    assert f"| silu_mul | {row['verdict']} |" in done.stdout
    assert (out / "loom_report" / "report.md").is_file()


def test_progress_keeps_messages_and_thins_heartbeats():
    lines = load_tool().ProgressLines(every_s=10.0)
    # per-second heartbeats from the server's job runner: the first, then one per 10 s
    shown = [t for t in range(25) if lines.wanted(f"baseline run 2/5: running {t + 1}.0 s", float(t))]
    assert shown == [0, 10, 20]
    # anything else always shows, heartbeats or not around it
    assert lines.wanted("pair 2/5 done (11.9/11.6 s): decode_tokens_per_s 590.6 -> 587.7", 21.0)
    assert lines.wanted("compiling", 21.5)
    assert not lines.wanted("candidate run 3/5: running 3.0 s", 22.0)
