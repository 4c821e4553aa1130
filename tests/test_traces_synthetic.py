"""Trace analysis on small hand-made traces: exact timeline arithmetic, flow-only linking,
unknown devices, bare arrays, an nsys SQLite export built to the documented schema, and the
FLOP/byte models, categories and interval helpers on their own."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from loom_mcp.traces import analyze_trace_file
from loom_mcp.traces.categories import classify, short_name
from loom_mcp.traces.events import KIND_KERNEL, KIND_MEMCPY, OpSig
from loom_mcp.traces.intervals import merge, union_length
from loom_mcp.traces.perfmodels import model
from loom_mcp.traces.readers import detect_format

SYNTH = Path(__file__).resolve().parent / "fixtures" / "traces_synthetic"


def test_overlapping_streams_exact_breakdown():
    s = analyze_trace_file(SYNTH / "kineto_overlap_flow_unknown_device.json")
    t = s.timeline
    assert (t.total_us, t.computation_us, t.exposed_comm_us, t.exposed_memcpy_us) == (60, 23, 7, 4)
    assert (t.busy_us, t.idle_us, t.idle_short_us, t.idle_long_us) == (34, 26, 0, 26)
    # The 26 µs gap ends with a kernel whose launch was issued after the GPU ran dry.
    assert t.host_bound_idle_us == 26
    kinds = {f.kind for f in s.findings}
    assert {"exposed_comm", "exposed_memcpy"} <= kinds


def test_kernel_linked_through_its_flow_event_only():
    s = analyze_trace_file(SYNTH / "kineto_overlap_flow_unknown_device.json")
    assert s.linking.op_pct == 100.0 and not s.linking.partial
    mm = [r for r in s.top_ops if r.name == "aten::mm"]
    assert mm and mm[0].calls == 2  # the flow-linked kernel is the second aten::mm call


def test_unknown_device_gives_null_roofline_with_a_note():
    s = analyze_trace_file(SYNTH / "kineto_overlap_flow_unknown_device.json")
    assert s.device == "Imaginary GPU 9000" and not s.peak_known
    assert any("Imaginary GPU 9000" in n and "null" in n for n in s.notes)
    mm = next(r for r in s.top_ops if r.name == "aten::mm")
    assert mm.roof is not None
    assert mm.roof.pct is None and mm.roof.bound is None
    assert mm.roof.tflops == pytest.approx(2 * 64 * 128 * 256 * 2 / 20e-6 / 1e12, rel=0.01)


def test_bare_array_trace():
    p = SYNTH / "kineto_bare_array.json"
    assert detect_format(p) == "kineto"
    s = analyze_trace_file(p)
    assert s.timeline.busy_us == 4.0 and s.top_ops[0].name == "aten::gelu"
    assert s.device is None and any("device" in n for n in s.notes)


# ---------------------------------------------------------------- nsys


NSYS_SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE ENUM_CUDA_MEMCPY_OPER (id INTEGER PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE TARGET_INFO_GPU (vmId INTEGER, id INTEGER NOT NULL, name TEXT, busLocation TEXT,
    isDiscrete INTEGER, l2CacheSize INTEGER, totalMemory INTEGER, memoryBandwidth INTEGER,
    clockRate INTEGER, smCount INTEGER, uuid TEXT);
CREATE TABLE TARGET_INFO_SYSTEM_ENV (globalVid INTEGER, devStateName TEXT, name TEXT NOT NULL,
    nameEnum INTEGER, value TEXT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
    eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL,
    returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL,
    shortName INTEGER NOT NULL, mangledName INTEGER, launchType INTEGER, cacheConfig INTEGER,
    registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, gridY INTEGER NOT NULL,
    gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL,
    blockZ INTEGER NOT NULL, staticSharedMemory INTEGER NOT NULL,
    dynamicSharedMemory INTEGER NOT NULL, localMemoryPerThread INTEGER NOT NULL,
    localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT NULL, sharedMemoryExecuted INTEGER,
    graphNodeId INTEGER, sharedMemoryLimitConfig INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL,
    deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER, srcDeviceId INTEGER,
    srcContextId INTEGER, dstDeviceId INTEGER, dstContextId INTEGER, migrationCause INTEGER,
    graphNodeId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, value INTEGER NOT NULL, bytes INTEGER NOT NULL,
    graphNodeId INTEGER, memKind INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
    rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
    endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER,
    int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER,
    floatValue REAL, jsonTextId INTEGER, jsonText TEXT);
"""

TID = 0x1000000A0000B  # a serialized globalTid


def fake_token() -> str:
    # Built at run time so no token-shaped string sits in the repository.
    return "hf_" + "Zq9" * 12


def make_nsys(path: Path) -> None:
    db = sqlite3.connect(path)
    db.executescript(NSYS_SCHEMA)
    strings = {
        1: "cudaLaunchKernel",
        2: "cudaGraphLaunch",
        3: "cudaMemcpyAsync",
        4: "cudaMemsetAsync",
        10: "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x6_tn_align8>(Params)",
        11: "gemm_relu",
        12: "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int)",
        13: "vectorized_elementwise_kernel",
        14: "triton_poi_fused_add_mul_0",
        15: "flash_fwd_kernel",
    }
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", strings.items())
    db.execute(
        "INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES (1, 'CUDA_MEMCPY_KIND_HTOD', 'Host-to-Device')"
    )
    db.execute(
        "INSERT INTO TARGET_INFO_GPU (vmId, id, name, smCount) VALUES (0, 0, 'NVIDIA H100 80GB HBM3', 132)"
    )
    db.execute(
        "INSERT INTO TARGET_INFO_SYSTEM_ENV (name, value) VALUES ('DeviceEnvironment', ?)",
        (f"PATH=/usr/bin HF_TOKEN={fake_token()} HOME=/root",),
    )
    # ns. Eager GEMM under an NVTX op range, an elementwise kernel, then a graph launch that
    # replays two kernels, a copy and a memset.
    runtime = [
        (1_000, 3_000, 1, 101),
        (20_000, 21_000, 1, 102),
        (40_000, 45_000, 2, 103),
        (60_000, 61_000, 3, 104),
        (62_000, 63_000, 4, 105),
    ]
    db.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, ?, 0, 0)",
        [(s, e, TID, c, n) for s, e, n, c in runtime],
    )
    kernels = [  # start, end, stream, corr, demangled, short
        (5_000, 15_000, 7, 101, 10, 11),
        (22_000, 24_000, 7, 102, 12, 13),
        (46_000, 50_000, 7, 103, 14, 14),
        (50_500, 58_000, 7, 103, 15, 15),
    ]
    db.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, "
        "correlationId, globalPid, demangledName, shortName, registersPerThread, gridX, gridY, "
        "gridZ, blockX, blockY, blockZ, staticSharedMemory, dynamicSharedMemory, "
        "localMemoryPerThread, localMemoryTotal, gridId) "
        "VALUES (?, ?, 0, 1, ?, ?, 1, ?, ?, 32, 1, 1, 1, 128, 1, 1, 0, 0, 0, 0, 0)",
        kernels,
    )
    db.execute(
        "INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, contextId, streamId, "
        "correlationId, globalPid, bytes, copyKind) VALUES (64000, 70000, 0, 1, 8, 104, 1, 4194304, 1)"
    )
    db.execute(
        "INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET (start, end, deviceId, contextId, streamId, "
        "correlationId, globalPid, value, bytes) VALUES (71000, 72000, 0, 1, 7, 105, 1, 0, 1024)"
    )
    db.executemany(
        "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (?, ?, 59, ?, ?)",
        [
            (500, 4_000, "aten::mm, seq = 3, sizes = [[128, 256], [256, 512]]", TID),
            (19_000, 22_000, "aten::add, seq = 4, sizes = [[128, 512], [128, 512]]", TID),
        ],
    )
    db.commit()
    db.close()


def test_nsys_sqlite_export(tmp_path):
    p = tmp_path / "report.sqlite"
    make_nsys(p)
    assert detect_format(p) == "nsys"
    s = analyze_trace_file(p, out_dir=tmp_path / "out")
    assert s.source_format == "nsys" and s.device == "NVIDIA H100 80GB HBM3"
    t = s.timeline
    # Independent: union of [5,15] [22,24] [46,50] [50.5,58] [64,70] [71,72] µs.
    assert t.total_us == 67.0 and t.busy_us == 10 + 2 + 4 + 7.5 + 6 + 1
    assert t.exposed_memcpy_us == 7.0 and t.gpu_events == 6
    names = {r.name: r for r in s.top_ops}
    assert names["aten::mm"].via == "op" and names["aten::add"].via == "op"
    assert names["flash_fwd_kernel"].via == "graph"
    assert names["triton_poi_fused_add_mul_0"].via == "graph"
    assert s.linking.graph_launches == 1
    assert s.linking.graph_pct == pytest.approx(100 * 11.5 / 30.5, abs=0.1)
    assert any(r.name.startswith("Memcpy Host-to-Device") for r in s.top_ops)
    assert s.metadata.found and s.metadata.secret_like
    assert "TARGET_INFO_SYSTEM_ENV" in s.metadata.blocks
    blobs = [s.model_dump_json()] + [
        (tmp_path / "out" / a).read_bytes().decode("latin-1") for a in s.artifacts
    ]
    assert all(fake_token() not in b for b in blobs)


# ---------------------------------------------------------------- units


def _sig(name, dims, types, concrete=None):
    return OpSig(name, dims, types, concrete)


def test_gemm_models():
    w = model(_sig("aten::mm", [[64, 128], [128, 256]], ["c10::BFloat16"] * 2))
    assert w.flops == 2 * 64 * 128 * 256 and w.bytes == 2 * (64 * 128 + 128 * 256 + 64 * 256)
    assert w.dtype == "bf16" and w.matrix
    w = model(
        _sig(
            "aten::addmm",
            [[256], [64, 128], [128, 256], [], []],
            ["c10::Half"] * 3 + ["Scalar"] * 2,
        )
    )
    assert w.flops == 2 * 64 * 128 * 256 + 64 * 256 and w.dtype == "fp16"
    w = model(_sig("aten::bmm", [[8, 64, 32], [8, 32, 16]], ["float", "float"]))
    assert w.flops == 2 * 8 * 64 * 16 * 32 and w.dtype == "fp32"
    w = model(_sig("aten::linear", [[4, 10, 128], [256, 128], [256]], ["c10::BFloat16"] * 3))
    assert w.flops == 2 * 40 * 256 * 128 + 40 * 256
    w = model(_sig("aten::baddbmm", [[8, 64, 16], [8, 64, 32], [8, 32, 16]], ["float"] * 3))
    assert w.flops == 2 * 8 * 64 * 16 * 32 + 8 * 64 * 16
    assert model(_sig("aten::mm", [[64, 128], [64, 256]], ["float"] * 2)) is None  # K mismatch


def test_conv_and_attention_models():
    conv = _sig(
        "aten::convolution",
        [[8, 64, 56, 56], [128, 64, 3, 3], [], [], [], [], [], [], []],
        ["c10::BFloat16"] * 2 + [""] * 7,
        ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"],
    )
    w = model(conv)
    assert w.flops == 2 * 8 * 128 * 28 * 28 * 64 * 9
    q = [2, 8, 128, 64]
    base = ["c10::BFloat16"] * 3 + ["Scalar"] * 4
    full = model(
        _sig(
            "aten::_scaled_dot_product_flash_attention",
            [q, q, q, [], [], [], []],
            base,
            ["", "", "", "0.", "False", "False", ""],
        )
    )
    causal = model(
        _sig(
            "aten::_scaled_dot_product_flash_attention",
            [q, q, q, [], [], [], []],
            base,
            ["", "", "", "0.", "True", "False", ""],
        )
    )
    assert full.flops == 4 * 2 * 8 * 128 * 128 * 64
    assert causal.flops == pytest.approx(full.flops * (128 * 129 / 2) / (128 * 128))
    bshd = [2, 128, 8, 64]
    flash = model(
        _sig(
            "aten::_flash_attention_forward",
            [bshd] * 3 + [[]] * 12,
            ["c10::BFloat16"] * 3 + [""] * 12,
            [""] * 8 + ["False"] + [""] * 6,
        )
    )
    assert flash.flops == full.flops


def test_memory_bound_models():
    ln = model(
        _sig(
            "aten::native_layer_norm",
            [[64, 4096], [], [4096], [4096], []],
            ["c10::Half", "ScalarList", "c10::Half", "c10::Half", "Scalar"],
        )
    )
    assert ln.bytes == 2 * 64 * 4096 * 2 + 2 * 4096 * 2 and not ln.matrix
    sm = model(_sig("aten::_softmax", [[4096, 1000], [], []], ["float", "Scalar", "Scalar"]))
    assert sm.bytes == 2 * 4096 * 1000 * 4
    mul = model(_sig("aten::mul", [[1, 559, 64], []], ["float", "double"]))  # 0-dim double
    assert mul.bytes == 559 * 64 * 4 * 2 + 8
    add_ = model(
        _sig("aten::add_", [[16, 1024], [16, 1024], []], ["c10::BFloat16"] * 2 + ["Scalar"])
    )
    assert add_.bytes == 3 * 16 * 1024 * 2
    tri = model(_sig("triton_poi_fused_silu_0", [[8, 2048], [8, 2048]], ["c10::BFloat16"] * 2))
    assert tri.flops is None and tri.bytes == 2 * 8 * 2048 * 2
    assert model(_sig("aten::cat", [[[1, 2], [1, 2]], []], ["TensorList", "Scalar"])) is None
    assert model(_sig("my_ext::fused_thing", [[1024]], ["float"])) is None


@pytest.mark.parametrize(
    ("name", "kind", "op", "cat"),
    [
        ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_bias_TNT", KIND_KERNEL, None, "GEMM"),
        ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT64x32x256", KIND_KERNEL, None, "GEMM"),
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, cutlass::bfloat16_t>>()",
            KIND_KERNEL,
            None,
            "attention",
        ),
        ("void paged_attention_ll4mi_QKV_mfma16_kernel<0>()", KIND_KERNEL, None, "attention"),
        (
            "ncclDevKernel_Generic_1(ncclDevKernelArgsStorage<4096ul>)",
            KIND_KERNEL,
            None,
            "communication",
        ),
        ("triton_red_fused_add_mean_mul_pow_rsqrt_0", KIND_KERNEL, None, "Triton"),
        (
            "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float, false>()",
            KIND_KERNEL,
            None,
            "normalization",
        ),
        ("_ZN5aiter24add_rmsnorm_quant_kernelIDF16bEEvPT0_", KIND_KERNEL, None, "normalization"),
        (
            "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>()",
            KIND_KERNEL,
            None,
            "reduction",
        ),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>()",
            KIND_KERNEL,
            None,
            "reduction",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>()",
            KIND_KERNEL,
            None,
            "elementwise",
        ),
        ("fused_moe_kernel", KIND_KERNEL, None, "MoE"),
        ("dynamic_per_token_scaled_fp8_quant_kernel", KIND_KERNEL, None, "quant/dequant"),
        ("__amd_rocclr_copyBuffer", KIND_KERNEL, None, "memcpy/memset"),
        ("Memcpy HtoD (Pageable -> Device)", KIND_MEMCPY, None, "memcpy/memset"),
        ("kernel_0", KIND_KERNEL, "aten::mm", "GEMM"),
        ("kernel_0", KIND_KERNEL, None, "other"),
    ],
)
def test_categories(name, kind, op, cat):
    assert classify(name, kind, op) == cat


def test_short_names():
    assert (
        short_name(
            "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&)::{lambda()#2}>(int)"
        )
        == "vectorized_elementwise_kernel<GeluCUDAKernelImpl>"
    )
    assert (
        short_name(
            "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(int)"
        )
        == "vectorized_elementwise_kernel<MulFunctor>"
    )
    assert (
        short_name("_ZN7sgl_hip10activation18act_and_mul_kernelI14__hip_bfloat16EEvPS3_i")
        == "act_and_mul_kernel"
    )
    assert (
        short_name("ncclDevKernel_Generic_1(ncclDevKernelArgsStorage<4096ul>)")
        == "ncclDevKernel_Generic_1"
    )
    assert short_name("Memcpy DtoH (Device -> Pinned)") == "Memcpy DtoH (Device -> Pinned)"
    assert len(short_name("x" * 500)) == 64


def test_interval_merge():
    s = np.array([5.0, 0.0, 12.0, 30.0, 18.0])
    e = np.array([20.0, 10.0, 15.0, 31.0, 24.0])
    ms, me, first = merge(s, e)
    assert ms.tolist() == [0.0, 30.0] and me.tolist() == [24.0, 31.0]
    assert first.tolist() == [1, 3]
    assert union_length(s, e) == 25.0
    assert union_length(np.zeros(0), np.zeros(0)) == 0.0


# ---------------------------------------------------------------- odd inputs


def _kernel(dev: int, ts: float, dur: float, name: str = "gemm_kernel") -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": dev, "tid": 7, "ts": ts, "dur": dur,
            "args": {"device": dev, "stream": 7}}  # fmt: skip


def test_two_devices_timeline_is_for_the_busiest(tmp_path):
    import json

    p = tmp_path / "two.json"
    events = [_kernel(0, 0, 5), _kernel(1, 0, 50), _kernel(1, 60, 10)]
    props = [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}, {"id": 1, "name": "NVIDIA H200"}]
    p.write_text(json.dumps({"traceEvents": events, "deviceProperties": props}))
    s = analyze_trace_file(p)
    assert s.device == "NVIDIA H200" and s.timeline.busy_us == 60 and s.timeline.total_us == 70
    assert s.timeline.other_devices == 1 and any("2 devices" in n for n in s.notes)
    assert s.linking.unlinked_pct == 100.0 and s.linking.partial


def test_cpu_only_trace(tmp_path):
    import json

    p = tmp_path / "cpu.json"
    p.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {
                        "ph": "X",
                        "cat": "cpu_op",
                        "name": "aten::add",
                        "pid": 1,
                        "tid": 1,
                        "ts": 0,
                        "dur": 3,
                    }
                ]
            }
        )
    )
    s = analyze_trace_file(p)
    assert s.timeline.gpu_events == 0 and any("no GPU activity" in n for n in s.notes)
    # A CPU run still has its host ops ranked, by host time.
    assert [(o.name, o.us, o.pct) for o in s.top_ops] == [("aten::add", 3.0, 100.0)]


@pytest.mark.parametrize(
    "content", [b"", b"hello", b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1']
)
def test_malformed_inputs_raise_bad_input(tmp_path, content):
    from loom_mcp.errors import ErrorCode, LoomError

    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(LoomError) as e:
        analyze_trace_file(p)
    assert e.value.code == ErrorCode.BAD_INPUT


def test_missing_trace_is_not_found(tmp_path):
    from loom_mcp.errors import ErrorCode, LoomError

    with pytest.raises(LoomError) as e:
        analyze_trace_file(tmp_path / "nope.json")
    assert e.value.code == ErrorCode.NOT_FOUND


def test_captured_launches_that_never_ran_are_flagged(tmp_path):
    """A trace of a graph-capture phase: many launch calls, almost no GPU work. The missing
    work must be called out, not silently reported as an idle GPU."""
    import json

    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamBeginCapture", "pid": 1, "tid": 1,
               "ts": 0, "dur": 1, "args": {"correlation": 1}}]  # fmt: skip
    for i in range(200):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": 2 + i, "dur": 0.5, "args": {"correlation": 10 + i}})  # fmt: skip
    events.append(_kernel(0, 500, 3) | {"args": {"device": 0, "stream": 7, "correlation": 10}})
    p = tmp_path / "capture.json"
    p.write_text(json.dumps({"traceEvents": events}))
    s = analyze_trace_file(p)
    assert s.linking.launches_without_gpu == 199 and s.linking.partial
    assert any(
        "199 kernel-launch calls have no GPU activity" in n and "capture" in n
        for n in s.linking.notes
    )
