"""Text in, text out of a GGUF model program (kernels/llama_q4k: tokenizer, chat, sampling).

A tiny llama is written by our writer around a real vocabulary (tests/fixtures/gguf: Phi-3's
SentencePiece vocabulary and chat template, as llama.cpp ships it), then read back as text:
the tokenizer and template from the file alone, prompts in and replies out, and the logits
checked against an independent implementation, transformers loading the same GGUF (it
dequantizes the Q4_K tensors itself and undoes llama.cpp's q/k row order its own way).
"""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
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
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
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
