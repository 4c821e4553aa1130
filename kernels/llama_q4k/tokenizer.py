"""Text in and out of a GGUF file alone: its tokenizer, its chat template and its stop tokens.

The vocabulary (BPE or SentencePiece: tokens, scores, merges, token types, pre-tokenizer) is
turned into a Hugging Face fast tokenizer by transformers' own GGUF conversion, never by a BPE
of ours. Whether a BOS/EOS is added comes from `tokenizer.ggml.add_bos_token` /
`add_eos_token`, as llama.cpp reads them, and where a file has neither, from llama.cpp's
defaults (`default_add_bos`). The chat template (`tokenizer.chat_template`) is
rendered with jinja2 in a sandbox, with the variables and helpers chat templates expect.

    tok = GGUFTokenizer("model.gguf")
    ids = tok.encode(tok.chat([{"role": "user", "content": "Hi"}]), special_text=True)
    text = tok.decode(ids)
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Tokens that end a turn in the common chat formats, when the vocabulary has them: the file's
# own EOS (and EOT/EOM ids) come first; these cover files that name only an EOS.
TURN_END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def read_metadata(path: str | Path, prefix: str = "tokenizer.") -> dict[str, Any]:
    """The file's metadata under `prefix`, except the vocabulary arrays (large, not needed here)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith(prefix) and key not in skip}


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# BPE pre-tokenizers for which llama.cpp adds a BOS when the file does not say (Llama 3's and
# a few others'); every other BPE vocabulary (GPT-2's, Qwen's, ...) starts without one.
BPE_PRE_TOKENIZERS_WITH_BOS = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
     "jina-v5-nano", "tekken", "chameleon"}
)


def default_add_bos(model: str | None, pre: str | None) -> bool:
    """llama.cpp's default for `tokenizer.ggml.add_bos_token` by vocabulary type: SentencePiece
    ("llama") and WordPiece ("bert") add one, T5's Unigram does not, BPE ("gpt2") by its
    pre-tokenizer."""
    if model == "gpt2":
        return pre in BPE_PRE_TOKENIZERS_WITH_BOS
    return model in ("llama", "bert")


class GGUFTokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(path)
        self.path = path
        self.meta = read_metadata(path)
        self.hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.bos_id: int | None = self.meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = self.meta.get("tokenizer.ggml.eos_token_id")
        model, pre = self.meta.get("tokenizer.ggml.model"), self.meta.get("tokenizer.ggml.pre")
        self.add_bos = bool(self.meta.get("tokenizer.ggml.add_bos_token", default_add_bos(model, pre)))
        self.add_eos = bool(self.meta.get("tokenizer.ggml.add_eos_token", model == "t5"))
        self.chat_template: str | None = self.meta.get("tokenizer.chat_template")

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else str(self.hf.convert_ids_to_tokens(int(token_id)))

    def encode(self, text: str, special_text: bool = False, add_special: bool = True) -> list[int]:
        """Token ids of `text`, with the file's BOS/EOS when `add_special`. `special_text`: text
        such as "<|user|>" in `text` is the special token (a rendered chat template), not
        characters; off for text a user typed."""
        ids = list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=not special_text))
        if add_special and self.add_bos and self.bos_id is not None and not (ids and ids[0] == self.bos_id):
            ids.insert(0, int(self.bos_id))
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(int(self.eos_id))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special))

    def stop_ids(self) -> set[int]:
        """Ids that end a generation: the file's EOS, EOT and EOM, and the turn-end tokens the
        vocabulary has."""
        ids = {self.meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
        vocab = self.hf.get_vocab()
        ids |= {vocab[t] for t in TURN_END_TOKENS if t in vocab}
        return {int(i) for i in ids if i is not None}

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt the file's chat template makes of `messages` (encode it with
        special_text=True). A file without a template gets the messages' contents, one per line."""
        if not self.chat_template:
            return "\n".join(str(m.get("content", "")) for m in messages) + "\n"
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        template = env.from_string(self.chat_template)
        rendered = template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos_id),
            eos_token=self.token_text(self.eos_id),
            **extra,
        )
        # The template writes the BOS itself; encode() adds it again unless the text has it.
        return rendered
