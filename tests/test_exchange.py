"""The timer's shared tensors on a CPU: files the timer writes and each arm maps, output slots
the timer reads at positions it keeps to itself. One process plays both sides here; the
benchmark tests run them as separate sandboxed processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom_mcp.worker import exchange


def test_inputs_round_trip_and_the_arms_view_follows_the_timers_writes(tmp_path):
    live = [[torch.randn(4, 3), 7], [torch.randn(4, 3).to(torch.bfloat16), 2.5]]
    expected = [[v.clone() if isinstance(v, torch.Tensor) else v for v in row] for row in live]
    described = exchange.share_inputs(live, tmp_path)
    arm_view = exchange.open_inputs(described)
    for row, want in zip(arm_view, expected, strict=True):
        assert torch.equal(row[0], want[0]) and row[1] == want[1]
    live[0][0].mul_(2)  # the timer perturbs its mapping in place
    assert torch.equal(arm_view[0][0], expected[0][0] * 2)


def test_the_arms_view_of_the_inputs_is_read_only(tmp_path):
    described = exchange.share_inputs([[torch.zeros(8)]], tmp_path)
    path = described["files"][0][0]["file"]
    code = ("from loom_mcp.worker import exchange;"
            f"t = exchange.open_inputs({described!r})[0][0]; t.fill_(1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode != 0  # the write faults in the arm
    assert torch.equal(exchange.file_tensor(Path(path), torch.float32, [8], False), torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_slots_read_back_what_the_arm_put_at_the_timers_positions(tmp_path, dtype):
    out = (torch.arange(24).reshape(4, 6) % 5).to(dtype)
    specs = exchange.output_specs([out])
    slots, described = exchange.output_slots(specs, tmp_path, torch.device("cpu"), 1 << 20)
    arm_slots = exchange.open_slots(described)
    exchange.put(arm_slots[0], out)
    positions = torch.tensor([0, 5, 23, 24 + 7])  # wrapped modulo the output's size
    got = exchange.read_at(slots[0], specs[0], positions)
    assert got.tolist() == out.reshape(-1)[positions % 24].double().tolist()


def test_an_arm_cannot_ask_for_unbounded_slots(tmp_path):
    with pytest.raises(ValueError, match="more than"):
        exchange.output_slots([{"nbytes": 2 << 20, "dtype": "float32"}], tmp_path,
                              torch.device("cpu"), 1 << 20)
    with pytest.raises(ValueError, match="unsupported dtype"):
        exchange.dtype_named("object")
