"""The Q4_K block format (kernels/q4k/format.py) against gguf-py, the reference dequantizer.

gguf-py's `dequantize(data, GGMLQuantizationType.Q4_K)` matches llama.cpp's C bit for bit, so it
is the oracle: our quantizer's bytes must decode through it to within a bounded error, our
scale/min packing must agree with its unpacking, and every torch dequantizer we ship (the
format module's and the GEMV baseline's) must reproduce it to the bit.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import Q4_K, dequantize  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"loom_q4k_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fmt = load(KERNELS / "q4k" / "format.py")


def gguf_dequantize(packed) -> np.ndarray:
    data = packed.numpy() if isinstance(packed, torch.Tensor) else packed
    return dequantize(data, GGMLQuantizationType.Q4_K)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise float32 equality (NaN payloads and signed zeros included)."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def fp16_half_ulp(values: np.ndarray) -> np.ndarray:
    """Half the fp16 spacing at each |value|: the most that storing it as fp16 moves it."""
    values = np.abs(np.asarray(values, dtype=np.float64))
    exponent = np.floor(np.log2(np.maximum(values, 2.0**-14)))  # subnormals: fixed 2^-24 spacing
    return 2.0 ** (exponent - 11)


def make_block(d: float, dmin: float, scales, mins, codes) -> np.ndarray:
    """One 144-byte block from its fields; codes are 256 values 0..15 in weight order."""
    codes = np.asarray(codes, dtype=np.uint8).reshape(8, 32)
    block = np.empty(fmt.BLOCK_BYTES, dtype=np.uint8)
    block[0:2] = np.array([d], dtype=np.float16).view(np.uint8)
    block[2:4] = np.array([dmin], dtype=np.float16).view(np.uint8)
    block[4:16] = fmt.pack_scales_mins(np.asarray(scales), np.asarray(mins))
    block[16:] = (codes[0::2] | (codes[1::2] << 4)).reshape(128)
    return block[None, :]


def spec_dequantize(block: np.ndarray) -> np.ndarray:
    """Weights of one block straight from the format description, one element at a time."""
    b = block.reshape(-1)
    d = float(b[0:2].view(np.float16)[0])
    dmin = float(b[2:4].view(np.float16)[0])
    s = [int(v) for v in b[4:16]]
    out = np.empty(256, dtype=np.float64)
    for e in range(256):
        j = e // 32
        if j < 4:
            sc, m = s[j] & 63, s[j + 4] & 63
        else:
            sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
        chunk, within = divmod(e, 64)
        byte = int(b[16 + chunk * 32 + within % 32])
        q = byte >> 4 if within >= 32 else byte & 0xF
        out[e] = d * sc * q - dmin * m
    return out


# ---------------------------------------------------------------- layout


def test_block_geometry_matches_gguf():
    assert GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K] == (fmt.QK_K, fmt.BLOCK_BYTES) == (256, 144)
    assert Q4_K.K_SCALE_SIZE == fmt.SCALES_BYTES == 12


def test_scale_min_packing_round_trips_every_value_in_every_sub_block():
    # Every 6-bit value at every position (sub-blocks 4-7 split across three bytes), both fields.
    values = np.arange(64, dtype=np.uint8)
    for j in range(8):
        scales = np.zeros((64, 8), dtype=np.uint8)
        mins = np.full((64, 8), 63, dtype=np.uint8)
        scales[:, j] = values
        mins[:, j] = values[::-1]
        packed = fmt.pack_scales_mins(scales, mins)
        ours = fmt.unpack_scales_mins(packed)
        theirs = Q4_K.get_scale_min(packed)
        for got in (ours, theirs):
            assert np.array_equal(got[0], scales) and np.array_equal(got[1], mins), j


def test_scale_min_packing_known_bytes():
    # All 63 packs to all 0xFF; for sub-blocks 4-7 the top bits land in bytes 0-7.
    assert (fmt.pack_scales_mins(np.full(8, 63), np.full(8, 63)) == 0xFF).all()
    scales = np.array([1, 2, 3, 4, 0b110101, 0, 0, 0])
    mins = np.array([5, 6, 7, 8, 0b100110, 0, 0, 0])
    packed = fmt.pack_scales_mins(scales, mins)
    assert packed[0] == 1 | (0b11 << 6)  # sc[0], then sc[4]'s top two bits
    assert packed[4] == 5 | (0b10 << 6)  # m[0], then m[4]'s top two bits
    assert packed[8] == 0b0101 | (0b0110 << 4)  # sc[4] and m[4] low nibbles
    assert list(packed[[1, 2, 3, 5, 6, 7]]) == [2, 3, 4, 6, 7, 8]


def test_scales_above_six_bits_are_refused():
    with pytest.raises(ValueError):
        fmt.pack_scales_mins(np.full(8, 64), np.zeros(8))


def test_code_order_and_nibbles_match_the_spec():
    # Low nibbles of chunk c are weights 64c..64c+31, high nibbles 64c+32..64c+63.
    rng = np.random.default_rng(1)
    block = rng.integers(0, 256, (1, 144), dtype=np.uint8)
    block[0, 0:4] = np.array([0.5, 0.25], dtype=np.float16).view(np.uint8)
    expected = spec_dequantize(block)
    assert np.array_equal(gguf_dequantize(block).reshape(-1).astype(np.float64), expected)
    assert np.array_equal(
        fmt.dequantize_q4_k(torch.from_numpy(block)).numpy().reshape(-1), expected
    )


# ---------------------------------------------------------------- edge-case blocks


@pytest.mark.parametrize("code", [0, 15])
def test_extreme_codes(code):
    scales, mins = np.arange(8) * 9, 63 - np.arange(8) * 9  # 0..63 and 63..0, both 6-bit ends
    block = make_block(0.125, 0.5, scales, mins, np.full(256, code))
    expected = np.repeat(0.125 * scales * code - 0.5 * mins, 32).astype(np.float32)
    assert same_bits(gguf_dequantize(block).reshape(-1), expected)
    assert same_bits(fmt.dequantize_q4_k(torch.from_numpy(block)).numpy().reshape(-1), expected)


@pytest.mark.parametrize("d,dmin", [(-0.25, 0.5), (0.25, -0.5), (-0.25, -0.5), (-0.0, 0.0)])
def test_signed_d_and_dmin(d, dmin):
    # llama.cpp never writes negative d/dmin, but the format allows them: decode them anyway.
    rng = np.random.default_rng(2)
    block = make_block(
        d, dmin, rng.integers(0, 64, 8), rng.integers(0, 64, 8), rng.integers(0, 16, 256)
    )
    assert same_bits(fmt.dequantize_q4_k(torch.from_numpy(block)).numpy(), gguf_dequantize(block))
    assert np.array_equal(
        gguf_dequantize(block).reshape(-1), spec_dequantize(block).astype(np.float32)
    )


def test_zero_blocks_quantize_to_zero_bytes_and_decode_to_zero():
    packed = fmt.quantize_q4_k(np.zeros((2, 512), dtype=np.float32))
    assert not packed.any()
    assert same_bits(gguf_dequantize(packed), np.zeros((2, 512), dtype=np.float32))


@pytest.mark.parametrize("value", [0.37, -0.37, 1e-3, -2.0])
def test_constant_blocks(value):
    weights = np.full((1, 256), value, dtype=np.float32)
    packed = fmt.quantize_q4_k(weights)
    decoded = gguf_dequantize(packed)
    # A constant is either the top code of a [0, value] range (15 * 63 * d) or the min offset
    # (63 * dmin): exact up to the fp16 rounding of d or dmin (subnormal below 6.1e-5).
    d, dmin = (float(packed[0, i : i + 2].view(np.float16)[0]) for i in (0, 2))
    bound = 15 * 63 * fp16_half_ulp(abs(value) / 945) + 63 * fp16_half_ulp(abs(value) / 63)
    assert np.abs(decoded - weights).max() <= bound
    assert (d > 0) == (value > 0) and dmin >= 0 and not np.signbit(dmin)


# ---------------------------------------------------------------- the quantizer


def weights_for(kind: str, rng: np.random.Generator) -> np.ndarray:
    shape = (64, 1024)
    return {
        "normal": 0.02 * rng.standard_normal(shape),  # Llama-like
        "student_t3": 0.02 * rng.standard_t(3, shape),  # heavy tails: outliers set d
        "positive": np.abs(rng.standard_normal(shape)),  # min clamps at 0
        "negative": -1.0 - np.abs(rng.standard_normal(shape)),  # all-negative sub-blocks
        "large": 1000.0 * rng.standard_normal(shape),
    }[kind].astype(np.float32)


@pytest.mark.parametrize("kind", ["normal", "student_t3", "positive", "negative", "large"])
def test_quantizer_round_trip_error_is_bounded(kind):
    weights = weights_for(kind, np.random.default_rng(3))
    packed = fmt.quantize_q4_k(weights)
    assert packed.shape == (64, 1024 // 256 * 144) and packed.dtype == np.uint8
    decoded = gguf_dequantize(packed)
    # Per block: each weight lies within half of the block's widest step, (max - min) / 15 / 2,
    # plus what the fp16 rounding of d (times at most 15 * 63) and dmin (times 63) moves it.
    blocks = packed.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16)
    dmin = blocks[:, 2:4].copy().view(np.float16)
    sub = weights.reshape(-1, 8, 32)
    widest_step = ((sub.max(-1) - np.minimum(sub.min(-1), 0)) / 15).max(-1, keepdims=True)
    bound = 0.5 * widest_step + 15 * 63 * fp16_half_ulp(d) + 63 * fp16_half_ulp(dmin)
    error = np.abs(decoded - weights).reshape(-1, 256).max(-1, keepdims=True)
    assert (error <= bound).all(), float((error / bound).max())


def test_quantizer_error_on_llama_like_weights():
    weights = weights_for("normal", np.random.default_rng(4))
    decoded = gguf_dequantize(fmt.quantize_q4_k(weights))
    rel_rmse = np.sqrt(np.mean((decoded - weights) ** 2) / np.mean(weights**2))
    # 4.5 bits per weight: llama.cpp's searched scales reach ~0.071 here, min/max ones ~0.079.
    assert 0.05 < rel_rmse < 0.09


def test_quantizer_refuses_partial_blocks_and_non_finite_weights():
    with pytest.raises(ValueError):
        fmt.quantize_q4_k(np.zeros((1, 300), dtype=np.float32))
    with pytest.raises(ValueError):
        fmt.quantize_q4_k(np.full((1, 256), np.inf, dtype=np.float32))


def test_quantizer_uses_every_code_and_both_scale_halves():
    packed = fmt.quantize_q4_k(weights_for("normal", np.random.default_rng(5))).reshape(-1, 144)
    codes = np.concatenate([packed[:, 16:] & 0x0F, packed[:, 16:] >> 4])
    assert set(np.unique(codes)) == set(range(16))
    scales, mins = fmt.unpack_scales_mins(packed[:, 4:16])
    assert scales.max() == 63 and mins.max() == 63  # the widest sub-block sets d and dmin
    assert (scales[:, 4:] >= 16).any()  # high bits of sub-blocks 4-7 are exercised


# ---------------------------------------------------------------- random blocks, dequantizers


def test_random_blocks_are_valid_and_reproducible():
    generator = torch.Generator().manual_seed(6)
    packed = fmt.random_q4_k(8, 512, generator=generator)
    assert packed.shape == (8, 2 * 144) and packed.dtype == torch.uint8
    decoded = gguf_dequantize(packed)
    assert np.isfinite(decoded).all() and 0.005 < np.abs(decoded).mean() < 0.05
    again = fmt.random_q4_k(8, 512, generator=torch.Generator().manual_seed(6))
    assert torch.equal(packed, again)


def test_task_generator_is_the_format_generator():
    # The GEMV task carries its own copy (task files stand alone); it must not drift.
    task = load(KERNELS / "q4k_gemv" / "task.py")
    torch.manual_seed(7)
    from_task = task.random_q4_k(16, 768)
    torch.manual_seed(7)
    assert torch.equal(from_task, fmt.random_q4_k(16, 768))


@pytest.mark.parametrize("signed", [False, True])
def test_torch_dequantizers_match_gguf_bit_for_bit(signed):
    packed = fmt.random_q4_k(64, 1024, signed=signed, generator=torch.Generator().manual_seed(8))
    reference = gguf_dequantize(packed)
    baseline = load(KERNELS / "q4k_gemv" / "baseline.py")
    gemv = load(KERNELS / "q4k_gemv" / "q4k_gemv.py")
    for dequantize_q4_k in (
        fmt.dequantize_q4_k,
        baseline.dequantize_q4_k,
        gemv._dequantize_q4_k,
    ):
        assert same_bits(dequantize_q4_k(packed).numpy(), reference)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf * 0 in gguf's numpy
def test_torch_dequantizer_matches_gguf_on_arbitrary_bytes():
    # Any 144 bytes are a block: d/dmin may be subnormal, infinite or NaN; decode them the same.
    packed = torch.randint(
        0, 256, (32, 4 * 144), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)
    )
    assert same_bits(fmt.dequantize_q4_k(packed).numpy(), gguf_dequantize(packed))


# ---------------------------------------------------------------- GEMV variants
# The Q4_K GEMV's alternative tilings and its TF32 tensor-core variant: correct under Triton's
# interpreter (each kernel module's own self-check) and lowered to Hopper wgmma without spills.
# Which one is fastest is for `kernels/tools/sweep_q4k.py` on a GPU; these tests keep every
# variant the sweep can pick honest here.

# These tests need triton (the rest of this file does not): skipped one by one where it is missing.
try:
    import triton
except ImportError:
    triton = None
requires_triton = pytest.mark.skipif(triton is None, reason="could not import 'triton'")


@requires_triton
@pytest.mark.parametrize("task", ["q4k_gemv", "q4k_gemm"])
@pytest.mark.slow
def test_kernel_self_check_under_the_interpreter(task):
    """The module's __main__ compares every configuration it lists with a float64 product."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(KERNELS / task / f"{task}.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "(triton path on cpu): ok" in run.stdout


@requires_triton
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning")
def test_tensor_core_variant_lowers_to_wgmma_without_spills(tmp_path):
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in backends:
        pytest.skip("this triton build has no nvidia backend")
    spec = importlib.util.spec_from_file_location(
        "q4k_gemv_variants", KERNELS / "q4k_gemv" / "q4k_gemv_triton.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = {
        "x_ptr": "*bf16",
        "w_ptr": "*i32",
        "out_ptr": "*bf16",
        "batch": "i32",
        "n_rows": "i32",
        "n_blocks": "i32",
        "w_row_words": "i32",
        "x_row_stride": "i32",
        "out_row_stride": "i32",
        "BLOCK_N": "constexpr",
        "BLOCK_KB": "constexpr",
        "BLOCK_B": "constexpr",
    }
    names = list(signature)
    aligned = [
        "x_ptr",
        "w_ptr",
        "out_ptr",
        "n_rows",
        "n_blocks",
        "w_row_words",
        "x_row_stride",
        "out_row_stride",
    ]
    source = ASTSource(
        fn=module.q4k_gemv_mma_kernel,
        signature=signature,
        constexprs={"BLOCK_N": 64, "BLOCK_KB": 4, "BLOCK_B": 16},
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ".tf32" in ptx  # the tensor cores do the products
    (tmp_path / "k.ptx").write_text(ptx)
    log = subprocess.run(
        [
            triton.knobs.nvidia.ptxas_blackwell.path,
            "-arch=sm_90a",
            "-v",
            str(tmp_path / "k.ptx"),
            "-o",
            str(tmp_path / "k.cubin"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    assert spills == 0, log
