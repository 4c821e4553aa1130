"""Job placement: a GPU job sees exactly its GPU; a CPU job sees none and interprets Triton."""

from __future__ import annotations

from loom_mcp.placement import job_placement


def test_gpu_job_is_pinned_to_its_physical_index():
    assert job_placement("cuda:3") == ("cuda", {}, [3])


def test_cpu_job_hides_gpus_and_interprets_triton():
    assert job_placement("cpu") == ("cpu", {"TRITON_INTERPRET": "1"}, [])


def test_unknown_device_strings_pass_through_unpinned():
    assert job_placement("auto") == ("auto", {}, None)
