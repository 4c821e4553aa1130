"""The hand-written CUDA Q4_K GEMV in tools/ builds for Hopper without spilling, and its probe
loads. Timing it needs a GPU: `python tools/probe_q4k_cuda.py` (gpu_session.sh phase `cuda`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_gemv_builds_for_sm90_without_spills(tmp_path):
    build = subprocess.run(
        [
            "nvcc",
            "-cubin",
            "-arch=sm_90",
            "-O3",
            "-Xptxas",
            "-v",
            "-o",
            str(tmp_path / "k.cubin"),
            str(TOOLS / "q4k_gemv_cuda.cu"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0
    report = build.stderr + build.stdout
    assert "q4k_gemv_b1" in report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= 255
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report


def test_cuda_probe_describes_itself():
    pytest.importorskip("torch")
    result = subprocess.run(
        [sys.executable, str(TOOLS / "probe_q4k_cuda.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--source" in result.stdout and "CUDA Q4_K GEMV" in result.stdout
