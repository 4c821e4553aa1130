"""Job placement: a GPU job sees exactly its GPU; a CPU job sees none and interprets Triton."""

from __future__ import annotations

from loom_mcp.judge import first_visible
from loom_mcp.models import DeviceInfo
from loom_mcp.placement import job_placement


def test_gpu_job_is_pinned_to_its_physical_index():
    assert job_placement("cuda:3") == ("cuda", {}, [3])


def test_cpu_job_hides_gpus_and_interprets_triton():
    assert job_placement("cpu") == ("cpu", {"TRITON_INTERPRET": "1"}, [])


def test_unknown_device_strings_pass_through_unpinned():
    assert job_placement("auto") == ("auto", {}, None)


# ---- the judge's target GPU
# Which GPU the judge times: the one the workers' torch will call cuda:0.

GPUS = [DeviceInfo(index=i, vendor="nvidia", name="NVIDIA H200", uuid=f"GPU-{i}0a1b") for i in range(3)]


def test_visible_devices_index_and_uuid(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert first_visible(GPUS).index == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-10a")
    assert first_visible(GPUS).index == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert first_visible(GPUS).index == 1


def test_default_is_the_first_gpu(monkeypatch):
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    assert first_visible(GPUS).index == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # not present: fall back, never crash
    assert first_visible(GPUS).index == 0
