"""Reason codes, hints and the campaign report tell the truth, through the real protocol: a
numeric mismatch is coded as one, worst_case shows a failing case, benchmark's advice follows
the gate's rule, needs_review names its actual reason, and each attempt carries the policy it
was judged under."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import git
import pytest
from mcp import Client

from loom_mcp.bench.output_check import samples_agree, shape_disagrees
from loom_mcp.config import load_config
from loom_mcp.report.campaign import clip_words
from loom_mcp.report.plots import speedup_bars
from loom_mcp.server import build_server

from .conftest import campaign_workspace

# No accept on wall-clock timing (the default); two seeds keep the validations short.
GATE = "[gate]\nseeds = 2\n"

# A small task, so each validation costs little more than its workers' start.
TASK = """import torch

SHAPES = [{"name": "rows_8", "rows": 8}, {"name": "rows_37", "rows": 37}]


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2.0


def get_inputs(rows: int = 8):
    return [torch.randn(rows, 64)]


def get_init_inputs(rows: int = 8):
    return []
"""
# Right everywhere except on the shape with 37 rows: a plain numeric mismatch.
WRONG_ON_ONE_SHAPE = """import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        out = x * 2.0
        return out + 0.5 if x.shape[0] == 37 else out
"""
NAN_ON_ONE_ROW = """import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        out = x * 2.0
        out[0, 0] = float("nan")
        return out
"""


@pytest.fixture
def setup(tmp_path):
    files = {"task.py": TASK, "wrong.py": WRONG_ON_ONE_SHAPE, "nan.py": NAN_ON_ONE_ROW}
    return campaign_workspace(tmp_path, files, GATE)


async def _start(client, repo: Path) -> str:
    result = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "faster rmsnorm"})
    assert result.is_error is False, result.content
    return result.structured_content["campaign_id"]


async def _submit(client, cid: str, repo: Path, name: str) -> dict:
    result = await client.call_tool("submit_candidate", {
        "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / name)})
    assert result.is_error is False, result.content
    return result.structured_content


@pytest.mark.slow
@pytest.mark.anyio
async def test_failures_are_coded_as_what_they_are_and_each_attempt_keeps_its_policy(setup):
    repo, home = setup
    first = load_config(home)
    async with Client(build_server(first)) as client:
        cid = await _start(client, repo)
        checked = (await client.call_tool("run_validation", {
            "task": str(repo / "task.py"), "candidate": str(repo / "wrong.py")})).structured_content
        assert checked["passed"] is False and checked["cases_failed"] > 0
        # The worst case shown is a failing one, not the best of the passing ones.
        assert checked["worst_case"]["passed"] is False
        assert checked["worst_case"]["shape"] == "rows_37"
        wrong = await _submit(client, cid, repo, "wrong.py")
    assert wrong["verdict"] == "reject"
    assert "validation.mismatch" in wrong["reason_codes"]
    assert "validation.static_error" not in wrong["reason_codes"]

    # A human tightens the policy between two attempts.
    (home / "loom.toml").write_text((home / "loom.toml").read_text() + "min_gain = 0.05\n")
    second = load_config(home)
    assert second.fingerprint() != first.fingerprint()
    async with Client(build_server(second)) as client:
        nan = await _submit(client, cid, repo, "nan.py")
        report = (await client.call_tool("campaign_report", {"campaign_id": cid})).structured_content
    assert nan["verdict"] == "reject" and "validation.nan_parity" in nan["reason_codes"]
    assert "validation.static_error" not in nan["reason_codes"]

    data = json.loads(Path(report["files"]["json"]).read_text())
    attempts = data["attempts"]
    assert [a["config_fingerprint"] for a in attempts] == [first.fingerprint(), second.fingerprint()]
    assert [Path(a["task"]).name for a in attempts] == ["task.py", "task.py"]
    assert any("policy changed" in w for w in data["fingerprint"].get("warnings", []))
    toolchain = data["fingerprint"]["toolchain"]
    # The tools found, the absent ones named once, nothing null.
    assert toolchain and "null" not in json.dumps(toolchain) and '"found"' not in json.dumps(toolchain)

    markdown = Path(report["files"]["markdown"]).read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| submission | task"))
    assert "| candidate |" in header and "| policy |" in header
    rows = [line for line in markdown.splitlines() if line.startswith(f"| {attempts[0]['submission_id']}")]
    assert rows and "`wrong.py`" in rows[-1] and "`task.py`" in rows[-1]
    assert second.fingerprint()[:12] in markdown and first.fingerprint()[:12] in markdown


def test_reasons_are_cut_at_a_word_with_an_ellipsis():
    text = "Shape tail_t37_h1000, seed 3, normal inputs: max abs error 0.5 exceeds atol 0.0001 " * 4
    clipped = clip_words(text, 100)
    assert len(clipped) <= 100 and clipped.endswith("…")
    body = clipped[:-1]
    assert text.startswith(body) and text[len(body)] in " ,;.:"  # the cut fell between words
    assert clip_words("short reason", 100) == "short reason"


def test_speedup_bars_start_at_the_baseline_and_span_the_ci():
    shapes = [{"name": "a", "ratio": {"estimate": 1.8, "ci_low": 1.6, "ci_high": 2.0}},
              {"name": "b", "ratio": {"estimate": 0.7, "ci_low": 0.6, "ci_high": 0.8}}]
    assert speedup_bars(shapes) == [("a", 1.0, 1.8, 1.6, 2.0), ("b", 1.0, 0.7, 0.6, 0.8)]


# The baseline makes 300 passes; the candidate makes one, except on rows_37 where it makes 3000:
# ratios far enough from 1 that a loaded machine's noise cannot blur them.
LOOPED_TASK = TASK.replace("        return x * 2.0",
                           "        for _ in range(300):\n            x = x * 1.0\n        return x * 2.0")
UNEVEN = """import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] == 37:
            for _ in range(3000):
                x = x * 1.0
        return x * 2.0
"""
ONE_PASS = WRONG_ON_ONE_SHAPE.replace("return out + 0.5 if x.shape[0] == 37 else out", "return out")


@pytest.mark.slow
@pytest.mark.anyio
async def test_benchmark_advice_follows_the_gate_and_review_names_its_reason(setup):
    repo, home = setup
    (repo / "looped_task.py").write_text(LOOPED_TASK)
    (repo / "uneven.py").write_text(UNEVEN)
    (repo / "one_pass.py").write_text(ONE_PASS)
    (home / "loom.toml").write_text((home / "loom.toml").read_text()
                                    + "max_plausible_speedup = 1000.0\nmin_time_s = 0.2\nmax_time_s = 1.0\n")
    config = load_config(home)
    async with Client(build_server(config)) as client:
        bench = (await client.call_tool("benchmark", {
            "task": str(repo / "looped_task.py"), "candidate": str(repo / "uneven.py")})).structured_content
        slow = {s["name"]: s for s in bench["shapes"]}["rows_37"]
        assert slow["ci_high"] < 1 - config.gate.max_regression  # clearly slower: the gate rejects
        assert "submit_candidate" not in bench["next_step"], bench["next_step"]
        assert "rows_37" in bench["next_step"] and "clearly slower" in bench["next_step"]

        cid = await _start(client, repo)
        review = (await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "looped_task.py"),
            "candidate": str(repo / "one_pass.py")})).structured_content
    assert review["verdict"] == "needs_review" and review["reason_codes"] == ["review.wall_clock"], review
    assert "implausible" not in review["next_step"] and "unproven" not in review["next_step"]
    assert "wall clock" in review["next_step"]
    assert f"`[gate] accept_wall_clock = true` in {home / 'loom.toml'}" in review["next_step"]


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_reports_reproduce_commands_run_as_printed(setup, tmp_path):
    """The printed lines, run by a shell with only the installed loom-mcp on PATH: no allowed-
    roots refusal, and the judge's JSON comes out with the validation passed."""
    repo, home = setup
    (repo / "looped_task.py").write_text(LOOPED_TASK)
    (repo / "one_pass.py").write_text(ONE_PASS)
    git.Repo(repo).index.add(["looped_task.py"])
    git.Repo(repo).index.commit("looped task")
    (home / "loom.toml").write_text((home / "loom.toml").read_text() + "accept_wall_clock = true\n"
                                    "max_plausible_speedup = 1000.0\nmin_time_s = 0.2\nmax_time_s = 1.0\n")
    async with Client(build_server(load_config(home))) as client:
        cid = await _start(client, repo)
        accepted = (await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "looped_task.py"),
            "candidate": str(repo / "one_pass.py")})).structured_content
        assert accepted["verdict"] == "accept", accepted["reasons"]
        report = (await client.call_tool("campaign_report", {"campaign_id": cid})).structured_content
    data = json.loads(Path(report["files"]["json"]).read_text())
    assert data["fingerprint"]["device"] and "null" not in json.dumps(data["fingerprint"]["device"])
    lines = data["reproduce"]
    assert any("LOOM_ALLOWED_ROOTS=" in line for line in lines)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    outputs = []
    for line in lines:
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)
        assert "NOT_ALLOWED" not in done.stderr, done.stderr
        outputs.append(done)
    check = next(d for d, line in zip(outputs, lines) if " check " in line)
    assert check.returncode in (0, 1), check.stderr[-2000:]  # 1: a verdict other than accept
    result = json.loads(check.stdout)
    assert result["validation"]["passed"] is True and result["verdict"]["verdict"]
    assert all(d.returncode == 0 for d, line in zip(outputs, lines) if line.startswith("git "))


# ---- the benchmark's timed-output comparison (loom_mcp.bench.output_check)
# The benchmark's timed-output comparison: rounding passes, stale or cached outputs do not.

# These tests skipped as a module when torch was missing (pytest.importorskip): each keeps
# that skip, without it reaching the tests above.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="could not import 'torch'")


def bf16(values: list[float]) -> list[float]:
    import torch

    return torch.tensor(values, dtype=torch.float64).to(torch.bfloat16).double().tolist()


@needs_torch
def test_one_bf16_rounding_step_everywhere_agrees():
    """A fused kernel that rounds once vs a reference that rounds twice: one bf16 step apart
    at many positions, including outputs near zero (the case a sum-based check got wrong)."""
    rng = random.Random(0)
    for _ in range(500):
        exact = [rng.gauss(0, 1) for _ in range(32)]
        baseline = bf16(exact)
        candidate = [
            y + rng.choice([-1, 0, 1]) * 2.0 ** (int(abs(y) and __import__("math").frexp(y)[1]) - 8)
            for y in baseline
        ]
        assert samples_agree(candidate, baseline)


@needs_torch
def test_outputs_of_stale_inputs_disagree():
    """Every input perturbed by U(0.9, 1.1): outputs computed from the previous inputs are off
    by a few percent almost everywhere."""
    rng = random.Random(1)
    caught = 0
    for _ in range(500):
        stale = [rng.gauss(0, 1) for _ in range(32)]
        fresh = [y * rng.uniform(0.9, 1.1) for y in stale]
        caught += not samples_agree(bf16(stale), bf16(fresh))
    assert caught >= 495


@needs_torch
def test_missing_nan_and_shape_cases():
    assert not samples_agree(None, [1.0])
    assert not samples_agree([1.0], [1.0, 2.0])
    assert samples_agree([], [])
    assert samples_agree([float("nan"), 1.0, 2.0, 3.0], [float("nan"), 1.0, 2.0, 3.0])
    assert not samples_agree([float("inf")] * 4, [1.0] * 4)
    assert not samples_agree([0.0] * 8, [1.0] * 8)  # an unwritten (zeroed) output


@needs_torch
def test_a_shape_disagrees_past_a_tenth_of_all_its_samples():
    # A tenth of the work skipped while timed: under a quarter in almost every single call of
    # 32 probes, but the sum over a shape's calls is the rule's business.
    assert shape_disagrees(off=65, total=32 * 20)
    assert not shape_disagrees(off=64, total=32 * 20)
    assert not shape_disagrees(off=0, total=0)
