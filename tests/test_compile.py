"""compile_kernel through the protocol: nvcc for real where it is installed, Triton under the
interpreter, compile errors at the user's file:line, the cache, and the recorded hipcc format."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.compile.reports import parse_amd_resource_usage, parse_ptxas
from loom_mcp.config import load_config
from loom_mcp.server import build_server

FIXTURES = Path(__file__).parent / "fixtures" / "compile"
DEMO = Path(__file__).resolve().parents[1] / "loom_mcp" / "demo_data"

GOOD_CU = """
__global__ void scale(const float* x, float* y, float a, int n) {
  __shared__ float tile[256];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { tile[threadIdx.x] = x[i]; y[i] = a * tile[threadIdx.x]; }
}
"""
BAD_CU = "__global__ void broken(float* y) {\n  int i = threadIdx.x\n  y[i] = 1.0f;\n}\n"
BAD_TRITON = "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef k(x_ptr):\n    tl.store(x_ptr, 1.0 +)\n"


@pytest.fixture
def server(tmp_path):
    roots = f"{tmp_path}:{DEMO}"
    return build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": roots}))


@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
async def test_nvcc_reports_resources_and_caches(server, tmp_path):
    source = tmp_path / "scale.cu"
    source.write_text(GOOD_CU)
    async with Client(server) as client:
        first = await client.call_tool("compile_kernel", {"source": str(source), "language": "cuda", "target": "sm_90"})
        assert first.is_error is False, first.content
        data = first.structured_content
        kernel = data["kernels"][0]
        assert "scale" in kernel["name"] and kernel["registers"] > 0
        assert kernel["shared_memory_bytes"] == 1024 and kernel["spill_stores_bytes"] == 0
        assert 0 < kernel["occupancy"] <= 1 and data["cached"] is False and data["artifact_id"]
        again = await client.call_tool("compile_kernel", {"source": str(source), "language": "cuda", "target": "sm_90"})
        assert again.structured_content["cached"] is True


@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
async def test_nvcc_error_points_at_the_users_line(server, tmp_path):
    source = tmp_path / "broken.cu"
    source.write_text(BAD_CU)
    async with Client(server) as client:
        result = await client.call_tool("compile_kernel", {"source": str(source), "language": "cuda"})
    text = result.content[0].text
    assert result.is_error and "[COMPILE_ERROR]" in text and f"{source}:3" in text


@pytest.mark.anyio
@pytest.mark.slow
async def test_triton_kernels_are_found_and_errors_located(server, tmp_path):
    async with Client(server) as client:
        ok = await client.call_tool("compile_kernel", {
            "source": str(DEMO / "candidate.py"), "language": "triton", "task": str(DEMO / "task.py")})
        assert ok.is_error is False, ok.content
        assert [k["name"] for k in ok.structured_content["kernels"]] == ["rmsnorm_kernel"]
        bad = tmp_path / "bad_kernel.py"
        bad.write_text(BAD_TRITON)
        broken = await client.call_tool("compile_kernel", {"source": str(bad), "language": "triton"})
    assert broken.is_error and "[COMPILE_ERROR]" in broken.content[0].text
    assert f"{bad}:7" in broken.content[0].text


@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("hipcc") is not None, reason="hipcc is installed here")
async def test_missing_hipcc_is_a_clear_error(server, tmp_path):
    source = tmp_path / "k.hip"
    source.write_text(GOOD_CU)
    async with Client(server) as client:
        result = await client.call_tool("compile_kernel", {"source": str(source), "language": "hip"})
    assert result.is_error and "[TOOLCHAIN_MISSING]" in result.content[0].text


def test_recorded_compiler_reports_parse():
    amd = parse_amd_resource_usage((FIXTURES / "hipcc_resource_usage.txt").read_text())
    assert len(amd) == 1
    assert (amd[0].registers, amd[0].sgprs, amd[0].shared_memory_bytes, amd[0].occupancy) == (12, 18, 1024, 1.0)
    ptxas = parse_ptxas(
        "ptxas info    : Compiling entry function '_Z5scalePKfPffi' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z5scalePKfPffi\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 0 barriers, 2048 bytes smem\n")
    assert (ptxas[0].registers, ptxas[0].spill_stores_bytes, ptxas[0].shared_memory_bytes) == (40, 4, 2048)


@pytest.mark.anyio
@pytest.mark.slow
async def test_kernels_in_declared_sources_are_found(server, tmp_path):
    """A candidate whose kernel lives in a source it declares: the kernel is found there, named
    by its module, and a kernel it also imports by name is listed once."""
    (tmp_path / "scale_lib.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
        "    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)\n"
    )
    candidate = tmp_path / "candidate.py"
    candidate.write_text('SOURCES = ["scale_lib.py"]\n\nimport scale_lib  # noqa: E402,F401\n')
    async with Client(server) as client:
        result = await client.call_tool("compile_kernel", {"source": str(candidate), "language": "triton"})
    assert result.is_error is False, result.content
    assert [k["name"] for k in result.structured_content["kernels"]] == ["scale_lib.scale_kernel"]
