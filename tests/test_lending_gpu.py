"""Validation's big cases lent in device memory (loom_mcp.worker.lending, cuda_ipc): a region
opened by another process, and run_validation over MCP with cases that take the device path.
NVIDIA GPUs only; skipped elsewhere."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server

pytestmark = pytest.mark.gpu

# 128 MiB in and out per case: past lending.LEND_MIN_BYTES.
TASK = '''
import torch

batch_size = 32


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2


def get_inputs():
    return [torch.randn(batch_size, 1024, 1024)]


def get_init_inputs():
    return []
'''

HONEST = '''
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x + x
'''

WRONG_SHAPE = HONEST.replace("return x + x", "return (x + x)[:, :-1]")

# Returns zeros, and during each later case writes the right values into the region where the
# case before lay (its output slot first): too late, that case's outputs were copied out before
# this process could run again.
REWRITES_EARLIER_SLOT = '''
import torch

_held = []


class ModelNew(torch.nn.Module):
    def forward(self, x):
        storage = x.untyped_storage()
        if storage.nbytes() > x.numel() * x.element_size():  # x lies in a lent region
            if _held:
                earlier, answer = _held.pop()
                whole = torch.empty(0, dtype=torch.uint8, device=x.device).set_(earlier)
                whole[: answer.numel() * 4].view(torch.float32).copy_(answer.reshape(-1))
            _held.append((storage, (x * 2).contiguous()))
        return torch.zeros_like(x)
'''


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and not torch.version.hip


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU")

OPENER = """
import sys, torch
from loom_mcp.worker import cuda_ipc
handle, size = sys.argv[1], int(sys.argv[2])
region = cuda_ipc.open_region(handle, size, torch.device("cuda"))
assert int(region[:1024].float().sum().item()) == 1024 * 7, "the region's bytes"
region[1024:2048].fill_(9)
torch.cuda.synchronize()
"""


@needs_cuda
def test_a_region_is_read_and_written_by_the_process_it_is_lent_to() -> None:
    import torch

    from loom_mcp.worker import cuda_ipc

    device = torch.device("cuda")
    region = cuda_ipc.Region(1 << 20, device)
    assert region.tensor is not None
    region.tensor.zero_()
    region.tensor[:1024].fill_(7)
    torch.cuda.synchronize()
    done = subprocess.run([sys.executable, "-c", OPENER, region.handle, str(region.nbytes)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(region.tensor[1024:2048].float().sum().item()) == 1024 * 9
    assert not region.tensor[2048:].any()
    region.free()


def _server(root: Path):
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    return build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(root)}))


async def _validate(root: Path, candidate: str, caplog: pytest.LogCaptureFixture) -> dict:
    (root / "task.py").write_text(TASK)
    (root / "cand.py").write_text(candidate)
    caplog.set_level(logging.INFO, logger="loom_mcp.validate")
    async with Client(_server(root)) as client:
        result = await client.call_tool("run_validation", {
            "task": str(root / "task.py"), "candidate": str(root / "cand.py"), "seeds": 5})
    assert result.is_error is False, result.content
    return result.structured_content


@needs_cuda
@pytest.mark.anyio
async def test_big_cases_are_lent_in_device_memory_and_an_honest_candidate_passes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    report = await _validate(tmp_path, HONEST, caplog)
    assert report["passed"] is True and report["cases_total"] == 5, report
    assert "5 of 5 case(s) lent in device memory" in caplog.text


@needs_cuda
@pytest.mark.anyio
async def test_outputs_that_do_not_fit_the_slots_travel_through_files_and_fail(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    report = await _validate(tmp_path, WRONG_SHAPE, caplog)
    assert report["passed"] is False and report["cases_failed"] == 5, report
    assert "lent in device memory" in caplog.text


@needs_cuda
@pytest.mark.anyio
async def test_an_earlier_cases_slot_rewritten_later_does_not_count(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    report = await _validate(tmp_path, REWRITES_EARLIER_SLOT, caplog)
    assert report["passed"] is False, report
    assert report["cases_failed"] == report["cases_total"] == 5, report
    assert "validation.mismatch" in {f["check"] for f in report["findings"]}, report
    assert "5 of 5 case(s) lent in device memory" in caplog.text
