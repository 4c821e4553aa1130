"""Text in, text out of a GGUF model program (kernels/llama_q4k: tokenizer, chat, sampling).

A tiny llama is written by our writer around a real vocabulary (tests/fixtures/gguf: Phi-3's
SentencePiece vocabulary and chat template, as llama.cpp ships it), then read back as text:
the tokenizer and template from the file alone, prompts in and replies out, and the logits
checked against an independent implementation, transformers loading the same GGUF (it
dequantizes the Q4_K tensors itself and undoes llama.cpp's q/k row order its own way).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
from kernels.llama_q4k.chat import TextModel  # noqa: E402
from kernels.llama_q4k.model import TORCH_OPS, Transformer, reference_logits  # noqa: E402
from kernels.llama_q4k.sampling import SamplingParams, filter_logits, next_token, penalize  # noqa: E402
from kernels.llama_q4k.tokenizer import GGUFTokenizer  # noqa: E402
from kernels.llama_q4k.weights import build_model, load_gguf, write_tiny_model  # noqa: E402

VOCAB = Path(__file__).parent / "fixtures" / "gguf" / "ggml-vocab-phi-3.gguf"


def needs_transformers() -> None:
    """The tokenizer and the independent logits need transformers; the GPU kernels' check not."""
    pytest.importorskip("transformers")


def write_tiny(path: Path, arch: str = "llama") -> Path:
    """A tiny model of `arch` with Q4_K matrices and the real vocabulary: what an agent's own
    tests write."""
    return write_tiny_model(path, arch, VOCAB)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("text") / "tiny-phi3-vocab.gguf")


def test_the_tokenizer_comes_from_the_files_own_vocabulary(model_file: Path) -> None:
    needs_transformers()
    tok = GGUFTokenizer(model_file)
    assert tok.vocab_size == 32064
    ids = tok.encode("Hello world, 1234 ünïcode!")
    assert ids[0] == 1  # add_bos_token is true in the file
    assert tok.decode(ids) == "Hello world, 1234 ünïcode!"
    # Text a user typed that looks like a special token stays text; a rendered template's is the token.
    assert 32010 not in tok.encode("<|user|>")  # <|user|> is id 32010 in Phi-3's vocabulary
    assert tok.encode("<|user|>", special_text=True)[1] == 32010
    assert {32000, 32007} <= tok.stop_ids()  # <|endoftext|> (the EOS) and <|end|>


def test_the_chat_template_is_the_files_and_renders_with_jinja(model_file: Path) -> None:
    needs_transformers()
    tok = GGUFTokenizer(model_file)
    prompt = tok.chat([{"role": "user", "content": "Hi there"}])
    assert prompt.startswith("<s>") and "<|user|>\nHi there<|end|>\n<|assistant|>\n" in prompt
    ids = tok.encode(prompt, special_text=True)
    assert ids.count(1) == 1  # the template's BOS, not a second one


def test_sampling_filters_and_penalty() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert next_token(logits, SamplingParams()).item() == 0
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]
    # top-p 0.7: token 0 has p = 0.64, so token 1 is needed to reach 0.7, token 2 is not.
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]
    # min-p 0.3: p(token) >= 0.3 * p(top): exp(-1) = 0.37 passes, exp(-2) = 0.14 does not.
    kept = filter_logits(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]
    penalized = penalize(torch.tensor([[2.0, -2.0, 1.0]]), torch.tensor([[0, 1]]), 2.0)
    assert penalized.tolist() == [[1.0, -4.0, 1.0]]
    assert next_token(torch.tensor([[2.0, 1.5]]), SamplingParams(repetition_penalty=2.0), None,
                      torch.tensor([[0]])).item() == 1


def test_a_seed_gives_the_same_draws_and_another_seed_other_ones() -> None:
    logits = torch.zeros(1, 1000)

    def draws(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        from kernels.llama_q4k.sampling import make_generator
        generator = make_generator(params, torch.device("cpu"))
        return [int(next_token(logits, params, generator).item()) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_text_in_text_out_stops_and_is_reproducible(model_file: Path) -> None:
    needs_transformers()
    model = TextModel(str(model_file), "cpu", max_seq=128)
    greedy = model.chat([{"role": "user", "content": "Say something."}], max_new_tokens=12)
    again = model.chat([{"role": "user", "content": "Say something."}], max_new_tokens=12)
    assert greedy.tokens == again.tokens and len(greedy.tokens) >= 1
    assert greedy.text == model.tokenizer.decode(greedy.tokens)
    sampled = model.complete("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, seed=3), 12)
    assert sampled.tokens == model.complete("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, seed=3),
                                            12).tokens
    # The first greedy token made a stop token: nothing is generated and the reply says why.
    first = greedy.tokens[0]
    stopped = list(model.stream(model.tokenizer.encode(model.tokenizer.chat(
        [{"role": "user", "content": "Say something."}]), special_text=True), SamplingParams(), 12, stop={first}))
    assert stopped == []


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_logits_match_transformers_loading_the_same_file(tmp_path: Path, arch: str) -> None:
    """An independent reading of the same GGUF: transformers dequantizes it and runs its own
    model of the family. Top-1 must agree at every position; the differences are reported."""
    needs_transformers()
    from transformers import AutoModelForCausalLM

    model_file = write_tiny(tmp_path / f"tiny-{arch}.gguf", arch)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=model_file.name, dtype=torch.float32)
    hf.eval()
    assert type(hf).__name__.lower().startswith(arch), type(hf).__name__
    tok = GGUFTokenizer(model_file)
    prompts = ["The quick brown fox jumps over the lazy dog.", "def main():\n    return 42",
               "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich."]
    args, weights, _ = load_gguf(model_file)
    assert args.arch == arch and args.qkv_bias == (arch == "qwen2") and args.qk_norm == (arch in ("qwen3", "gemma3"))
    ours = build_model(args, weights, ops=TORCH_OPS)
    agree = total = 0
    worst = 0.0
    for text in prompts:
        ids = torch.tensor([tok.encode(text)])
        ours.setup_caches(1, ids.shape[1])
        with torch.no_grad():
            mine = ours(ids, torch.arange(ids.shape[1]))[0]
            theirs = hf(ids).logits[0]
        scale = theirs.abs().max().item()
        worst = max(worst, (mine - theirs).abs().max().item() / scale)
        agree += int((mine.argmax(-1) == theirs.argmax(-1)).sum())
        total += ids.shape[1]
    print(f"{arch}: top-1 {agree}/{total}, worst logit difference {worst:.2e} of the largest")
    assert agree == total, f"top-1 agrees at {agree} of {total} positions; worst relative diff {worst:.2e}"
    assert worst < 1e-3, f"worst logit difference {worst:.2e} of the largest logit"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_each_family_matches_the_float_reference_and_decodes_like_prefill(tmp_path: Path, arch: str) -> None:
    args, weights, _ = load_gguf(write_tiny(tmp_path / f"{arch}.gguf", arch))
    tokens = torch.tensor([[1, 450, 4996, 17354, 1701, 29916, 432, 17204]])
    expected = reference_logits(args, weights, tokens)
    model = Transformer(args, weights, ops=TORCH_OPS)
    model.setup_caches(1, tokens.shape[1])
    with torch.no_grad():
        prefill = model(tokens, torch.arange(tokens.shape[1]))
        torch.testing.assert_close(prefill, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
        model.setup_caches(1, tokens.shape[1])
        model(tokens[:, :5], torch.arange(5))
        for t in range(5, tokens.shape[1]):  # one token at a time from the cache
            step = model(tokens[:, t:t + 1], torch.tensor([t]))
            torch.testing.assert_close(step[0, -1], prefill[0, t], rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_each_family_on_the_gpu_kernels_matches_the_float_reference(tmp_path: Path, arch: str) -> None:
    """The Triton/CUDA kernels (decode attention, rope cache, norms, Q4_K GEMV) on each family's
    shapes: qwen3's head_dim 128 with per-head norms, qwen2's biases."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernels.llama_q4k.model import KERNEL_OPS

    args, weights, _ = load_gguf(write_tiny(tmp_path / f"{arch}.gguf", arch))
    tokens = torch.tensor([[1, 450, 4996, 17354, 1701, 29916, 432, 17204]], device="cuda")
    expected = reference_logits(args, weights, tokens)
    model = Transformer(args, weights, device="cuda", ops=KERNEL_OPS)
    model.setup_caches(1, tokens.shape[1])
    scale = expected.abs().max().item()
    with torch.no_grad():
        prefill = model(tokens, torch.arange(tokens.shape[1], device="cuda"))
        torch.testing.assert_close(prefill, expected, rtol=1e-3, atol=1e-3 * scale)
        model(tokens[:, :5], torch.arange(5, device="cuda"))
        for t in range(5, tokens.shape[1]):
            step = model(tokens[:, t:t + 1], torch.tensor([t], device="cuda"))
            torch.testing.assert_close(step[0, -1], expected[0, t], rtol=1e-3, atol=1e-3 * scale)


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float, context: int) -> torch.Tensor:
    """The per-frequency factors llama.cpp's converter writes as rope_freqs.weight for a
    Hugging Face config with rope type "llama3" (written here from the format's description)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


@pytest.fixture(scope="module")
def unscaled_pair(tmp_path_factory) -> tuple[Path, Any, list[int]]:
    """A tiny llama, transformers' model of the same file and 80 prompt tokens, made once for
    every scaling (building either tokenizer takes seconds)."""
    needs_transformers()
    from transformers import AutoModelForCausalLM

    plain = write_tiny(tmp_path_factory.mktemp("rope") / "tiny.gguf", "llama")
    hf = AutoModelForCausalLM.from_pretrained(str(plain.parent), gguf_file=plain.name, dtype=torch.float32).eval()
    return plain, hf, GGUFTokenizer(plain).encode("The quick brown fox jumps over the lazy dog. " * 8)[:80]


@pytest.mark.parametrize("scaling", ["llama3", "linear", "yarn", "longrope-short", "longrope-long"])
def test_rope_scaling_matches_transformers_own_rope(tmp_path: Path, scaling: str, unscaled_pair) -> None:
    """Llama 3.1's rope scaling travels as a rope_freqs.weight tensor, linear and YaRN scaling
    as keys, LongRoPE (Phi-3 128k, Phi-3.5) as two factor tensors and an attention factor;
    transformers computes the same rope from its own config. A 64-token original context puts
    most frequencies in the scaled range, and 40 positions make them count: without the
    scaling the logits are far off. LongRoPE takes its long factors past the original context:
    80 positions, with a KV cache as long (llama.cpp picks by its context size)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kernels.llama_q4k.weights import write_gguf

    plain, hf, prompt = unscaled_pair
    args, weights, _ = load_gguf(plain)
    hf_rope: dict[str, Any] = {"rope_type": scaling, "rope_theta": args.rope_theta, "factor": 4.0}
    if scaling == "llama3":
        hf_rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        weights["rope_freqs.weight"] = llama3_rope_factors(args.head_dim, args.rope_theta, 4.0, 1.0, 4.0, 64)
    elif scaling == "linear":
        args = dataclasses.replace(args, rope_scaling_factor=4.0)
    elif scaling == "yarn":
        hf_rope |= {"original_max_position_embeddings": 64}
        args = dataclasses.replace(args, rope_scaling_factor=4.0, rope_scaling_type="yarn", rope_original_context=64)
    else:
        half = args.head_dim // 2
        short = 1.0 + 0.5 * torch.rand(half, generator=torch.Generator().manual_seed(1))
        long = 1.0 + 30.0 * torch.linspace(0, 1, half) ** 2
        hf_rope = {"rope_type": "longrope", "rope_theta": args.rope_theta, "short_factor": short.tolist(),
                   "long_factor": long.tolist(), "original_max_position_embeddings": 64}
        weights["rope_factors_short.weight"], weights["rope_factors_long.weight"] = short, long
        attn_factor = math.sqrt(1 + math.log(args.context_length / 64) / math.log(64))  # the converter's
        args = dataclasses.replace(args, rope_original_context=64, rope_attn_factor=attn_factor)
    scaled = tmp_path / "scaled.gguf"
    write_gguf(scaled, args, weights, vocab_from=VOCAB)

    hf.config.rope_parameters = hf_rope
    hf.model.rotary_emb = LlamaRotaryEmbedding(config=hf.config)
    positions = 80 if scaling == "longrope-long" else 40
    ids = torch.tensor([prompt[:positions]])
    assert ids.shape[1] == positions
    loaded_args, loaded, _ = load_gguf(scaled)
    assert (loaded_args.rope_scaling_factor == 4.0) == (scaling in ("linear", "yarn"))
    assert loaded_args.rope_scaling_type == ("yarn" if scaling == "yarn" else None)
    results = {}
    for name, (a, w) in {"scaled": (loaded_args, loaded), "unscaled": load_gguf(plain)[:2]}.items():
        ours = build_model(a, w, ops=TORCH_OPS)
        ours.setup_caches(1, ids.shape[1])
        with torch.no_grad():
            results[name] = ours(ids, torch.arange(ids.shape[1]))[0]
    with torch.no_grad():
        theirs = hf(ids).logits[0]
    scale = theirs.abs().max().item()
    diff = (results["scaled"] - theirs).abs().max().item() / scale
    off = (results["unscaled"] - theirs).abs().max().item() / scale
    assert diff < 1e-4, f"scaled rope differs from transformers' by {diff:.2e} of the largest logit"
    assert off > 100 * max(diff, 1e-6), f"the scaling changes nothing the test can see ({off:.2e})"


BPE_VOCAB = Path(__file__).parent / "fixtures" / "gguf" / "ggml-vocab-gpt-2.gguf"


def test_a_bpe_vocabulary_tokenizes_as_its_own_ids_and_starts_without_bos(tmp_path: Path) -> None:
    """GPT-2's byte-level BPE (merges, no scores) from llama.cpp's vocabulary file: its well-known
    ids ("Hello" 15496, " world" 995), bytes of any script back to the same text, and no BOS,
    as llama.cpp does for a BPE file that does not ask for one (Llama 3's pre-tokenizer does)."""
    needs_transformers()
    from kernels.llama_q4k.tokenizer import default_add_bos

    tok = GGUFTokenizer(write_tiny_model(tmp_path / "bpe.gguf", "qwen2", BPE_VOCAB))
    assert tok.meta["tokenizer.ggml.model"] == "gpt2" and "tokenizer.ggml.add_bos_token" not in tok.meta
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" Hello world") == [18435, 995]
    for text in ["Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.", "def f(x):\n\treturn x**2  # 🦙"]:
        assert tok.decode(tok.encode(text)) == text
    assert default_add_bos("gpt2", "llama-bpe") and not default_add_bos("gpt2", "qwen2")
    assert default_add_bos("llama", "default") and not default_add_bos("t5", None)


def test_a_bpe_vocabulary_model_matches_transformers(tmp_path: Path) -> None:
    """The same independent check as the families', on a file whose vocabulary is BPE."""
    needs_transformers()
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(tmp_path / "bpe.gguf", "qwen2", BPE_VOCAB)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([GGUFTokenizer(path).encode("The quick brown fox jumps over the lazy dog.")])
    args, weights, _ = load_gguf(path)
    ours = build_model(args, weights, ops=TORCH_OPS)
    ours.setup_caches(1, ids.shape[1])
    with torch.no_grad():
        mine, theirs = ours(ids, torch.arange(ids.shape[1]))[0], hf(ids).logits[0]
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    assert (mine - theirs).abs().max().item() < 1e-3 * theirs.abs().max().item()
