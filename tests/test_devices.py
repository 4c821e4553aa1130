"""Device probing, datasheet peaks, amdsmi conversion and the toolchain probe.

Runs on a GPU-less machine: NVML and amdsmi are exercised for real and must say why they are
unavailable; AMD conversion is checked against hand-written amdsmi records.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom_mcp.devices import PEAKS, lookup_peak, probe_cpu, probe_devices
from loom_mcp.devices.amd import (
    amd_device_from_records,
    probe_amd,
    sample_clocks_amd,
    sample_from_records,
)
from loom_mcp.devices.nvidia import decode_reasons, probe_nvidia, sample_clocks
from loom_mcp.devices.toolchain import TOOLS, _toolchain, find_tools, parse_version, probe_toolchain

FIXTURES = Path(__file__).parent / "fixtures" / "amdsmi"
TRACES = Path(__file__).parent / "fixtures" / "traces_real"
SAMPLE_KEYS = {"t", "sm_clock_mhz", "memory_clock_mhz", "power_w", "temperature_c", "throttle_reasons", "throttled", "status"}


def _load_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


# ---------------------------------------------------------------- cpu and probe_devices


def test_cpu_probe_reads_this_machine() -> None:
    cpu = probe_cpu()
    assert cpu.vendor == "cpu" and cpu.index == 0
    assert cpu.name and cpu.name != "unknown CPU"
    assert cpu.compute_units is not None and 1 <= cpu.compute_units <= (os.cpu_count() or 1)
    meminfo = Path("/proc/meminfo").read_text()
    total_kb = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo).group(1))
    assert cpu.memory_total_bytes == total_kb * 1024
    assert cpu.memory_used_bytes is not None and 0 < cpu.memory_used_bytes < cpu.memory_total_bytes
    assert cpu.peak is None


def test_probe_devices_reports_cpu_and_why_gpus_are_missing() -> None:
    devices, backends = probe_devices()
    assert set(backends) == {"nvidia", "amd", "cpu"}
    assert backends["cpu"] == "ok"
    assert [d.vendor for d in devices].count("cpu") == 1
    for vendor, missing in (("nvidia", ("nvidia-ml-py not installed", "NVML: ")), ("amd", ("amdsmi",))):
        mine = [d for d in devices if d.vendor == vendor]
        if backends[vendor] == "ok":  # a machine with that GPU: every device carries its peak lookup
            assert mine
        else:
            assert not mine
            assert backends[vendor].startswith(missing), backends[vendor]


def test_vendor_probes_answer_without_hardware() -> None:
    devices, status = probe_nvidia()
    assert devices == [] and status != "ok" and status
    devices, status = probe_amd()
    assert devices == [] and status != "ok" and status
    for sample in (sample_clocks(0), sample_clocks_amd(0)):
        assert set(sample) == SAMPLE_KEYS
        assert sample["status"] != "ok" and sample["sm_clock_mhz"] is None


def test_device_probing_never_imports_torch() -> None:
    code = (
        "import sys, asyncio\n"
        "from loom_mcp.devices import probe_devices\n"
        "from loom_mcp.devices.toolchain import cache_key\n"
        "probe_devices(); cache_key()\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_nvml_reason_bits() -> None:
    # At its power cap under load (what a bf16 matmul on an H200 shows): a fact, not a throttle.
    capped = decode_reasons(0x4)
    assert not capped.active and capped.reasons == ["sw_power_cap"]
    hot = decode_reasons(0x1 | 0x4 | 0x40)
    assert hot.active and hot.reasons == ["hw_thermal_slowdown", "sw_power_cap", "gpu_idle"]


# ---------------------------------------------------------------- peaks


REQUIRED = {
    "H100 SXM", "H100 PCIe", "H200 SXM", "H200 NVL", "B200", "A100 80GB SXM", "L40S",
    "MI300X", "MI325X", "MI355X", "MI250X", "MI210",
}  # fmt: skip


def test_peak_table_is_complete_and_sane() -> None:
    models = {p.model for p in PEAKS}
    assert REQUIRED <= models and len(models) == len(PEAKS)
    known = {"fp64", "fp64_vector", "fp32", "fp32_vector", "tf32", "bf16", "fp16", "fp8", "int8", "fp4"}
    for peak in PEAKS:
        assert set(peak.flops) <= known, peak.model
        assert peak.source and peak.memory_bandwidth_bytes_s > 1e11 and peak.memory_bytes
        assert all(v > 1e12 for v in peak.flops.values()), peak.model
        assert peak.flops["bf16"] == peak.flops["fp16"]
        assert peak.flops["bf16"] > peak.flops["fp32"]
        if "fp8" in peak.flops:
            assert peak.flops["fp8"] == pytest.approx(2 * peak.flops["bf16"], rel=0.02)  # L40S datasheet: 733 vs 2 x 362.05
        if "fp64_vector" in peak.flops:
            assert peak.flops["fp64_vector"] < peak.flops["fp64"]
        assert peak.arch.startswith("sm_" if peak.vendor == "nvidia" else "gfx")
    # The H200 bandwidth the research notes measure against (4.8 TB/s spec).
    assert lookup_peak("NVIDIA H200").memory_bandwidth_bytes_s == 4.8e12


@pytest.mark.parametrize(
    ("name", "arch", "model"),
    [
        ("NVIDIA H200", None, "H200 SXM"),
        ("NVIDIA H200 NVL", "sm_90", "H200 NVL"),
        ("NVIDIA H100 80GB HBM3", "sm_90", "H100 SXM"),
        ("NVIDIA H100 PCIe", None, "H100 PCIe"),
        ("NVIDIA H100 NVL", None, "H100 NVL"),
        ("NVIDIA B200", "sm_100", "B200"),
        ("NVIDIA GB200", None, "GB200"),
        ("NVIDIA A100-SXM4-80GB", "8.0", "A100 80GB SXM"),
        ("NVIDIA A100 80GB PCIe", None, "A100 80GB PCIe"),
        ("NVIDIA A100-PCIE-40GB", None, "A100 40GB"),
        ("NVIDIA L40S", "sm_89", "L40S"),
        ("AMD Instinct MI300X", "gfx942", "MI300X"),
        ("AMD Instinct MI300X VF", "gfx942:sramecc+:xnack-", "MI300X"),
        ("AMD Instinct MI300A", None, "MI300A"),
        ("AMD Instinct MI325X", None, "MI325X"),
        ("AMD Instinct MI355X", None, "MI355X"),
        ("AMD Instinct MI250X / MI250", None, "MI250X"),
        ("AMD Instinct MI250", None, "MI250"),
        ("MI210", None, "MI210"),
        ("H200 SXM", None, "H200 SXM"),
    ],
)
def test_lookup_peak_spellings(name: str, arch: str | None, model: str) -> None:
    peak = lookup_peak(name, arch)
    assert peak is not None and peak.model == model


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA L40", "Intel(R) Xeon(R) Platinum 8480+", "", "NVIDIA H20"])
def test_lookup_peak_does_not_guess_from_substrings(name: str) -> None:
    assert lookup_peak(name) is None


def test_lookup_peak_falls_back_to_arch_conservatively() -> None:
    peak = lookup_peak("AMD Radeon Graphics", "gfx942:sramecc+:xnack-")
    assert peak is not None and peak.arch == "gfx942"
    # The fastest gfx942 part, so a physical floor computed from it can never be too high.
    fastest = max((p for p in PEAKS if p.arch == "gfx942"), key=lambda p: p.memory_bandwidth_bytes_s)
    assert peak.memory_bandwidth_bytes_s == fastest.memory_bandwidth_bytes_s
    assert "architecture only" in peak.source
    assert lookup_peak("gfx90a").arch == "gfx90a"
    assert lookup_peak("Unknown thing", "gfx1100") is None


def test_lookup_peak_on_real_kineto_traces() -> None:
    seen: dict[str, str] = {}
    paths = sorted(TRACES.glob("*.json*"))
    assert len(paths) >= 10
    for path in paths:
        trace = _load_trace(path)
        for props in trace.get("deviceProperties", []):
            hip = "hip_runtime_version" in trace
            arch = None if hip else f"sm_{props['computeMajor']}{props['computeMinor']}"
            peak = lookup_peak(props["name"], arch)
            assert peak is not None, (path.name, props["name"])
            assert peak.vendor == ("amd" if hip else "nvidia")
            # The datasheet capacity and what the runtime reports agree to within 5 %.
            assert 0.95 <= props["totalGlobalMem"] / peak.memory_bytes <= 1.0, (props["name"], peak.model)
            seen[props["name"]] = peak.model
    assert seen == {
        "NVIDIA H100 80GB HBM3": "H100 SXM",
        "NVIDIA H200": "H200 SXM",
        "AMD Instinct MI210": "MI210",
        "AMD Instinct MI300X VF": "MI300X",
        "AMD Instinct MI300X": "MI300X",
    }


def test_lookup_peak_on_rocprofv3_agents() -> None:
    path = TRACES / "rocprofv3_908_results.json.gz"
    if not path.exists():
        pytest.skip("rocprofv3 fixture missing")
    tool = _load_trace(path)["rocprofiler-sdk-tool"]
    agents = (tool[0] if isinstance(tool, list) else tool)["agents"]
    gpus = [a for a in agents if a["type"] == 2]
    assert gpus
    for agent in gpus:
        peak = lookup_peak(agent["product_name"], agent["name"])
        assert peak is not None and peak.model == "MI350X"
        by_arch = lookup_peak(agent["name"])  # the gfx name alone
        assert by_arch is not None and by_arch.arch == "gfx950" and "architecture only" in by_arch.source
    cpus = [a for a in agents if a["type"] == 1]
    assert all(lookup_peak(a["name"]) is None for a in cpus)


# ---------------------------------------------------------------- amdsmi conversion


def _records(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_amd_mi300x_records() -> None:
    device = amd_device_from_records(2, _records("mi300x_rocm64.json"))
    assert device.index == 2 and device.vendor == "amd"
    assert device.name == "AMD Instinct MI300X" and device.arch == "gfx942"
    assert device.pci_bus_id == "0000:0c:00.0" and device.uuid.startswith("1fff74a1")
    assert device.memory_total_bytes == 196592 * 2**20 and device.memory_used_bytes == 283 * 2**20
    assert (device.sm_clock_mhz, device.sm_clock_max_mhz) == (2100, 2100)
    assert (device.memory_clock_mhz, device.memory_clock_max_mhz) == (1300, 1300)
    assert device.power_w == 612 and device.power_limit_w == 750  # the cap is reported in uW
    assert device.temperature_c == 71 and device.utilization_pct == 97
    assert not device.throttle.active and device.throttle.reasons == ["ppt_power"]  # at its power cap
    assert device.driver_version == "6.10.5" and device.runtime_version == "6.4.1"
    assert device.compute_units == 304
    assert lookup_peak(device.name, device.arch).model == "MI300X"


def test_amd_mi210_records_from_an_older_stack() -> None:
    device = amd_device_from_records(0, _records("mi210_rocm60.json"))
    assert device.name == "AMD Instinct MI210"
    assert device.arch is None and device.compute_units is None  # ROCm 6.0 asic_info lacks them
    assert device.sm_clock_mhz == 800 and device.memory_clock_mhz == 1600  # "cur_clk" spelling
    assert device.power_w == 42  # current_socket_power 0xFFFF means unsupported
    assert device.power_limit_w == 300
    assert device.temperature_c == 38.0  # millidegrees from the older library
    assert device.utilization_pct == 0.0
    assert device.throttle.active and device.throttle.reasons == ["temp_mem"]  # SMU bit 34
    assert device.runtime_version == "6.0.2" and device.driver_version == "6.3.6"
    assert device.memory_total_bytes == 65520 * 2**20
    assert lookup_peak(device.name, device.arch).model == "MI210"


def test_amd_mi355x_records_from_rocm7() -> None:
    device = amd_device_from_records(0, _records("mi355x_rocm7.json"))
    assert device.name == "AMD Instinct MI355X" and device.arch == "gfx950"
    assert device.power_w == 812 and device.power_limit_w == 1400
    assert device.throttle is not None and not device.throttle.active and device.throttle.reasons == []
    assert device.runtime_version == "7.0.2" and device.compute_units == 256
    assert lookup_peak(device.name, device.arch).model == "MI355X"


def test_amd_codename_and_missing_records() -> None:
    device = amd_device_from_records(1, _records("mi300x_codename_sparse.json"))
    assert device.name == "AMD Instinct MI300X (Aqua Vanjaram)"  # from the PCI device id
    assert device.arch is None and device.compute_units is None
    assert device.memory_total_bytes is None and device.power_w is None and device.throttle is None
    assert device.runtime_version is None and device.uuid is None
    assert lookup_peak(device.name).model == "MI300X"
    assert amd_device_from_records(0, {}).name == "AMD GPU 0"


def test_amd_sample_has_the_nvidia_keys() -> None:
    sample = sample_from_records(_records("mi300x_rocm64.json"))
    assert set(sample) == SAMPLE_KEYS
    assert sample["throttled"] is False and sample["throttle_reasons"] == ["ppt_power"]
    assert sample["sm_clock_mhz"] == 2100 and sample["power_w"] == 612
    hot = sample_from_records(_records("mi210_rocm60.json"))
    assert hot["throttled"] is True and hot["throttle_reasons"] == ["temp_mem"]


# ---------------------------------------------------------------- toolchain


def test_find_tools_finds_nvcc_and_git() -> None:
    tools = {t.name: t for t in find_tools()}
    assert set(tools) == set(TOOLS)
    for name in ("nvcc", "git"):
        if shutil.which(name) is None:
            pytest.skip(f"{name} not on PATH here")
        tool = tools[name]
        assert tool.found and tool.path == shutil.which(name)
        output = subprocess.run([name, "--version"], capture_output=True, text=True).stdout
        assert tool.version and tool.version in output
    assert re.fullmatch(r"\d+\.\d+\.\d+", tools["nvcc"].version)
    assert all(not t.found and t.version is None for t in tools.values() if t.path is None)


@pytest.mark.parametrize(
    ("tool", "output", "version"),
    [
        ("nvcc", "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n", "13.0.88"),
        ("ncu", "NVIDIA (R) Nsight Compute Command Line Profiler\nCopyright (c) 2018-2025 NVIDIA Corporation\nVersion 2025.3.1.0 (build 36398880) (public-release)\n", "2025.3.1.0"),
        ("nsys", "NVIDIA Nsight Systems version 2025.1.1.131-251135540420v0\n", "2025.1.1.131-251135540420v0"),
        ("nvidia-smi", "NVIDIA-SMI version  : 580.159.03\nNVML version        : 580.159\nDRIVER version      : 580.159.03\nCUDA Version        : 13.0\n", "580.159.03"),
        ("hipcc", "HIP version: 6.4.43482-0f2d60242\nAMD clang version 19.0.0git\n", "6.4.43482-0f2d60242"),
        ("amd-smi", "AMDSMI Tool: 25.5.1+41065ee | AMDSMI Library version: 25.5.1 | ROCm version: 6.4.1\n", "25.5.1+41065ee"),
        ("git", "git version 2.39.5\n", "2.39.5"),
        ("rocprofv3", "no digits here\n", None),
    ],
)
def test_parse_version(tool: str, output: str, version: str | None) -> None:
    assert parse_version(tool, output) == version


def test_torch_missing_is_an_answer_not_a_crash(tmp_path: Path) -> None:
    python = shutil.which("python3.11", path="/usr/bin") or "/usr/bin/python3"
    if not Path(python).exists() or subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("no interpreter without torch here")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [python, "-m", "loom_mcp.worker.probe_torch"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout[done.stdout.index("{"):])
    assert facts["torch"] is None and "torch" in facts["torch_error"]
    toolchain = _toolchain(facts, None, [])
    assert toolchain.torch is None and toolchain.probe_error.startswith("torch not usable")


@pytest.mark.anyio
async def test_probe_toolchain_runs_the_worker_then_hits_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "toolchain.json"
    first = await probe_toolchain(cache)
    assert first.probe_error is None, first.probe_error
    assert first.torch is not None and first.torch.startswith("2.13.0")
    assert first.triton and first.torch_cuda is None and first.torch_hip is None
    assert first.torch_devices == []  # a CPU-only torch sees no accelerator
    assert {t.name for t in first.tools} == set(TOOLS)
    assert cache.exists()
    stamp = cache.stat().st_mtime_ns

    start = time.perf_counter()
    second = await probe_toolchain(cache)
    elapsed = time.perf_counter() - start
    assert second == first
    assert cache.stat().st_mtime_ns == stamp  # served from the file, not re-probed
    assert elapsed < 0.05, f"cached toolchain took {elapsed * 1000:.1f} ms"

    fresh = await probe_toolchain(cache, max_age_s=0)  # doctor's path: always re-probe
    assert fresh.torch == first.torch and cache.stat().st_mtime_ns != stamp
