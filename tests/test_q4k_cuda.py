"""The q4k_gemv candidate's CUDA batch-1 kernel: its source builds for Hopper without spills
(nvcc, here), and on a GPU it matches the float64 reference across shapes, activation ranges
and CUDA-graph replay. Timing it: `python kernels/tools/probe_q4k_cuda.py` (gpu_session.sh `cuda`)."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def candidate():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    pytest.importorskip("gguf")  # the task's reference dequantizes with it
    return load("q4k_cuda_test_candidate", TASK_DIR / "candidate.py")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_source_builds_for_sm90_without_spills(candidate, tmp_path):
    source = tmp_path / "q4k_gemv.cu"
    source.write_text(candidate.CUDA_SOURCE)
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


def test_shared_memory_plan_fits_two_ctas_for_llama_shapes(candidate):
    # H200 / H100: 227 KB per CTA at most, 228 KB per SM; two CTAs keep the ring full while
    # the other computes.
    for n_blocks in (16, 56):
        for after_small in (False, True):
            stages = candidate.cuda_stages(n_blocks, after_small)
            assert 2 * (candidate.cuda_shared_bytes(n_blocks, stages) + 1024) <= 228 * 1024
    # the long rows hold more x; even the deepest ring the probes try there (4) fits two CTAs
    assert candidate.cuda_shared_bytes(56, 3) > candidate.cuda_shared_bytes(16, 3)
    assert 2 * (candidate.cuda_shared_bytes(56, 4) + 1024) <= 228 * 1024


def test_ring_depth_follows_the_shape_and_the_caller_unless_overridden(candidate, monkeypatch):
    monkeypatch.delenv("LOOM_Q4K_STAGES", raising=False)
    # back to back with another heavy kernel (the task's timing): three slots everywhere
    assert [candidate.ring_slots(n) for n in (5, 16, 32, 56, 64)] == [3] * 5
    # after a small kernel (the model's down projection after SwiGLU): four from K = 8192
    assert candidate.ring_slots(56, True) == candidate.cuda_stages(56, True) == 4
    assert candidate.ring_slots(16, True) == candidate.cuda_stages(16, True) == 3
    # a fourth slot only while two CTAs still fit an SM: K = 16384 yes, K = 18944 no
    assert candidate.cuda_stages(64, True) == 4 and candidate.cuda_stages(74, True) == 3
    for n_blocks in (16, 32, 56, 64, 72, 74):
        stages = candidate.cuda_stages(n_blocks, True)
        assert 2 * (candidate.cuda_shared_bytes(n_blocks, stages) + 1024) <= 228 * 1024, n_blocks
    # the variable overrides the caller's context too (A/B timing inside a whole program)
    monkeypatch.setenv("LOOM_Q4K_STAGES", "4")
    assert candidate.ring_slots(56) == candidate.ring_slots(16) == candidate.ring_slots(16, True) == 4
    monkeypatch.setenv("LOOM_Q4K_STAGES", "16:5, 56:4")
    assert (candidate.ring_slots(16), candidate.ring_slots(56)) == (5, 4)
    assert candidate.ring_slots(5) == candidate.cuda_stages(5)  # a shape not named keeps its own
    assert candidate.ring_slots(64, True) == candidate.cuda_stages(64, True) == 4
    for bad in ("0", "9", "four", "-1", "16:9", "x:4", "16:4,56", "16:", "4,16:9"):
        monkeypatch.setenv("LOOM_Q4K_STAGES", bad)
        with pytest.raises(ValueError, match="LOOM_Q4K_STAGES"):
            candidate.ring_slots(56)


def test_what_streams_before_the_kernel_ahead_ends(candidate):
    # after a small kernel, the whole ring, whatever the work
    assert candidate.items_before_wait(7, 4, follows_small_kernel=True) == 4
    assert candidate.items_before_wait(8, 3, follows_small_kernel=True) == 3
    # back to back: the whole ring where the CTA's work fits it (4096², 1024x4096: two items)
    assert candidate.items_before_wait(2, 3) == 3
    assert candidate.items_before_wait(3, 3) == 3
    # one chunk where it outlasts the ring (the 33 MB shapes: seven and eight items)
    assert candidate.items_before_wait(7, 3) == candidate.items_before_wait(8, 3) == 1
    # the launch counts a CTA's items with the CUDA source's chunk width
    defined = re.search(r"#define CHUNK_BLOCKS (\d+)", candidate.CUDA_SOURCE)
    assert defined and int(defined.group(1)) == candidate.CUDA_CHUNK_BLOCKS


@pytest.mark.gpu
def test_cuda_kernel_matches_the_reference_on_a_gpu(candidate):
    import torch

    major = torch.cuda.get_device_capability()[0]
    if major < 9 or (major > 9 and os.environ.get("LOOM_Q4K_CUDA") != "1"):
        pytest.skip("the CUDA kernel runs on sm_90 (newer GPUs with LOOM_Q4K_CUDA=1)")
    task = load("q4k_cuda_test_task", TASK_DIR / "task.py")
    base = load("q4k_cuda_test_base", TASK_DIR / "baseline.py")
    assert candidate.cuda_gemv_b1(torch.device("cuda")) is not None, "the kernel did not build"
    torch.manual_seed(0)
    # Small K after large K on purpose: a per-shape shared-memory limit would break the large
    # one afterwards.
    cases = [(4096, 14336, "bfloat16", 1.0), (100, 768, "bfloat16", 1.0), (4096, 14336, "bfloat16", 64.0),
             (1024, 4096, "float16", 1e-3), (9, 1280, "float16", 1.0), (300, 2048, "bfloat16", 1e4)]
    for n, k, dtype, scale in cases:
        x, w = task.get_inputs(batch=1, n=n, k=k, dtype=dtype)
        x, w = (x * scale).cuda(), w.cuda()
        want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
        got = candidate.q4k_gemv(x, w)
        assert task.check(got, want), (n, k, dtype, scale)
    # the same numbers from a CUDA-graph replay
    x, w = task.get_inputs(batch=1, n=2048, k=4096)
    x, w = x.cuda(), w.cuda()
    eager = candidate.q4k_gemv(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = candidate.q4k_gemv(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_batches_go_to_the_cuda_kernel_only_where_it_was_faster(candidate):
    path = candidate.cuda_path
    # batch 1 everywhere on the batch-1 kernel
    assert path(1024, 1, 0) == "rows" and path(9, 1, 0) == "rows"
    # the batched kernel wherever two CTAs fit an SM (K = 4096 up to batch 5), from 1024 rows
    assert all(path(n, b, 2) == "batched" for n in (1024, 4096, 14336) for b in range(2, 9))
    # one CTA per SM: it lost at batch 2 (4096 x 14336) and won from batch 3
    assert path(4096, 2, 1) == "rows" and path(4096, 3, 1) == "batched" and path(4096, 4, 1) == "batched"
    assert path(1024, 8, 1) == "batched"
    # where it would not fit (no longer at Llama shapes: K is cut into parts, see below):
    # per-row launches from 4096 rows, else Triton
    assert path(4096, 8, 0) == "rows" and path(14336, 6, 0) == "rows"
    assert path(1024, 2, 0) is None and path(1024, 2, 1) is None
    # too few rows for either measured CUDA path, or more rows of x than a program takes
    assert path(512, 4, 2) is None
    assert path(4096, 9, 2) is None and path(14336, 16, 0) is None
    assert candidate.cuda_takes_batch(1024, 8) and not candidate.cuda_takes_batch(512, 2)
    assert not candidate.cuda_takes_batch(4096, 9)


def test_persistent_grid_gives_every_cta_the_same_tiles(candidate):
    # 132 SMs x 2 CTAs: 896 tiles (14336 rows) go to 224 CTAs, four each; 256 tiles to 256
    assert candidate.balanced_grid(14336, 264) == 224
    assert candidate.balanced_grid(4096, 264) == 256
    assert candidate.balanced_grid(100, 264) == 7  # a tile each
    for rows in (1024, 4096, 4112, 14336, 28672):
        tiles, grid = -(-rows // 16), candidate.balanced_grid(rows, 264)
        assert grid <= 264 and -(-tiles // grid) == -(-tiles // 264)


def test_batched_shared_memory_matches_what_was_measured(candidate):
    # the rule above was measured with these fits on an H200 (228 KB per SM, 1 KB reserved per
    # CTA, 227 KB at most per CTA): K = 4096 holds two CTAs to batch 5, one to batch 8;
    # K = 14336 one CTA to batch 5, none beyond
    def per_sm(n_blocks, batch):
        shared = candidate.cuda_batched_shared_bytes(n_blocks, batch, 3)
        return 0 if shared > 227 * 1024 else min(2, 228 * 1024 // (shared + 1024))

    assert [per_sm(16, b) for b in range(2, 9)] == [2, 2, 2, 2, 1, 1, 1]
    assert [per_sm(56, b) for b in range(2, 9)] == [1, 1, 1, 1, 0, 0, 0]


def test_batched_kernel_cuts_k_where_x_crowds_out_a_second_cta(candidate, monkeypatch):
    """Where x of every row leaves room for one CTA per SM or none, the batched kernel cuts K
    into runs of whole chunks, each CTA holding x of its run only: the fewest equal runs that
    let two CTAs onto an SM. Occupancy modelled as on the H200 (228 KB per SM, 1 KB reserved
    per CTA, 227 KB at most per CTA)."""
    monkeypatch.delenv("LOOM_Q4K_K_PARTS", raising=False)

    def plan(n_blocks, batch, n_rows=4096):
        def per_sm(parts):
            shared = candidate.cuda_batched_shared_bytes(n_blocks, batch, 3, parts)
            return 0 if shared > 227 * 1024 else min(2, 228 * 1024 // (shared + 1024))

        parts = candidate.batched_k_parts(n_blocks, batch, per_sm, n_rows, 132)
        return parts, per_sm(parts)

    # K = 4096 (two chunks), 4096 rows: whole at batches 2 and 3, two parts of one chunk from
    # batch 4 (from batch 6 two CTAs per SM need them)
    assert [plan(16, b) for b in range(2, 9)] == [(1, 2)] * 2 + [(2, 2)] * 5
    # 1024 rows are 64 tiles: whole K would keep 64 of the 264 resident CTAs busy
    assert plan(16, 2, 1024) == (2, 2) and plan(16, 3, 14336) == (1, 2)
    # K = 14336 (seven chunks): seven parts of one chunk at every batch (2 or 3 parts would be
    # uneven, and 4 chunks of x for 8 rows still leave one CTA per SM)
    assert [plan(56, b) for b in range(2, 9)] == [(7, 2)] * 7
    assert plan(56, 2, 100) == (7, 2)  # no more parts than there are chunks
    # without a row count, no filling: the fewest parts that fit two CTAs (and two from batch 4)
    assert candidate.batched_k_parts(16, 2, lambda parts: 2) == 1
    assert candidate.batched_k_parts(16, 4, lambda parts: 2) == 2
    # a run is whole chunks; the last part may be short (K = 11008: 43 blocks, 6 chunks)
    assert candidate.part_blocks(43, 1) == 43 and candidate.part_blocks(43, 2) == 24
    assert candidate.part_blocks(43, 6) == 8 and candidate.part_blocks(56, 7) == 8
    assert candidate.cuda_batched_shared_bytes(56, 8, 3, 7) == candidate.cuda_batched_shared_bytes(8, 8, 3)
    # no part is ever empty: 6 chunks asked into 4 parts are 3 parts of 2, 7 into 5 are 4
    assert [candidate.whole_parts(43, k) for k in range(1, 9)] == [1, 2, 3, 3, 3, 6, 6, 6]
    assert candidate.whole_parts(56, 5) == 4 and candidate.whole_parts(56, 7) == 7
    # the timing override, bounded by the chunks there are
    monkeypatch.setenv("LOOM_Q4K_K_PARTS", "3")
    assert candidate.batched_k_parts(56, 8, lambda parts: 2) == 3
    assert candidate.batched_k_parts(16, 8, lambda parts: 2) == 2
    monkeypatch.setenv("LOOM_Q4K_K_PARTS", "4")
    assert candidate.batched_k_parts(43, 8, lambda parts: 2) == 3
    monkeypatch.setenv("LOOM_Q4K_K_PARTS", "two")
    with pytest.raises(ValueError, match="LOOM_Q4K_K_PARTS"):
        candidate.batched_k_parts(56, 8, lambda parts: 2)


@pytest.mark.gpu
def test_batched_decode_on_the_cuda_kernel_is_each_row_alone(candidate, monkeypatch):
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
            got = candidate.q4k_gemv(x, w, constant_weight=constant)
            assert task.check(got, want), (batch, n, k, constant)
            for row in range(batch):
                assert torch.equal(got[row], candidate.q4k_gemv(x[row : row + 1], w)[0]), (batch, n, row)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = candidate.q4k_gemv(x, w, constant_weight=True)
        x.copy_(torch.flip(x, dims=[0]))  # new inputs in place: the replay must read them
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, candidate.q4k_gemv(x, w)), (batch, n, k)


@pytest.mark.gpu
def test_batched_kernel_matches_the_reference_on_a_gpu(candidate):
    """The batched kernel (one launch for batches 2-8, the MMA's columns the rows of x) against
    float64, with odd row counts, K tails, fp16, scaled x and zero sub-blocks; and from a graph."""
    import torch

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUDA kernel runs on sm_90")
    task = load("q4k_cuda_test_task_batched", TASK_DIR / "task.py")
    base = load("q4k_cuda_test_base_batched", TASK_DIR / "baseline.py")
    kernel = candidate.cuda_gemv_b1(torch.device("cuda"))
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
        if not k_parts and candidate.cuda_path(n, batch, kernel.batched_ctas_per_sm(k // 256, batch, n)) == "batched":
            # q4k_gemv picks this kernel here: the same launch, the same bits
            assert torch.equal(candidate.q4k_gemv(x, w), got), (batch, n, k)
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
def test_programmatic_dependent_launches_read_each_result(candidate, monkeypatch):
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
            y = candidate.q4k_gemv(normed, w, constant_weight=True)
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
def test_timeline_instrumentation_finds_its_anchors_and_builds(candidate, tmp_path, no_math):
    # kernels/tools/timeline_q4k_gemv.py edits the kernel's text at fixed places; a kernel change that
    # moves one must fail here, not on the GPU machine
    sys.path.insert(0, str(REPO / "kernels" / "tools"))
    timeline = load("q4k_timeline_tool", REPO / "kernels" / "tools" / "timeline_q4k_gemv.py")
    source = timeline.instrument(candidate.CUDA_SOURCE, no_math)
    assert source.count("= now_ns()") == 7  # start, issue, x readable, x prepared, arrive, done, end
    assert ("if (false) {" in source) == no_math
    with pytest.raises(SystemExit, match="anchor"):
        timeline.instrument(candidate.CUDA_SOURCE.replace("griddepcontrol.wait", "griddepcontrol_wait"), no_math)
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
