"""Where a job runs: the judge's device string ("cpu" or "cuda:N", N the physical index that
NVML/amdsmi report) becomes the worker's device, its environment, and the pinned devices.

A GPU job sees exactly one GPU (its cuda:0), so clocks sampled and leases taken for index N
are about the device the job really uses. A CPU job sees no GPU and runs Triton interpreted.
"""

from __future__ import annotations


def job_placement(device: str) -> tuple[str, dict[str, str], list[int] | None]:
    """(device for the worker, extra environment, visible_devices for the JobSpec)."""
    if device == "cpu":
        return "cpu", {"TRITON_INTERPRET": "1"}, []
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", {}, [int(device[5:])]
    return device, {}, None
