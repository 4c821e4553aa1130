"""Text in, text out from a GGUF file: tokenizer and chat template from the file, prefill, then
decode one token at a time with greedy or seeded sampling until a stop token.

    python -m kernels.llama_q4k.chat --gguf model.gguf --prompt "Why is the sky blue?"
    python -m kernels.llama_q4k.chat --gguf model.gguf --raw --prompt "Once upon a time" \\
        --temperature 0.8 --top-p 0.95 --seed 1

The reply streams to stdout as it is made; progress while loading and the timing go to stderr.
On a GPU the model runs on the Triton kernels with the decode step as a CUDA graph; on a CPU it
takes the model's torch paths.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kernels.llama_q4k.generate import DecodeStep
from kernels.llama_q4k.model import KERNEL_OPS, TORCH_OPS, Transformer
from kernels.llama_q4k.sampling import SamplingParams, make_generator, next_token
from kernels.llama_q4k.tokenizer import GGUFTokenizer
from kernels.llama_q4k.weights import build_model, load_gguf

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass
class Reply:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stopped_by: str = "length"  # "stop" (a stop token) or "length" (max_new_tokens)
    prefill_s: float = 0.0
    decode_s: float = 0.0


class TextModel:
    """A GGUF model program with its tokenizer: `complete` and `chat` return text."""

    def __init__(
        self,
        path: str,
        device: torch.device | str = "cpu",
        max_seq: int = 2048,
        dtype: torch.dtype | None = None,
        say: Callable[[str], None] | None = None,
        mmproj: str | None = None,
    ) -> None:
        say = say or (lambda message: None)
        self.device = torch.device(device)
        say(f"reading {path}")
        self.tokenizer = GGUFTokenizer(path)
        self.args, weights, _ = load_gguf(path)
        if self.tokenizer.vocab_size > self.args.vocab_size:
            raise ValueError(
                f"{path}: the tokenizer has {self.tokenizer.vocab_size} tokens, the embedding {self.args.vocab_size}"
            )
        self.max_seq = min(max_seq, self.args.context_length)
        cuda = self.device.type == "cuda"
        dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        say(f"building the {self.args.arch} model on {self.device} ({self.args.n_layers} layers)")
        self.model = build_model(
            self.args, weights, device=self.device, dtype=dtype, ops=KERNEL_OPS if cuda else TORCH_OPS
        )
        self.model.setup_caches(1, self.max_seq)
        self.vision = None
        if mmproj:
            from kernels.llama_q4k.vision import Vision

            if not isinstance(self.model, Transformer):
                raise ValueError(f"--mmproj: image input runs on llama-family model programs, not {self.args.arch}")
            say(f"reading the vision tower {mmproj}")
            self.vision = Vision(mmproj, self.args.dim, self.device, dtype)
        say("preparing the decode step" + (" (CUDA graph)" if cuda else ""))
        self.decode = DecodeStep(self.model, 1, use_graph=cuda)

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int = 256,
        stop: set[int] | None = None,
        images: Sequence[Tensor] = (),
        image_starts: Sequence[int] = (),
    ) -> Iterator[int]:
        """The new tokens, one at a time, until a stop token (not yielded) or max_new_tokens.
        `images` (pixels) fill the prompt's slots starting at `image_starts` (vision.py)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        budget = min(max_new_tokens, self.max_seq - len(prompt_ids))
        if budget <= 0:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) fills the context ({self.max_seq})")
        stop = self.tokenizer.stop_ids() if stop is None else stop
        generator = make_generator(params, self.device)
        seen = torch.tensor([prompt_ids], device=self.device)
        with torch.inference_mode():
            embeds = None
            if images:
                from kernels.llama_q4k.vision import embed_prompt

                if self.vision is None:
                    raise ValueError("images need a vision tower: load the model with mmproj=")
                encoded = self.vision.encode(list(images))
                embeds = embed_prompt(self.model.tok_embeddings, seen, image_starts, encoded)
            extra = {} if embeds is None else {"embeds": embeds}
            logits = self.model(seen, torch.arange(len(prompt_ids), device=self.device), last_only=True, **extra)
            if images:  # a repetition penalty counts text tokens, not the image's slots
                from kernels.llama_q4k.vision import text_ids

                assert self.vision is not None
                seen = torch.tensor([text_ids(prompt_ids, image_starts, self.vision.n_image_tokens)], device=self.device)
            for i in range(budget):
                token = next_token(logits[:, -1], params, generator, seen if params.repetition_penalty != 1 else None)
                value = int(token.item())
                if value in stop:
                    return
                yield value
                seen = torch.cat([seen, token], dim=1)
                if i + 1 < budget:
                    logits = self.decode(token, len(prompt_ids) + i)

    def complete(
        self,
        prompt: str,
        params: SamplingParams | None = None,
        max_new_tokens: int = 256,
        special_text: bool = False,
        on_text: Callable[[str], None] | None = None,
        images: Sequence[Image] = (),
    ) -> Reply:
        """Continue `prompt` (text; with `images`, one IMAGE_MARKER in it per image). `on_text`
        gets the reply's text as it grows, piece by piece."""
        params = params or SamplingParams()
        pixels: list[Tensor] = []
        starts: list[int] = []
        if images:
            from kernels.llama_q4k.vision import tokenize

            if self.vision is None:
                raise ValueError("images need a vision tower: load the model with mmproj=")
            marked = tokenize(self.tokenizer.encode, prompt, self.vision.n_image_tokens, len(images), special_text=special_text)
            ids, starts = marked.ids, marked.image_starts
            pixels = [self.vision.pixels(image) for image in images]
        else:
            ids = self.tokenizer.encode(prompt, special_text=special_text)
        reply = Reply(stopped_by="length")
        began = time.perf_counter()
        shown = ""
        for token in self.stream(ids, params, max_new_tokens, images=pixels, image_starts=starts):
            if not reply.tokens:
                reply.prefill_s = time.perf_counter() - began
            reply.tokens.append(token)
            text = self.tokenizer.decode(reply.tokens)
            if on_text is not None and text.startswith(shown) and len(text) > len(shown):
                on_text(text[len(shown) :])
                shown = text
        reply.text = self.tokenizer.decode(reply.tokens)
        if len(reply.tokens) < min(max_new_tokens, self.max_seq - len(ids)):
            reply.stopped_by = "stop"
        reply.decode_s = time.perf_counter() - began - reply.prefill_s
        return reply

    def chat(
        self,
        messages: list[dict],
        params: SamplingParams | None = None,
        max_new_tokens: int = 256,
        images: Sequence[Image] = (),
        **kw: Any,
    ) -> Reply:
        """The assistant's reply to `messages`, through the file's chat template. With `images`
        and no IMAGE_MARKER in the messages, the images go before the last message's text."""
        if images:
            from kernels.llama_q4k.vision import IMAGE_MARKER

            if not any(IMAGE_MARKER in str(m.get("content", "")) for m in messages):
                last = messages[-1]
                messages = [*messages[:-1], {**last, "content": IMAGE_MARKER * len(images) + "\n" + str(last.get("content", ""))}]
        return self.complete(self.tokenizer.chat(messages), params, max_new_tokens, special_text=True, images=images, **kw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--system", help="a system message (chat mode)")
    parser.add_argument("--raw", action="store_true", help="continue the prompt as text, no chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-seq", type=int, default=4096, help="KV cache length")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mmproj", help="the model's mmproj GGUF (vision tower + projector), for --image")
    parser.add_argument("--image", action="append", default=[], help="an image file (repeatable; needs --mmproj)")
    opts = parser.parse_args(argv)
    if opts.image and not opts.mmproj:
        parser.error("--image needs --mmproj")

    def say(message: str) -> None:
        print(f"[loading] {message}", file=sys.stderr, flush=True)

    params = SamplingParams(
        temperature=opts.temperature,
        top_k=opts.top_k,
        top_p=opts.top_p,
        min_p=opts.min_p,
        repetition_penalty=opts.repetition_penalty,
        seed=opts.seed,
    )
    model = TextModel(opts.gguf, opts.device, opts.max_seq, say=say, mmproj=opts.mmproj)
    images = []
    if opts.image:
        from pathlib import Path

        from kernels.llama_q4k.vision import IMAGE_MARKER, decode_image

        images = [decode_image(Path(path).read_bytes()) for path in opts.image]
        if opts.raw and IMAGE_MARKER not in opts.prompt:
            opts.prompt = IMAGE_MARKER * len(images) + "\n" + opts.prompt

    def show(piece: str) -> None:
        print(piece, end="", flush=True)

    if opts.raw:
        reply = model.complete(opts.prompt, params, opts.max_tokens, on_text=show, images=images)
    else:
        messages = ([{"role": "system", "content": opts.system}] if opts.system else []) + [
            {"role": "user", "content": opts.prompt}
        ]
        reply = model.chat(messages, params, opts.max_tokens, on_text=show, images=images)
    print()
    rate = len(reply.tokens) / reply.decode_s if reply.decode_s > 0 else 0.0
    print(
        f"[{len(reply.tokens)} tokens, {reply.stopped_by}; first token {reply.prefill_s * 1e3:.0f} ms, "
        f"{rate:.1f} tok/s after]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
