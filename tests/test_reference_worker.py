"""The trusted reference worker's validation step, called directly (a plain function, in a thread,
with this test playing the candidate and the server through real signed go-files).

On a GPU it computes reference outputs while the candidate runs and compares afterwards; on a
CPU it computes each one after the candidate. Both orders must give the same verdicts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loom_mcp.worker import handoff, reference
from loom_mcp.worker.harness import load_module
from loom_mcp.worker.protocol import publish_go

TOKEN = "test-signing-token"

REPO = Path(__file__).resolve().parents[1]
TASK = str(REPO / "kernels" / "rmsnorm" / "task.py")
SHAPES = ["decode_t1_h4096", "decode_t8_h4000_fp32"]


def _outputs(cases_dir: Path, corrupt_index: int | None) -> list[list[torch.Tensor]]:
    """What an honest candidate returns (the task's own Model), one case made wrong."""
    task = load_module(TASK, "rmsnorm_task_for_test")
    outputs = []
    for index, case in enumerate(handoff.read_bundle(cases_dir)):
        model = task.Model(*case["init_inputs"])
        model.load_state_dict(case["state_dict"])
        with torch.no_grad():
            out = model(*case["inputs"])
        if index == corrupt_index:
            out = out * 1.5
        outputs.append([out])
    return outputs


def _validate_as_the_candidate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: dict,
                               candidate: Callable[[Path], list]) -> dict[str, Any]:
    """Run the worker's `validate`; once it says the inputs are written, save what `candidate`
    returns for them and tell the worker the candidate has exited."""
    monkeypatch.setenv("LOOM_GO_SIGNER", TOKEN)
    cases_dir, outputs_dir = tmp_path / "cases", tmp_path / "outputs"
    cand_go, ref_go = tmp_path / "cand.go", tmp_path / "ref.go"
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(result=reference.validate({
        **request, "cases_dir": str(cases_dir), "outputs_dir": str(outputs_dir),
        "cand_go_file": str(cand_go), "go_file": str(ref_go)})))
    worker.start()
    deadline = time.monotonic() + 120
    while not cand_go.exists() and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cand_go.exists(), "the worker never signalled that the inputs are written"
    assert not ref_go.exists()
    handoff.write_bundle(outputs_dir, candidate(cases_dir))
    publish_go(str(ref_go), {}, TOKEN)
    worker.join(120)
    return box["result"]


@pytest.mark.parametrize("ahead_host_bytes", [None, 1 << 30, 1])
def test_compare_gives_the_same_verdicts_whether_references_are_computed_ahead_or_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead_host_bytes: int | None) -> None:
    monkeypatch.setenv("LOOM_NONCE", "12345")
    request = {"task": TASK, "seeds": 2, "shapes": SHAPES, "device": "cpu",
               "tolerances": {"bfloat16": {"atol": 1e-2, "rtol": 1e-2},
                              "float32": {"atol": 1e-4, "rtol": 1e-4}}}
    if ahead_host_bytes is not None:
        request["ahead_host_bytes"] = ahead_host_bytes  # 1 byte: only the first case ahead
    result = _validate_as_the_candidate(tmp_path, monkeypatch, request,
                                        lambda cases_dir: _outputs(cases_dir, corrupt_index=1))
    assert [c["shape"]["name"] for c in result["planned"]] == [SHAPES[0]] * 2 + [SHAPES[1]] * 2
    passed = [all(o["passed"] for o in case["outputs"]) for case in result["cases"]]
    assert passed == [True, False, True, True]
    assert all(case["inputs_reproducible"] for case in result["cases"])
    assert result["cases"][1]["outputs"][0]["mismatched"] > 0


OOM_ONCE_TASK = '''
import torch

CALLS = [0]


class Model(torch.nn.Module):
    def forward(self, x):
        CALLS[0] += 1
        if CALLS[0] == 1:  # the device is full while the candidate runs beside us
            raise torch.OutOfMemoryError("out of memory (first call)")
        return x * 2


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
'''


def test_running_out_of_memory_ahead_of_the_candidate_is_not_a_reference_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_NONCE", "7")
    task = tmp_path / "task_oom_once.py"
    task.write_text(OOM_ONCE_TASK)
    result = _validate_as_the_candidate(
        tmp_path, monkeypatch,
        {"task": str(task), "seeds": 2, "shapes": None, "device": "cpu",
         "tolerances": {"float32": {"atol": 1e-4, "rtol": 1e-4}}, "ahead_host_bytes": 1 << 30},
        lambda cases_dir: [[case["inputs"][0] * 2] for case in handoff.read_bundle(cases_dir)])
    assert [case["error"] for case in result["cases"]] == [None, None]
    assert all(o["passed"] for case in result["cases"] for o in case["outputs"])
