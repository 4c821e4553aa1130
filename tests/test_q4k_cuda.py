"""The Q4_K GEMV's CUDA kernels (kernels/q4k_gemv/q4k_gemv.cu): the source builds for Hopper
without spills (nvcc, here), and on a GPU they match the float64 reference across shapes,
activation ranges and CUDA-graph replay; and the GPU tools around them. Their launch choices:
test_q4k_gemv_policy.py. Timing them: `python kernels/tools/probe_q4k_cuda.py` (gpu_session.sh `cuda`)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "kernels" / "q4k_gemv"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CUDA_SOURCE = (TASK_DIR / "q4k_gemv.cu").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gemv():
    """The GEMV as the model program imports it (q4k_gemv picks the CUDA kernels on Hopper)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    pytest.importorskip("gguf")  # the task's reference dequantizes with it
    return importlib.import_module("kernels.q4k_gemv.q4k_gemv")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_source_builds_for_sm90_without_spills(tmp_path):
    source = tmp_path / "q4k_gemv.cu"
    source.write_text(CUDA_SOURCE)
    build = subprocess.run(
        ["nvcc", "-c", "-arch=sm_90", "-O3", "-Xptxas", "-v",
         "-o", str(tmp_path / "k.o"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    report = build.stderr + build.stdout
    assert "q4k_gemv_b1_kernel" in report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    # two 288-thread CTAs per SM must fit in the 64K-register file
    assert registers <= 65536 // (2 * 288), report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report


@pytest.mark.gpu
def test_cuda_kernel_matches_the_reference_on_a_gpu(gemv):
    import torch

    major = torch.cuda.get_device_capability()[0]
    if major < 9 or (major > 9 and os.environ.get("LOOM_Q4K_CUDA") != "1"):
        pytest.skip("the CUDA kernel runs on sm_90 (newer GPUs with LOOM_Q4K_CUDA=1)")
    task = load("q4k_cuda_test_task", TASK_DIR / "task.py")
    base = load("q4k_cuda_test_base", TASK_DIR / "baseline.py")
    assert gemv.cuda_gemv_b1(torch.device("cuda")) is not None, "the kernel did not build"
    torch.manual_seed(0)
    # Small K after large K on purpose: a per-shape shared-memory limit would break the large
    # one afterwards.
    cases = [(4096, 14336, "bfloat16", 1.0), (100, 768, "bfloat16", 1.0), (4096, 14336, "bfloat16", 64.0),
             (1024, 4096, "float16", 1e-3), (9, 1280, "float16", 1.0), (300, 2048, "bfloat16", 1e4)]
    for n, k, dtype, scale in cases:
        x, w = task.get_inputs(batch=1, n=n, k=k, dtype=dtype)
        x, w = (x * scale).cuda(), w.cuda()
        want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
        got = gemv.q4k_gemv(x, w)
        assert task.check(got, want), (n, k, dtype, scale)
    # the same numbers from a CUDA-graph replay
    x, w = task.get_inputs(batch=1, n=2048, k=4096)
    x, w = x.cuda(), w.cuda()
    eager = gemv.q4k_gemv(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv.q4k_gemv(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
def test_batched_decode_on_the_cuda_kernel_is_each_row_alone(gemv, monkeypatch):
    """Where the batched kernel does not fit (or is turned off, as here), batches 2-8 of a large
    weight run the batch-1 kernel once per row, rows after the first as programmatic
    dependents: each row of the result is that row's batch-1 result, bit for bit, eagerly and
    from a graph, and passes the task's check against float64."""
    import torch

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUDA kernel runs on sm_90")
    monkeypatch.setenv("LOOM_Q4K_BATCHED", "0")
    task = load("q4k_cuda_test_task_rows", TASK_DIR / "task.py")
    base = load("q4k_cuda_test_base_rows", TASK_DIR / "baseline.py")
    torch.manual_seed(0)
    for batch, n, k in ((8, 4096, 4096), (3, 4096, 14336), (5, 4112, 1280)):
        x, w = task.get_inputs(batch=batch, n=n, k=k)
        x, w = x.cuda(), w.cuda()
        want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
        for constant in (False, True):
            got = gemv.q4k_gemv(x, w, constant_weight=constant)
            assert task.check(got, want), (batch, n, k, constant)
            for row in range(batch):
                assert torch.equal(got[row], gemv.q4k_gemv(x[row : row + 1], w)[0]), (batch, n, row)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gemv.q4k_gemv(x, w, constant_weight=True)
        x.copy_(torch.flip(x, dims=[0]))  # new inputs in place: the replay must read them
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, gemv.q4k_gemv(x, w)), (batch, n, k)


@pytest.mark.gpu
def test_batched_kernel_matches_the_reference_on_a_gpu(gemv):
    """The batched kernel (one launch for batches 2-8, the MMA's columns the rows of x) against
    float64, with odd row counts, K tails, fp16, scaled x and zero sub-blocks; and from a graph."""
    import torch

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUDA kernel runs on sm_90")
    task = load("q4k_cuda_test_task_batched", TASK_DIR / "task.py")
    base = load("q4k_cuda_test_base_batched", TASK_DIR / "baseline.py")
    kernel = gemv.cuda_gemv_b1(torch.device("cuda"))
    torch.manual_seed(0)
    # K cut into parts (third field; 0: the kernel's own cut) as well as whole: seven parts at
    # K = 14336, uneven parts, a short last chunk in the last part, more parts than tiles need
    cases = [(8, 4096, 4096, "bfloat16", 1.0, 0), (2, 4096, 14336, "bfloat16", 64.0, 0),
             (3, 1024, 4096, "float16", 1e-3, 0), (5, 4112, 1280, "bfloat16", 1.0, 0), (7, 100, 768, "float16", 1.0, 0),
             (4, 300, 2048, "bfloat16", 1e4, 0), (8, 4096, 14336, "bfloat16", 1.0, 0), (6, 4112, 14336, "float16", 1.0, 3),
             (3, 1040, 11008, "bfloat16", 1.0, 4), (8, 100, 768, "bfloat16", 1.0, 2), (2, 4096, 4096, "float16", 1.0, 2)]
    for batch, n, k, dtype, scale, k_parts in cases:
        assert kernel.batched_fits(k // 256, batch, n, k_parts=k_parts), (batch, n, k, k_parts)
        x, w = task.get_inputs(batch=batch, n=n, k=k, dtype=dtype)
        x, w = (x * scale).cuda(), w.cuda()
        x[:, 64:96] = 0  # a sub-block of zeros in every row
        want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
        got = torch.empty_like(want)
        kernel.batched(x, w, got, k_parts=k_parts)
        assert task.check(got, want), (batch, n, k, dtype, scale, k_parts)
        again = torch.empty_like(want)
        kernel.batched(x, w, again, k_parts=k_parts)
        assert torch.equal(got, again), (batch, n, k, k_parts)  # parts are added in one order
        if not k_parts and gemv.cuda_path(n, batch, kernel.batched_ctas_per_sm(k // 256, batch, n)) == "batched":
            # q4k_gemv picks this kernel here: the same launch, the same bits
            assert torch.equal(gemv.q4k_gemv(x, w), got), (batch, n, k)
    assert kernel.batched_k_parts(56, 8, 4096) == 7  # the H200's cut at K = 14336 (see the CPU test)
    for k_parts in (1, 2):  # from a graph, whole and cut (the parts' buffer is the graph's own)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernel.batched(x, w, got, dependent=True, k_parts=k_parts)
        x.copy_(torch.flip(x, dims=[0]))
        graph.replay()
        torch.cuda.synchronize()
        want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
        assert task.check(got, want), k_parts


@pytest.mark.gpu
def test_programmatic_dependent_launches_read_each_result(gemv, monkeypatch):
    """The model's decode chain under PDL: each kernel lets the next one start early, and each
    waits for the one before it before reading its output. A chain where every GEMV reads the
    norm just written and every norm reads the GEMV just written gives the same bits with PDL
    on and off, eagerly and from a CUDA graph; a missing wait would read stale values."""
    import torch

    from kernels.llama_q4k.add_rmsnorm import add_rms_norm

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUDA kernel and PDL run on sm_90")
    task = load("q4k_cuda_test_task_pdl", TASK_DIR / "task.py")
    torch.manual_seed(0)
    x, w = task.get_inputs(batch=1, n=4096, k=4096)
    x, w = x.cuda(), w.cuda()
    norm_weight = torch.rand(4096, device="cuda") + 0.5

    def chain(h, y):
        outs = []
        for _ in range(12):
            h, normed = add_rms_norm(h, y, norm_weight, 1e-5, constant_weight=True)
            y = gemv.q4k_gemv(normed, w, constant_weight=True)
            outs.append(y)
        return torch.cat(outs)

    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("LOOM_Q4K_PDL", pdl)
        eager = chain(x, x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(x, x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain(x, x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(eager).all()
        results[pdl] = (eager, captured.clone())
    assert torch.equal(results["1"][0], results["0"][0])
    assert torch.equal(results["1"][1], results["0"][0])
    assert torch.equal(results["0"][1], results["0"][0])


def test_cuda_probe_describes_itself():
    pytest.importorskip("torch")
    result = subprocess.run(
        [sys.executable, str(REPO / "kernels" / "tools" / "probe_q4k_cuda.py"), "--help"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--variants" in result.stdout and "CUDA batch-1 Q4_K GEMV" in result.stdout
    assert "--candidate" in result.stdout and "--against" in result.stdout and "--batch" in result.stdout


def test_cuda_probe_variants_take_their_defaults_by_position():
    pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "kernels" / "tools"))
    probe = load("q4k_cuda_probe_variants", REPO / "kernels" / "tools" / "probe_q4k_cuda.py")
    assert probe.parse_variant("3:2") == (3, 2, 2, 0)
    assert probe.parse_variant("3:2:3") == (3, 2, 3, 0)  # min_ctas given, still no cluster
    assert probe.parse_variant("0:0:2:2") == (0, 0, 2, 2)
    for bad in ("3", "3:2:3:2:1", "a:2", "3:-1"):
        with pytest.raises(ValueError, match="stages:ctas_per_sm"):
            probe.parse_variant(bad)


def test_stream_floor_pieces_cover_each_weight_exactly_once():
    """kernels/tools/stream_floor_cuda.py times reads of the GEMV's bytes cut in pieces; every layout it
    times must cover each shape's Q4_K matrix exactly, or its floor means nothing."""
    pytest.importorskip("torch")
    floor = load("stream_floor_cuda", REPO / "kernels" / "tools" / "stream_floor_cuda.py")
    for n, k in floor.SHAPES:
        row_bytes = k // 256 * 144
        layouts = floor.configurations(n, row_bytes)
        assert {kind for kind, *_ in layouts} == {"strided16", "flat"}
        assert any(kind == "strided16" and seg == 1152 for kind, _, seg, *_ in layouts)
        for kind, rows, seg, stride, per_row, items in layouts:
            assert items * rows * seg == n * row_bytes, (kind, seg)
            assert seg % 16 == 0  # bulk copies move multiples of 16 bytes
            if kind == "strided16":
                assert stride == row_bytes and per_row * seg == row_bytes and n % rows == 0


def test_ncu_summary_reads_a_real_h200_report():
    """kernels/tools/ncu_q4k_gemv.py (gpu_session.sh `ncu`) turns ncu's CSV pages into the headline
    figures and the most-stalled instructions; the fixtures are trimmed from an H200 run of the
    integer-MMA kernel (ncu's columns differ between versions, so it goes by column name)."""
    ncu = load("ncu_q4k_gemv", REPO / "kernels" / "tools" / "ncu_q4k_gemv.py")
    fixtures = REPO / "tests" / "fixtures" / "ncu"
    lines = ncu.headlines((fixtures / "details_q4k_gemv_h200.csv").read_text())
    assert "Duration: 13.02 us" in lines
    assert "Registers Per Thread: 88 register/thread" in lines
    assert any(line.startswith("DRAM Throughput: 54.03") for line in lines)
    stalls = ncu.top_stalls((fixtures / "sass_q4k_gemv_h200.csv").read_text(), count=5)
    assert stalls[0].startswith("Warp Stall Sampling (All Samples):")
    assert "long_sb" in stalls[0]
    # the most-sampled instruction: the consumers' wait on the ring's full barrier
    assert "BRA" in stalls[1] and stalls[1].rstrip().endswith("long_sb")
    shares = [float(line.split("%")[0]) for line in stalls[1:]]
    assert shares == sorted(shares, reverse=True) and len(shares) == 5
    assert ncu.headlines("") == ["(no details table)"]


def test_cuda_probe_summary_of_a_recorded_h200_run():
    """The probe ends with a short table of its JSON (gpu_session.sh shows only the tail);
    here on the eighth session's recorded H200 result."""
    import json

    probe = load("probe_q4k_cuda_summary", REPO / "kernels" / "tools" / "probe_q4k_cuda.py")
    recorded = json.loads((REPO / "tests" / "fixtures" / "probe" / "probe_q4k_cuda_h200.json").read_text())
    lines = probe.summary(recorded).splitlines()
    assert lines[0] == "checks: 11 of 11 passed"
    by_shape = {line.split(":")[0]: line for line in lines[1:]}
    assert set(by_shape) == {"4096x4096", "14336x4096", "4096x14336", "1024x4096"}
    assert "cuda_pdl 11.17 [11.13, 11.36] (2.96)" in by_shape["14336x4096"]
    assert "triton 25.84" in by_shape["4096x14336"]


@pytest.mark.parametrize("files, packed", [(9, True), (8, False)])
def test_gpu_session_packs_what_the_device_would_not_return(tmp_path, files, packed):
    out = tmp_path / "out"
    for i in range(files):
        path = out / f"phase{i % 3}" / "sub" / f"f{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(i))
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh"), "pack"],
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    if not packed:
        assert len(left) == files
        return
    assert left == ["session.tgz"]
    with tarfile.open(out / "session.tgz") as archive:
        names = sorted(n.removeprefix("./") for n in archive.getnames() if archive.getmember(n).isfile())
    assert names == sorted(f"phase{i % 3}/sub/f{i}.txt" for i in range(files))


@pytest.mark.parametrize("no_math", [False, True])
def test_timeline_instrumentation_finds_its_anchors_and_builds(tmp_path, no_math):
    # kernels/tools/timeline_q4k_gemv.py edits the kernel's text at fixed places; a kernel change that
    # moves one must fail here, not on the GPU machine
    sys.path.insert(0, str(REPO / "kernels" / "tools"))
    timeline = load("q4k_timeline_tool", REPO / "kernels" / "tools" / "timeline_q4k_gemv.py")
    source = timeline.instrument(CUDA_SOURCE, no_math)
    assert source.count("= now_ns()") == 7  # start, issue, x readable, x prepared, arrive, done, end
    assert ("if (false) {" in source) == no_math
    with pytest.raises(SystemExit, match="anchor"):
        timeline.instrument(CUDA_SOURCE.replace("griddepcontrol.wait", "griddepcontrol_wait"), no_math)
    if shutil.which("nvcc") is None:
        return
    (tmp_path / "timeline.cu").write_text(source)
    build = subprocess.run(
        ["nvcc", "-c", "-arch=sm_90", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "t.o"), str(tmp_path / "timeline.cu")],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", build.stderr + build.stdout)]
    assert spills and not any(spills), build.stderr


def test_timeline_summary_of_a_recorded_h200_run():
    """kernels/tools/timeline_q4k_gemv.py's summary on records from an H200 (one replay, three chained
    PDL launches at 14336 x 4096, times shifted to start near zero, SM ids as recorded): the
    kernel as it is against the same kernel without its arithmetic."""
    np = pytest.importorskip("numpy")
    sys.path.insert(0, str(REPO / "kernels" / "tools"))
    timeline = load("q4k_timeline_summary", REPO / "kernels" / "tools" / "timeline_q4k_gemv.py")
    records = np.load(REPO / "tests" / "fixtures" / "timeline" / "q4k_gemv_h200_14336x4096.npz")
    kept = timeline.summarize(records["kept_14336x4096_pdl"], 8)
    bare = timeline.summarize(records["no_math_14336x4096_pdl"], 8)
    assert records["kept_14336x4096_pdl"].shape == (1, 3, 224, timeline.RECORD)
    for s in (kept, bare):
        # under PDL every CTA starts before the launch before it ends, and reads x only after
        assert s["first_start_us"] < s["last_start_us"] < 0 < s["x_readable_median_us"]
        assert s["x_readable_median_us"] < s["x_prepared_median_us"] <= s["first_arrival_median_us"]
        assert s["last_arrival_us"] <= s["last_done_us"] <= s["launch_us"]
        assert s["cta_end_quantiles_us"] == sorted(s["cta_end_quantiles_us"])
        assert s["cta_end_quantiles_us"][-1] == s["launch_us"]  # the one middle launch
    # what the arithmetic costs in this run: 1.6 us of launch (the last chunk 1.0 us later, the
    # tail after it 0.5 us longer), and each chunk waits longer for its slowest warp
    assert kept["launch_us"] - bare["launch_us"] > 1.0
    assert kept["tail_us"] > bare["tail_us"] + 0.3
    assert kept["done_after_arrival_median_us"] > bare["done_after_arrival_median_us"] + 0.3
    # Where it costs: 224 CTAs cover at most the 132 SMs, some SMs run one CTA of the launch and
    # others two, and with the arithmetic a CTA sharing its SM ends 1.8 us after one alone
    # (0.5 us without): the consumers' issue slots, not the stream, set the pace.
    for s in (kept, bare):
        assert s["sms_used"] <= 132 and 0 < s["alone_on_sm_ctas"] < 224
        assert s["late_start_ctas"] == 0  # every CTA of the middle launch started 0.7 us or more early
    sharing_cost = kept["shared_sm_end_median_us"] - kept["alone_on_sm_end_median_us"]
    assert sharing_cost > 1.5
    assert sharing_cost > bare["shared_sm_end_median_us"] - bare["alone_on_sm_end_median_us"] + 1.0
