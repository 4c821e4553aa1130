"""Speculative decoding (kernels/llama_q4k/speculative.py) on tiny models: greedy output is the
target's plain greedy output token for token, and the rejection rule keeps the target's
distribution."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from kernels.llama_q4k.model import TORCH_OPS  # noqa: E402
from kernels.llama_q4k.sampling import SamplingParams  # noqa: E402
from kernels.llama_q4k.speculative import Speculative, accept_or_resample, draft_from_target  # noqa: E402
from kernels.llama_q4k.weights import build_model, load_gguf, write_tiny_model  # noqa: E402

VOCAB = Path(__file__).parent / "fixtures" / "gguf" / "ggml-vocab-phi-3.gguf"
PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("spec") / "tiny.gguf", "llama", VOCAB)
    return load_gguf(path)[:2]


def plain_greedy(args, weights, prompt: list[int], n: int) -> list[int]:
    model = build_model(args, weights, ops=TORCH_OPS)
    model.setup_caches(1, 128)
    out: list[int] = []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)), last_only=True)[0, -1]
        for i in range(n):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), torch.tensor([len(prompt) + i]))[0, -1]
    return out


@pytest.mark.parametrize("draft_layers", [1, 2])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_is_plain_greedy_decoding(tiny, draft_layers: int, k: int) -> None:
    """A draft of the target's first layer (some proposals rejected) or of all of it (none): the
    tokens are the target's own greedy ones either way, whatever k starts at."""
    args, weights = tiny
    want = plain_greedy(args, weights, PROMPT, 40)
    draft_args, draft_weights = draft_from_target(args, weights, draft_layers)
    spec = Speculative(build_model(args, weights, ops=TORCH_OPS), build_model(draft_args, draft_weights, ops=TORCH_OPS),
                       max_seq=128, k=k)
    got = list(spec.generate(PROMPT, SamplingParams(), 40))
    assert got == want
    assert spec.stats.proposed > 0
    if draft_layers == args.n_layers:
        assert spec.stats.acceptance == 1.0
    else:
        assert spec.stats.acceptance < 1.0  # the test exercised rejections too
    print(f"draft {draft_layers} layer(s), k {k}: acceptance {spec.stats.acceptance:.2f}, ks {spec.stats.ks}")


def test_generation_ends_at_the_cache_and_at_stop_tokens(tiny) -> None:
    args, weights = tiny
    want = plain_greedy(args, weights, PROMPT, 24)
    make = lambda: Speculative(build_model(args, weights, ops=TORCH_OPS),  # noqa: E731
                               build_model(*draft_from_target(args, weights, 1), ops=TORCH_OPS), max_seq=len(PROMPT) + 12, k=5)
    assert list(make().generate(PROMPT, SamplingParams(), 100)) == want[:12]
    stop_at = want[7]
    assert list(make().generate(PROMPT, SamplingParams(), 24, stop={stop_at})) == want[: want.index(stop_at)]


def test_the_rejection_rule_emits_the_target_distribution() -> None:
    """Draft tokens drawn from q, passed through the rule: the emitted tokens follow p."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    trials = 20000
    drafts = torch.multinomial(q, trials, replacement=True, generator=generator)
    for token in drafts.tolist():
        _, emitted = accept_or_resample(p, q, token, generator)
        counts[emitted] += 1
    assert (counts / trials - p).abs().max() < 0.015, counts / trials
    assert accept_or_resample(p, p, 3, generator) == (True, 3)


def test_sampled_speculation_with_the_target_as_draft_accepts_everything(tiny) -> None:
    args, weights = tiny
    spec = Speculative(build_model(args, weights, ops=TORCH_OPS), build_model(args, weights, ops=TORCH_OPS),
                       max_seq=128, k=4)
    first = list(spec.generate(PROMPT, SamplingParams(temperature=0.9, seed=3), 30))
    assert len(first) == 30 and spec.stats.acceptance == 1.0
    again = Speculative(build_model(args, weights, ops=TORCH_OPS), build_model(args, weights, ops=TORCH_OPS),
                        max_seq=128, k=4)
    assert list(again.generate(PROMPT, SamplingParams(temperature=0.9, seed=3), 30)) == first
