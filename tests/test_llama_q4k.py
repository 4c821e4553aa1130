"""The Llama Q4_K model (kernels/llama_q4k) on the CPU.

Covered here: a tiny GGUF file written with GGUFWriter (Q4_K linears from kernels/q4k/format.py's
quantizer, F32 norms, F16 embeddings) and read back; the model's logits against the fp32
reference on the same dequantized weights; the KV cache (decode at position t gives the prefill's
logits at t); and the benchmark command's JSON.

Most tests take the kernels' torch paths (plain CPU tensors). One runs the Triton kernels
under the interpreter. TRITON_INTERPRET=1 has to be set before triton is imported, so that
test runs this file as a script in a child process, as tests/test_kernels.py does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from kernels.llama_q4k.generate import DecodeStep, generate  # noqa: E402
from kernels.llama_q4k.model import (  # noqa: E402
    CONFIGS,
    TORCH_OPS,
    ConcatLinear,
    DenseLinear,
    ModelArgs,
    Transformer,
    reference_logits,
)
from kernels.llama_q4k.weights import (  # noqa: E402
    load_gguf,
    random_weights,
    tensor_shapes,
    to_gguf_rows,
    write_gguf,
)
from kernels.q4k.format import BLOCK_BYTES, QK_K, quantize_q4_k  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The tiny config (Q4_K rows are whole 256-weight blocks), with a small vocabulary.
ARGS = ModelArgs(
    dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=256, context_length=64
)
# Measured, relative to the largest reference logit (~1.2): 5e-7 on the torch paths, 3e-7 with
# the Triton kernels under the interpreter. The bound leaves 200x margin and stays far below
# the smallest top-1 margin seen (2e-3), so top-1 must agree exactly.
REL_TOL = 1e-4


def float_weights(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """What a checkpoint holds before quantization: Llama-sized matrices, norms near 1."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in tensor_shapes(args).items():
        if name == "token_embd.weight":
            weights[name] = torch.randn(shape, generator=generator).half()
        elif len(shape) == 2:
            matrix = 0.02 * torch.randn(shape, generator=generator)
            weights[name] = torch.from_numpy(quantize_q4_k(matrix.numpy()))
        else:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return weights


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("llama_q4k") / "tiny.gguf"
    weights = float_weights(ARGS)
    write_gguf(path, ARGS, weights)
    return path, weights


@pytest.fixture(scope="module")
def loaded(written) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    args, weights, _ = load_gguf(written[0])
    return args, weights


def build(args: ModelArgs, weights: dict[str, torch.Tensor], batch: int, max_seq: int, **kw):
    model = Transformer(args, weights, **kw)
    model.setup_caches(batch, max_seq)
    return model


# ---------------------------------------------------------------- GGUF


def test_gguf_stores_q4k_packed_in_its_own_dim_order(written):
    path, weights = written
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(weights)
    down = tensors["blk.0.ffn_down.weight"]  # [dim, ffn_dim] = [256, 512]
    assert down.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert list(down.shape) == [ARGS.ffn_dim, ARGS.dim]  # GGML order: columns first
    assert down.data.dtype == "uint8"
    assert down.data.shape == (ARGS.dim, ARGS.ffn_dim // QK_K * BLOCK_BYTES)  # packed rows
    assert torch.equal(torch.from_numpy(down.data.copy()), weights["blk.0.ffn_down.weight"])
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    # q and k are stored in llama.cpp's rope order (the converter's permutation), not ours.
    q = tensors["blk.1.attn_q.weight"]
    expected = to_gguf_rows(weights["blk.1.attn_q.weight"], ARGS.n_heads)
    assert torch.equal(torch.from_numpy(q.data.copy()), expected)
    assert not torch.equal(expected, weights["blk.1.attn_q.weight"])


def test_gguf_row_permutation_is_llama_cpps():
    """GGUF row h*D + 2i + j holds Hugging Face row h*D + j*D/2 + i (head h, pair i, half j)."""
    heads, head_dim = 3, 8
    hf_rows = torch.arange(heads * head_dim)[:, None]
    gguf_rows = to_gguf_rows(hf_rows, heads)[:, 0]
    for h in range(heads):
        for i in range(head_dim // 2):
            for j in range(2):
                expected = h * head_dim + j * head_dim // 2 + i
                assert gguf_rows[h * head_dim + 2 * i + j] == expected


def test_load_gguf_round_trip(written):
    path, weights = written
    args, loaded, types = load_gguf(path)
    assert args.norm_eps == pytest.approx(ARGS.norm_eps)  # stored as float32
    assert dataclasses.replace(args, norm_eps=ARGS.norm_eps) == ARGS
    assert set(loaded) == set(weights)
    for name, weight in weights.items():
        if weight.dtype == torch.uint8:
            assert types[name] == "Q4_K" and loaded[name].dtype == torch.uint8, name
            assert torch.equal(loaded[name], weight), name  # q/k rows back in our order
        else:
            assert loaded[name].dtype == torch.float32, name
            assert torch.equal(loaded[name], weight.float()), name
    assert types["token_embd.weight"] == "F16" and types["output_norm.weight"] == "F32"


def test_other_quant_types_are_dequantized_at_load(tmp_path):
    """Q4_K_M files keep some attn_v and ffn_down tensors at Q6_K, which gguf-py can read but
    not write; Q8_0 stands in. Those load as fp32 and the model runs them as dense matrices."""
    mixed = ("blk.0.attn_v.weight", "blk.1.ffn_down.weight")
    weights = float_weights(ARGS)
    generator = torch.Generator().manual_seed(6)
    for name in mixed:
        matrix = 0.02 * torch.randn(tensor_shapes(ARGS)[name], generator=generator)
        weights[name] = torch.from_numpy(quantize(matrix.numpy(), GGMLQuantizationType.Q8_0))
    path = tmp_path / "mixed.gguf"
    write_gguf(path, ARGS, weights, {name: GGMLQuantizationType.Q8_0 for name in mixed})

    args, loaded, types = load_gguf(path)
    for name in mixed:
        assert types[name] == "Q8_0" and loaded[name].dtype == torch.float32
        expected = dequantize(weights[name].numpy(), GGMLQuantizationType.Q8_0)
        assert torch.equal(loaded[name], torch.from_numpy(expected))
    model = build(args, loaded, 1, 10)
    wqkv = model.layers[0].attention.wqkv
    assert isinstance(wqkv, ConcatLinear)  # Q4_K q, k + dense v
    # the parts run one after another: only q follows the norm (the GEMV's ring depth)
    assert [getattr(part, "follows_small_kernel", None) for part in wqkv.parts] == [True, False, None]
    assert isinstance(model.layers[1].feed_forward.w_down, DenseLinear)
    assert model.layers[0].feed_forward.w_down.follows_small_kernel  # after SwiGLU
    tokens = torch.randint(0, args.vocab_size, (1, 10), generator=generator)
    with torch.inference_mode():
        logits = model(tokens, torch.arange(10))
    expected = reference_logits(args, loaded, tokens)
    assert max_rel_diff(logits, expected) < REL_TOL
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------- logits


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_logits_match_float_reference(loaded):
    args, weights = loaded
    prompt = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    steps = 6
    model = build(args, weights, batch=2, max_seq=12 + steps)
    run = generate(model, DecodeStep(model, 2, use_graph=False), prompt, steps, keep_logits=True)
    sequence = torch.cat([prompt, run.tokens[:, :-1]], dim=1)
    expected = reference_logits(args, weights, sequence)
    assert run.logits.shape == expected.shape == (2, 12 + steps, args.vocab_size)
    assert max_rel_diff(run.logits, expected) < REL_TOL
    assert torch.equal(run.logits.argmax(-1), expected.argmax(-1))


def test_plain_torch_model_matches_reference(loaded):
    """The bf16 baseline's model (dequantized weights, torch ops), run in fp32 here."""
    args, weights = loaded
    tokens = torch.randint(0, args.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    dense = build(args, weights, 1, 10, ops=TORCH_OPS, dequantize=True)
    logits = dense(tokens, torch.arange(10))
    assert max_rel_diff(logits, reference_logits(args, weights, tokens)) < REL_TOL


def test_kv_cache_decode_equals_prefill(loaded):
    args, weights = loaded
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, args.vocab_size, (1, 16), generator=generator)
    model = build(args, weights, 1, 16)
    decode = DecodeStep(model, 1, use_graph=False)
    with torch.inference_mode():
        full = model(tokens, torch.arange(16))
        # Fill the cache with another sequence first: stale keys must stay masked.
        model(torch.randint(0, args.vocab_size, (1, 16), generator=generator), torch.arange(16))
        prefix = model(tokens[:, :6], torch.arange(6))
        decoded = [decode(tokens[:, t : t + 1], t).clone() for t in range(6, 16)]
    torch.testing.assert_close(prefix, full[:, :6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(decoded, dim=1), full[:, 6:], atol=1e-5, rtol=1e-5)


def test_batch_rows_decode_independently(loaded):
    args, weights = loaded
    prompts = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    model = build(args, weights, 2, 12)
    both = generate(model, DecodeStep(model, 2, False), prompts, 4, keep_logits=True)
    for row in range(2):
        alone = build(args, weights, 1, 12)
        single = generate(alone, DecodeStep(alone, 1, False), prompts[row : row + 1], 4, True)
        assert torch.equal(single.tokens, both.tokens[row : row + 1])
        torch.testing.assert_close(single.logits, both.logits[row : row + 1], atol=1e-5, rtol=0)


def interpreted_check(path: str) -> dict:
    """Prefill and decode through the Triton kernels (this process has TRITON_INTERPRET=1)."""
    args, weights, _ = load_gguf(path)
    prompt = torch.randint(0, args.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    model = build(args, weights, 1, 8)
    run = generate(model, DecodeStep(model, 1, use_graph=False), prompt, 2, keep_logits=True)
    expected = reference_logits(args, weights, torch.cat([prompt, run.tokens[:, :-1]], dim=1))
    return {
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "max_rel_diff": max_rel_diff(run.logits, expected),
        "top1_equal": torch.equal(run.logits.argmax(-1), expected.argmax(-1)),
    }


def test_triton_kernels_under_interpreter_match_reference(written):
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, __file__, str(written[0])],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["triton_interpret"] == "1"
    assert report["top1_equal"]
    assert report["max_rel_diff"] < REL_TOL


# ---------------------------------------------------------------- the benchmark command

BENCH_FIELDS = {
    "ttft_ms",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "per_token_latency_ms_p50",
    "per_token_latency_ms_p95",
    "peak_device_memory_bytes",
    "peak_memory_source",
    "max_abs_diff",
    "max_abs_logit",
    "top1_agreement",
    "bf16_prefill_ms",
    "bf16_prefill_tokens_per_s",
    "prefill_ms",
    "bf16_prefill_spread_ms",
    "prefill_speedup_vs_bf16",
    "bf16_torch_vs_reference",
    "graph_capture",
    "decode_trace",
    "kernel_path",
    "device",
    "torch",
    "triton",
    "tensor_types",
    "dequantized_at_load",
    "copy_bandwidth_bytes_per_s",
    "decode_step_bytes",
    "decode_ceiling_tokens_per_s",
    "decode_fraction_of_ceiling",
}


@pytest.mark.parametrize("source", ["random", "gguf"])
def test_bench_prints_one_json_line(source, written):
    weights = ["--random-config", "tiny"] if source == "random" else ["--gguf", str(written[0])]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-m", "kernels.llama_q4k.bench", *weights]
        + ["--prompt-len", "16", "--gen", "4", "--batch", "2", "--runs", "2", "--device", "cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert BENCH_FIELDS <= set(result)
    for field in BENCH_FIELDS - {"peak_memory_source", "graph_capture", "kernel_path", "device"}:
        if field != "decode_trace":  # only with --trace
            assert result[field] is not None, field
    assert result["decode_trace"] is None
    for field in ("ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "bf16_prefill_ms"):
        assert result[field] > 0, field
    assert result["per_token_latency_ms_p50"] <= result["per_token_latency_ms_p95"]
    for spread in (result["prefill_ms"], result["bf16_prefill_spread_ms"]):
        assert 0 < spread["p10"] <= spread["median"] <= spread["p90"] and spread["n"] == 10
    assert result["bf16_prefill_spread_ms"]["median"] == result["bf16_prefill_ms"]
    assert result["prefill_speedup_vs_bf16"] == pytest.approx(
        result["bf16_prefill_ms"] / result["prefill_ms"]["median"]
    )
    # The control: bf16 PyTorch on the same tokens agrees with the fp32 reference on this tiny
    # model too, and is less exact than the fp32 run above.
    control = result["bf16_torch_vs_reference"]
    assert control["top1_agreement"] > 0.9
    assert result["max_abs_diff"] < control["max_abs_diff"] < 0.1 * result["max_abs_logit"]
    assert result["peak_memory_source"] == "cpu_peak_rss"
    assert result["peak_device_memory_bytes"] > 0
    assert result["graph_capture"] is False and result["kernel_path"] == "torch-fallback"
    assert result["top1_agreement"] == 1.0
    assert result["max_abs_diff"] < REL_TOL * result["max_abs_logit"]
    # The ceiling's denominator: the random tiny model's bytes, counted independently here.
    if source == "random":
        tiny = CONFIGS["tiny"]
        weights = random_weights(tiny)
        table = weights["token_embd.weight"]
        others = sum(
            w.numel() * w.element_size() for n, w in weights.items() if n != "token_embd.weight"
        )
        per_step = result["decode_step_bytes"]
        rope = tiny.head_dim // 2 * 4  # inv_freq, fp32, one tensor shared by the layers
        assert per_step["weights"] == others + 2 * table[0].numel() + rope
        kv = 2 * tiny.n_layers * 2 * tiny.n_kv_heads * (16 + 4) * tiny.head_dim * 4  # batch 2, fp32
        assert per_step["kv_cache"] == kv
        assert result["decode_fraction_of_ceiling"] == pytest.approx(
            result["decode_tokens_per_s"] / result["decode_ceiling_tokens_per_s"]
        )
    if source == "gguf":
        assert result["dequantized_at_load"] == {"F32": 5, "F16": 1}
        assert result["tensor_types"]["Q4_K"] == 7 * ARGS.n_layers + 1



# ---------------------------------------------------------------- the fused residual add + norm

ADD_NORM_CHECK = r"""
import json, torch
from kernels.llama_q4k.add_rmsnorm import add_rms_norm, torch_add_rms_norm
torch.manual_seed(0)
report = []
for rows, hidden, dtype in [(1, 4096, torch.bfloat16), (7, 300, torch.float16), (2, 96, torch.float32),
                            (3, 257, torch.bfloat16)]:
    x = torch.randn(rows, hidden, dtype=dtype) * 30
    delta = torch.randn(rows, hidden, dtype=dtype)
    weight = 1.0 + 0.1 * torch.randn(hidden)
    got_h, got_y = add_rms_norm(x, delta, weight, 1e-5)
    want_h, want_y = torch_add_rms_norm(x, delta, weight, 1e-5)
    report.append({"shape": [rows, hidden], "dtype": str(dtype), "h_equal": torch.equal(got_h, want_h),
                   "y_max_diff": (got_y.double() - want_y.double()).abs().max().item(),
                   "y_max": want_y.double().abs().max().item()})
print(json.dumps(report))
"""


def test_fused_add_rmsnorm_kernel_matches_the_unfused_pair():
    """Under the interpreter: the stored sum is bit-equal to PyTorch's add (rounded to the
    activation dtype, bf16 rounded to nearest even), and the norm is within an output ulp."""
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", ADD_NORM_CHECK], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    for case in json.loads(child.stdout.strip().splitlines()[-1]):
        assert case["h_equal"], case
        assert case["y_max_diff"] <= 2 ** -7 * case["y_max"], case


ROPE_CACHE_CHECK = r"""
import json, torch
from kernels.rope.rope import torch_rope
from kernels.llama_q4k.rope_cache import rope_cache
torch.manual_seed(0)
report = []
for batch, seq, start, dtype in [(1, 1, 4000, torch.bfloat16), (2, 3, 5, torch.float16), (2, 4, 0, torch.float32)]:
    hq, hkv, d, max_seq = 4, 2, 32, 4096
    fused = torch.randn(batch * seq, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, v = (t.reshape(batch * seq, -1, d) for t in fused.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = torch.arange(start, start + seq).repeat(batch)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    k_cache, v_cache = torch.randn(batch, hkv, max_seq, d, dtype=dtype), torch.randn(batch, hkv, max_seq, d, dtype=dtype)
    plain = (k_cache.clone(), v_cache.clone())
    got_q = rope_cache(positions, q, k, v, inv_freq, k_cache, v_cache)
    want_q = rope_cache(positions, q, k, v, inv_freq, *plain, rope=torch_rope)
    written = torch.zeros(max_seq, dtype=torch.bool)
    written[start:start + seq] = True
    report.append({
        "q_diff": (got_q.double() - want_q.double()).abs().max().item(),
        "k_diff": (k_cache.double() - plain[0].double()).abs().max().item(),
        "v_equal": torch.equal(v_cache, plain[1]),
        "others_untouched": torch.equal(k_cache[:, :, ~written], plain[0][:, :, ~written]),
        "scale": float(q.abs().max()),
    })
print(json.dumps(report))
"""


def test_fused_rope_cache_kernel_writes_the_cache_like_index_copy():
    """Under the interpreter, against plain PyTorch rope + index_copy_: q and the k slots agree
    to rounding, v is copied bit for bit, and no other cache slot changes."""
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", ROPE_CACHE_CHECK], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    for case in json.loads(child.stdout.strip().splitlines()[-1]):
        assert case["v_equal"] and case["others_untouched"], case
        assert case["q_diff"] <= 2 ** -7 * case["scale"] and case["k_diff"] <= 2 ** -7 * case["scale"], case


DECODE_ATTENTION_CHECK = r"""
import json, torch
from kernels.llama_q4k.decode_attention import CHUNK, decode_attention, torch_decode_attention
from kernels.rope.rope import torch_rope
torch.manual_seed(0)
report = []
cases = [(1, 4, 0, 300, torch.bfloat16), (3, 4, CHUNK - 1, 300, torch.bfloat16),
         (2, 4, CHUNK, 300, torch.float16), (1, 1, 299, 300, torch.float32), (2, 2, 150, 2 * CHUNK + 37, torch.bfloat16)]
for batch, group, position, max_seq, dtype in cases:
    kv_heads, d = 2, 64
    q_heads = kv_heads * group
    fused = torch.randn(batch, (q_heads + 2 * kv_heads) * d, dtype=dtype)
    q, k, v = (t.reshape(batch, -1, d) for t in fused.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1))
    caches = [torch.randn(batch, kv_heads, max_seq, d, dtype=dtype) for _ in range(2)]
    for cache in caches:  # what an earlier, longer sequence left, huge: it must stay masked
        cache[:, :, position + 1:] = 1e4
    plain = [cache.clone() for cache in caches]
    # the kernel must not even read it: infinities there change nothing
    poisoned = [cache.clone().index_fill_(2, torch.arange(position + 1, max_seq), float("inf")) for cache in caches]
    positions = torch.tensor([position])
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    got = decode_attention(positions, q, k, v, inv_freq, *caches)
    got_poisoned = decode_attention(positions, q, k, v, inv_freq, *poisoned)
    want = torch_decode_attention(positions, q, k, v, inv_freq, *plain, rope=torch_rope)
    others = torch.ones(max_seq, dtype=torch.bool)
    others[position] = False
    report.append({
        "case": [batch, group, position, max_seq, str(dtype)],
        "out_diff": (got.double() - want.double()).abs().max().item(),
        "out_scale": want.double().abs().max().item(),
        "finite": bool(torch.isfinite(got).all()),
        "poison_ignored": torch.equal(got, got_poisoned),
        "k_slot_diff": (caches[0][:, :, position].double() - plain[0][:, :, position].double()).abs().max().item(),
        "v_equal": torch.equal(caches[1], plain[1]),
        "others_untouched": torch.equal(caches[0][:, :, others], plain[0][:, :, others]),
    })
# Each row at its own position (requests of a served batch that joined at different times).
batch, kv_heads, q_heads, d, max_seq = 3, 2, 4, 64, 2 * CHUNK + 5
positions = torch.tensor([5, CHUNK + 3, 0])
q, k, v = torch.randn(batch, q_heads, d), torch.randn(batch, kv_heads, d), torch.randn(batch, kv_heads, d)
caches = [torch.randn(batch, kv_heads, max_seq, d) for _ in range(2)]
plain = [cache.clone() for cache in caches]
inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
got = decode_attention(positions, q, k, v, inv_freq, *caches)
want = torch_decode_attention(positions, q, k, v, inv_freq, *plain, rope=torch_rope)
rows_alone = torch.cat([torch_decode_attention(positions[r:r + 1], q[r:r + 1], k[r:r + 1], v[r:r + 1], inv_freq,
                                               plain[0][r:r + 1].clone(), plain[1][r:r + 1].clone(), rope=torch_rope)
                        for r in range(batch)])
report.append({
    "case": "per-row positions",
    "out_diff": (got.double() - want.double()).abs().max().item(),
    "alone_diff": (want.double() - rows_alone.double()).abs().max().item(),
    "out_scale": want.double().abs().max().item(),
    "finite": bool(torch.isfinite(got).all()),
    "k_slot_diff": max((caches[0][r, :, p] - plain[0][r, :, p]).abs().max().item() for r, p in enumerate(positions.tolist())),
    "v_equal": torch.equal(caches[1], plain[1]),
})
print(json.dumps(report))
"""


def test_decode_attention_kernels_match_rope_cache_and_sdpa():
    """Under the interpreter, against the torch path (rope, index_copy_, SDPA with a position
    mask): GQA groups of 4, 2 and 1, batch rows, positions at split edges, and stale infinities
    past the position that a correct kernel never reads."""
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", DECODE_ATTENTION_CHECK], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    per_row = report.pop()
    assert per_row["finite"] and per_row["v_equal"], per_row
    assert per_row["out_diff"] <= 1e-5 * per_row["out_scale"] and per_row["alone_diff"] <= 1e-6, per_row
    assert per_row["k_slot_diff"] <= 1e-5, per_row
    for case in report:
        assert case["finite"] and case["poison_ignored"], case
        assert case["v_equal"] and case["others_untouched"], case
        assert case["k_slot_diff"] <= 2 ** -7 * 4, case
        # probabilities are rounded to the activation dtype before the product with V
        assert case["out_diff"] <= 2 ** -6 * case["out_scale"], case


def test_bench_writes_a_decode_trace_our_analyzer_reads(tmp_path):
    """--trace: a Kineto trace of eager decode steps, which loom's own trace analysis parses."""
    from loom_mcp.traces.analysis import analyze

    trace = tmp_path / "decode.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-m", "kernels.llama_q4k.bench", "--random-config", "tiny", "--prompt-len",
         "8", "--gen", "0", "--runs", "1", "--prefill-runs", "1", "--reference", "none",
         "--device", "cpu", "--trace", str(trace)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.strip().splitlines()[-1])["decode_trace"] == str(trace)
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert any(name and name.startswith("aten::_scaled_dot_product") for name in names)
    assert analyze(trace).source_format == "kineto"


if __name__ == "__main__":
    print(json.dumps(interpreted_check(sys.argv[1])))


def test_decode_attention_probe_describes_itself():
    """kernels/tools/probe_decode_attention.py (gpu_session.sh `attention`) starts without a GPU."""
    child = subprocess.run([sys.executable, str(REPO / "kernels" / "tools" / "probe_decode_attention.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert "decode attention" in child.stdout and "--replays" in child.stdout
