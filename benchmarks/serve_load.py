"""Load on an OpenAI-compatible server: throughput, time to first token and per-token latency at
several numbers of concurrent clients, measured with the official `openai` client.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 [--clients 1,4,8,16] \\
        [--requests-per-client 4] [--prompt-tokens 128] [--max-tokens 128] [--json OUT]

Works against our server (kernels/llama_q4k/serve.py) and llama.cpp's `llama-server` alike, so
both run on the same file and the same machine, one after the other. Each client streams its
requests one after another (a chat completion at temperature 0 with `ignore_eos`-free prompts:
replies may stop early, so tokens are counted from the stream). Per level: requests per second,
generated tokens per second over the level's wall time, TTFT P50/P95, and the gaps between
streamed chunks (per-token latency) P50/P95. One JSON line per level on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches".split()


def prompt_of(tokens: int, salt: int) -> str:
    """About `tokens` tokens of varied text (one word is about one token), different per client."""
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(tokens))


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def one_level(client: Any, model: str, clients: int, per_client: int, prompt_tokens: int, max_tokens: int) -> dict:
    ttft: list[float] = []
    gaps: list[float] = []
    tokens = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def run(index: int) -> None:
        for r in range(per_client):
            started = time.perf_counter()
            last = None
            first = None
            count = 0
            try:
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt_of(prompt_tokens, index * 31 + r)}],
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                )
                for chunk in stream:
                    if not chunk.choices or not chunk.choices[0].delta.content:
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now - started
                    elif last is not None:
                        with lock:
                            gaps.append(now - last)
                    last = now
                    count += 1
            except Exception as exc:  # a failed request is counted, not fatal
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            with lock:
                if first is not None:
                    ttft.append(first)
                tokens[0] += count

    began = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    done = clients * per_client - len(errors)
    return {
        "clients": clients,
        "requests": done,
        "errors": errors[:5],
        "wall_s": wall,
        "requests_per_s": done / wall,
        "chunks_per_s": tokens[0] / wall,
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p95_s": quantile(ttft, 0.95),
        "token_gap_p50_s": quantile(gaps, 0.5),
        "token_gap_p95_s": quantile(gaps, 0.95),
    }


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the server's first)")
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="also write every level here")
    opts = parser.parse_args(argv)
    client = openai.OpenAI(base_url=opts.url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = opts.model or client.models.list().data[0].id
    levels = []
    for clients in (int(c) for c in opts.clients.split(",")):
        level = one_level(client, model, clients, opts.requests_per_client, opts.prompt_tokens, opts.max_tokens)
        print(json.dumps(level), flush=True)
        levels.append(level)
        if opts.json:
            with open(opts.json, "w") as out:
                json.dump({"url": opts.url, "model": model, "levels": levels}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
