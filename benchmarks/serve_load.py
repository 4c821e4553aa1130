"""Load on an OpenAI-compatible server: throughput, time to first token and per-token latency at
several numbers of concurrent clients, measured with the official `openai` client.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 [--clients 1,4,8,16] \\
        [--requests-per-client 4] [--prompt-tokens 128] [--max-tokens 128] [--json OUT]
    python benchmarks/serve_load.py --gguf FILE [--serve-arg=--memory-budget=40GiB ...] --summary

With --gguf it starts our server on that file on a free loopback port, and stops it after.
--summary ends with one flat JSON line (`chunks_per_s_c8`, `ttft_p50_s_c1`, ...), the form
loom's `benchmark_command` reads, so a campaign can optimize serving: two commands, two
commits or two settings, A/B.

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
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
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


def launch(gguf: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Our server on `gguf`, on a free loopback port; returns once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernels.llama_q4k.serve", "--gguf", gguf, "--port", str(port), *extra],
        cwd=root, stdout=subprocess.DEVNULL, stderr=sys.stderr,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not answer /health in 600 s")


def summary(levels: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for level in levels:
        for key in ("chunks_per_s", "requests_per_s", "ttft_p50_s", "ttft_p95_s", "token_gap_p50_s", "token_gap_p95_s"):
            if level.get(key) is not None:
                out[f"{key}_c{level['clients']}"] = level[key]
    return out


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--gguf", help="start our server on this file (instead of --url)")
    parser.add_argument("--serve-arg", action="append", default=[], help="an argument for our server, e.g. --serve-arg=--device=cpu")
    parser.add_argument("--summary", action="store_true", help="end with one flat JSON line of every level's figures")
    parser.add_argument("--model", help="model id (default: the server's first)")
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="also write every level here")
    opts = parser.parse_args(argv)
    server = None
    if opts.gguf:
        server, opts.url = launch(opts.gguf, opts.serve_arg)
    try:
        return run(opts, openai)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


def run(opts: argparse.Namespace, openai: Any) -> int:
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
    if opts.summary:
        print(json.dumps(summary(levels)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
