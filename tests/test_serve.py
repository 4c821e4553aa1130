"""The model program's OpenAI-compatible server (kernels/llama_q4k/serve.py), run as its real
command on a tiny model and driven with the official `openai` client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from kernels.llama_q4k.chat import TextModel  # noqa: E402
from kernels.llama_q4k.sampling import SamplingParams  # noqa: E402
from kernels.llama_q4k.weights import write_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT / "tests" / "fixtures" / "gguf" / "ggml-vocab-phi-3.gguf"
PROMPTS = ["Once upon a time", "The capital of France is", "def main():", "In 1969, Apollo 11"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernels.llama_q4k.serve", "--gguf", str(model), "--port", str(port),
         "--device", "cpu", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the server did not answer /health in 120 s")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny.gguf", "llama", VOCAB)


@pytest.fixture(scope="module")
def server(model_file: Path) -> Iterator[str]:
    proc, url = _start(model_file, "--memory-budget", "64MiB", "--max-batch", "4", "--max-context", "160")
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def solo(model_file: Path) -> TextModel:
    """The same file through plain one-request decoding (chat.py): what each served reply must be."""
    return TextModel(str(model_file), "cpu", max_seq=160)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_are_plain_greedy_decoding_and_stream_the_same_text(server: str, solo: TextModel) -> None:
    client = _client(server)
    want = solo.complete(PROMPTS[0], SamplingParams(), max_new_tokens=24)
    got = client.completions.create(model="tiny.gguf", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.tokens)
    assert got.choices[0].finish_reason == ("length" if want.stopped_by == "length" else "stop")
    pieces = client.completions.create(model="tiny.gguf", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in pieces) == want.text


def test_chat_goes_through_the_files_template_and_streams(server: str, solo: TextModel) -> None:
    client = _client(server)
    messages = [{"role": "user", "content": "Say something."}]
    want = solo.chat(messages, SamplingParams(), max_new_tokens=20)
    got = client.chat.completions.create(model="tiny.gguf", messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    stream = client.chat.completions.create(
        model="tiny.gguf", messages=messages, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.text


def test_concurrent_requests_share_decode_steps_and_keep_their_own_answers(server: str, solo: TextModel) -> None:
    """Four requests at once (two seeded samples among them) decode together, each joining and
    leaving the batch on its own, and each gets what it gets alone."""
    client = _client(server)
    results: dict[int, str] = {}
    seeded = {1: 7, 3: 11}

    def ask(i: int) -> None:
        params = {"temperature": 0.8, "top_p": 0.9, "seed": seeded[i]} if i in seeded else {"temperature": 0}
        reply = client.completions.create(model="tiny.gguf", prompt=PROMPTS[i], max_tokens=40 + 8 * i, **params)
        results[i] = reply.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == [0, 1, 2, 3]
    for i, text in results.items():
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=seeded[i]) if i in seeded else SamplingParams()
        assert text == solo.complete(PROMPTS[i], params, max_new_tokens=40 + 8 * i).text, i
    metrics = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    largest = int(next(line.split()[1] for line in metrics.splitlines() if line.startswith("loom_serve_rows_largest_batch")))
    assert largest >= 2, metrics


def test_what_cannot_fit_is_refused_with_a_reason(server: str, model_file: Path) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny.gguf", prompt="word " * 400, max_tokens=4)
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny.gguf", messages=[], max_tokens=4)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny.gguf"]
    small = subprocess.run(
        [sys.executable, "-m", "kernels.llama_q4k.serve", "--gguf", str(model_file), "--device", "cpu",
         "--memory-budget", "1MiB"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert small.returncode == 2 and "--memory-budget" in small.stderr, small.stderr[-2000:]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}


def test_tool_calls_round_trip_through_the_openai_client(server: str) -> None:
    """A named tool without parameters is called outright; its call and result go back through
    the file's template (Phi-3's knows no tools: the tools travel in a system message) and the
    model answers in text. Streamed, the call arrives as one tool_calls delta."""
    client = _client(server)
    messages: list[dict] = [{"role": "user", "content": "What time is it?"}]
    first = client.chat.completions.create(
        model="tiny.gguf", messages=messages, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=8,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments == "{}" and call.id.startswith("call_")
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:30"},
    ]
    second = client.chat.completions.create(model="tiny.gguf", messages=messages, tools=[WEATHER, CLOCK],
                                            max_tokens=6, temperature=0)
    assert second.choices[0].message.role == "assistant"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered
    stream = client.chat.completions.create(
        model="tiny.gguf", messages=messages[:1], tools=[CLOCK], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    deltas = [c.choices[0] for c in stream]
    assert deltas[0].delta.tool_calls[0].function.name == "get_time"
    assert deltas[-1].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny.gguf", messages=messages[:1], tools=[CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_the_load_generator_starts_our_server_and_ends_with_one_line_of_metrics(model_file: Path) -> None:
    """What benchmark_command reads from a serving A/B: one flat JSON line, per client count."""
    import json

    done = subprocess.run(
        [sys.executable, "benchmarks/serve_load.py", "--gguf", str(model_file), "--serve-arg=--device=cpu",
         "--serve-arg=--memory-budget=64MiB", "--serve-arg=--max-context=96", "--clients", "1,2",
         "--requests-per-client", "1", "--prompt-tokens", "8", "--max-tokens", "8", "--summary"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["requests_per_s_c1"] > 0 and last["chunks_per_s_c2"] > 0 and last["ttft_p50_s_c2"] > 0


def test_a_server_with_a_draft_speculates_and_answers_as_plain_decoding(model_file: Path, solo: TextModel) -> None:
    proc, url = _start(model_file, "--memory-budget", "64MiB", "--max-context", "160", "--draft-layers", "1")
    try:
        client = _client(url)
        for prompt in PROMPTS[:2]:
            want = solo.complete(prompt, SamplingParams(), max_new_tokens=30)
            got = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=30, temperature=0)
            assert got.choices[0].text == want.text
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        proposed = int(next(line.split()[1] for line in metrics.splitlines()
                            if line.startswith("loom_serve_speculative_proposed_total")))
        assert proposed > 0, metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_budget_is_shared_by_the_rows_and_models_that_really_run(model_file: Path) -> None:
    """With a draft the engine has one row, and the draft's weights and KV cache count too."""
    from kernels.llama_q4k.engine import kv_bytes_per_token
    from kernels.llama_q4k.serve import Served
    from kernels.llama_q4k.weights import load_gguf

    args, weights, _ = load_gguf(model_file)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    kv = kv_bytes_per_token(args, torch.float32)
    budget = weight_bytes + 100 * kv * 4  # 100 positions for each of 4 rows
    plain = Served(str(model_file), "cpu", budget, max_batch=4)
    assert plain.engine.max_batch == 4 and plain.engine.max_seq == 100
    draft_bytes = sum(w.numel() * w.element_size() for name, w in weights.items()
                      if not name.startswith("blk.") or name.startswith("blk.0."))
    per_token = kv * 3 // 2  # the draft has one layer of the two
    budget = weight_bytes + draft_bytes + 100 * per_token  # 100 positions for the one row
    drafted = Served(str(model_file), "cpu", budget, max_batch=4, draft_layers=1)
    assert drafted.engine.max_batch == 1 and drafted.engine.speculative is not None
    assert drafted.engine.max_seq == 100
    with pytest.raises(ValueError, match="--memory-budget"):
        Served(str(model_file), "cpu", weight_bytes + 100 * per_token, max_batch=4, draft_layers=1)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_rows_decode_together_and_each_answers_as_alone(tmp_path: Path, arch: str, solo: TextModel) -> None:
    """Gemma's decode step takes one position per row too, so its requests share steps. Prompts
    of different lengths put the rows at different positions, past the tiny models' sliding
    window of 8, and each reply must be that prompt's plain greedy decoding, one request alone
    (prefill, then one token per step)."""
    from kernels.llama_q4k.engine import Engine, Token
    from kernels.llama_q4k.model import TORCH_OPS
    from kernels.llama_q4k.weights import build_model, load_gguf

    args, weights, _ = load_gguf(write_tiny_model(tmp_path / f"{arch}.gguf", arch, VOCAB))
    tokenizer = solo.tokenizer  # the same vocabulary

    @torch.inference_mode()
    def alone(ids: list[int], n: int) -> list[int]:
        model = build_model(args, weights, ops=TORCH_OPS)
        model.setup_caches(1, 64)
        logits = model(torch.tensor([ids]), torch.arange(len(ids)), last_only=True)
        out = [int(logits[0, -1].argmax())]
        while len(out) < n:
            logits = model(torch.tensor([[out[-1]]]), torch.tensor([len(ids) + len(out) - 1]))
            out.append(int(logits[0, -1].argmax()))
        return out

    engine = Engine(build_model(args, weights, ops=TORCH_OPS), tokenizer, max_batch=4, max_seq=64)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    assert len({len(ids) for ids in prompts}) > 1
    requests = [engine.submit(ids, SamplingParams(), 12, stop_ids=set()) for ids in prompts]
    engine.start()  # after every submission: all four join the first pass
    try:
        for ids, request in zip(prompts, requests, strict=True):
            tokens = [event.id for event in request.events(timeout_s=120) if isinstance(event, Token)]
            assert tokens == alone(ids, 12)
        assert engine.stats.largest_batch == 4
    finally:
        engine.stop()
    # chat.py's one-request path runs Gemma too (prefill without image embeddings)
    from kernels.llama_q4k.generate import DecodeStep

    text_model = TextModel.__new__(TextModel)
    text_model.__dict__.update(solo.__dict__)
    text_model.model = build_model(args, weights, ops=TORCH_OPS)
    text_model.model.setup_caches(1, 64)
    text_model.decode = DecodeStep(text_model.model, 1, use_graph=False)
    assert list(text_model.stream(prompts[0], SamplingParams(), 12, stop=set())) == alone(prompts[0], 12)


def test_a_step_runs_only_up_to_the_last_row_in_use(model_file: Path, solo: TextModel) -> None:
    """One request on a 4-row engine decodes one row per step; a short request in row 0 and a
    longer one in row 1 run two rows, and the longer one's reply is still plain decoding once
    row 0 is idle."""
    from kernels.llama_q4k.engine import Engine, Token
    from kernels.llama_q4k.model import TORCH_OPS
    from kernels.llama_q4k.weights import build_model, load_gguf

    args, weights, _ = load_gguf(model_file)
    prompts = [solo.tokenizer.encode(text) for text in PROMPTS[:2]]
    for lengths, rows_per_step in (([10], 1), ([3, 10], 2)):
        engine = Engine(build_model(args, weights, ops=TORCH_OPS), solo.tokenizer, max_batch=4, max_seq=64)
        requests = [engine.submit(ids, SamplingParams(), n, stop_ids=set()) for ids, n in zip(prompts, lengths)]
        engine.start()
        try:
            for ids, n, request in zip(prompts, lengths, requests):
                tokens = [event.id for event in request.events(timeout_s=120) if isinstance(event, Token)]
                assert tokens == list(solo.stream(ids, SamplingParams(), n, stop=set()))
        finally:
            engine.stop()
        assert engine.stats.decode_steps > 0
        assert engine.stats.rows_computed == rows_per_step * engine.stats.decode_steps
