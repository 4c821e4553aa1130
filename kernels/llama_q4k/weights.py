"""GGUF in and out for the Llama Q4_K model: read a file, write one, or draw random weights.

Tensors use llama.cpp's names (token_embd.weight, blk.N.attn_q.weight, ..., output.weight) and
stay on the CPU; Transformer copies them to its device.

GGUFReader gives a Q4_K tensor's `data` as uint8 [rows, cols / 256 * 144]: one run of 144-byte
blocks per output feature, exactly what the q4k_gemv kernels read. Its `shape` field is in
GGML's reversed order, [cols, rows], so we never use it. Q4_K stays packed; every other type
(F32 norms, F16 embeddings, the Q6_K tensors of Q4_K_M files) is dequantized to fp32 at load by
gguf-py, and `load_gguf` reports which.

llama.cpp's converter permutes the rows of attn_q and attn_k so that its rope can rotate
adjacent pairs (2i, 2i+1). The rope kernel rotates (i, i + head_dim/2), as Hugging Face does,
so the reader undoes that permutation and the writer applies it. It only moves whole rows, so
packed Q4_K rows move as they are.

Families (general.architecture): llama (Llama 2/3.x, Mistral), qwen2 (q/k/v biases), qwen3
(per-head q/k RMSNorm, its own head_dim), phi3 (q/k/v in one tensor, attn_qkv, and gate and up
in one, ffn_up: split at load and fused again on write), gemma2 and gemma3 (gemma.py). Only
llama's q/k rows are permuted in the file: the Qwen, Phi and Gemma converters keep Hugging
Face's order.

Rope scaling: Llama 3.1's (a `rope_freqs.weight` tensor of per-frequency factors), linear
scaling (`{arch}.rope.scaling.type` "linear", gemma3 4B and larger on their global layers),
YaRN (type "yarn", its factor, original context and beta keys) and LongRoPE
(`rope_factors_short/long`, `rope.scaling.attn_factor`: Phi-3 128k, Phi-3.5). Files with a
partial rotary (`rope.dimension_count` below the head size) are refused.

Not handled: Mistral v0.1's sliding window (4096); Phi-3's sliding window (2047; llama.cpp
ignores it too); YaRN's `yarn_log_multiplier` (DeepSeek's mscale). A file with a sliding window
loads and is right only within the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from kernels.llama_q4k.model import ModelArgs
from kernels.q4k.format import BLOCK_BYTES, QK_K

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType


FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
GEMMAS = ("gemma2", "gemma3")
# Families whose files fuse matrices that the model keeps apart: fused name -> parts, in order.
FUSED = {"phi3": {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}}


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and logical shape ([out, in] for a matrix), in GGUF's usual order."""
    q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        blk = f"blk.{i}."
        shapes |= {
            blk + "attn_norm.weight": (args.dim,),
            blk + "attn_q.weight": (q_size, args.dim),
            blk + "attn_k.weight": (kv_size, args.dim),
            blk + "attn_v.weight": (kv_size, args.dim),
            blk + "attn_output.weight": (args.dim, q_size),
            blk + "ffn_norm.weight": (args.dim,),
            blk + "ffn_gate.weight": (args.ffn_dim, args.dim),
            blk + "ffn_up.weight": (args.ffn_dim, args.dim),
            blk + "ffn_down.weight": (args.dim, args.ffn_dim),
        }
        if args.qkv_bias:
            shapes |= {blk + "attn_q.bias": (q_size,), blk + "attn_k.bias": (kv_size,), blk + "attn_v.bias": (kv_size,)}
        if args.qk_norm:
            shapes |= {blk + "attn_q_norm.weight": (args.head_dim,), blk + "attn_k_norm.weight": (args.head_dim,)}
        if args.arch in GEMMAS:
            shapes |= {blk + "post_attention_norm.weight": (args.dim,), blk + "post_ffw_norm.weight": (args.dim,)}
    shapes |= {"output_norm.weight": (args.dim,)}
    if args.arch not in GEMMAS:  # gemma's output matrix is its embedding
        shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


def _heads_for(name: str, args: ModelArgs) -> int | None:
    """Heads of a tensor whose rows llama.cpp's converter permutes, else None."""
    if args.arch != "llama":
        return None
    if name.endswith("attn_q.weight"):
        return args.n_heads
    if name.endswith("attn_k.weight"):
        return args.n_kv_heads
    return None


def to_gguf_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Hugging Face rows (head, half, i) -> GGUF rows (head, i, half): the converter's permute."""
    return weight.reshape(n_heads, 2, -1, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def from_gguf_rows(weight: Tensor, n_heads: int) -> Tensor:
    """The inverse of `to_gguf_rows`."""
    return weight.reshape(n_heads, -1, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _split_fused(args: ModelArgs, weights: dict[str, Tensor], types: dict[str, str]) -> None:
    """In place: each fused matrix of the family's files (FUSED) cut by rows into its parts.
    Packed Q4_K rows are whole rows, so they are cut as they are."""
    for i in range(args.n_layers):
        for fused, parts in FUSED.get(args.arch, {}).items():
            name = f"blk.{i}.{fused}.weight"
            if name not in weights or f"blk.{i}.{parts[0]}.weight" in weights:
                continue  # a file that keeps them apart (phi3 files may)
            sizes = [_rows_of(part, args) for part in parts]
            whole, kind = weights.pop(name), types.get(name, "")
            if whole.shape[0] != sum(sizes):
                raise ValueError(f"{name}: {whole.shape[0]} rows where {' + '.join(map(str, sizes))} were expected")
            for part, piece in zip(parts, torch.split(whole, sizes), strict=True):
                weights[f"blk.{i}.{part}.weight"] = piece.contiguous()
                types[f"blk.{i}.{part}.weight"] = kind


def _fuse(
    args: ModelArgs, weights: dict[str, Tensor], quant_types: dict[str, GGMLQuantizationType]
) -> tuple[dict[str, Tensor], dict[str, GGMLQuantizationType]]:
    """The family's fused matrices (FUSED) put back together, in the file's order; the others
    as they are."""
    groups = FUSED.get(args.arch)
    if not groups:
        return weights, quant_types
    out: dict[str, Tensor] = {}
    types = dict(quant_types)
    for name, weight in weights.items():
        prefix, _, rest = name.rpartition(".")[0].rpartition(".")
        if not name.endswith(".weight"):  # biases and the like are never fused
            out[name] = weight
            continue
        for fused, parts in groups.items():
            if rest in parts:
                if rest == parts[0]:
                    pieces = [weights[f"{prefix}.{part}.weight"] for part in parts]
                    kinds = {quant_types.get(f"{prefix}.{part}.weight") for part in parts}
                    if len(kinds) > 1 or len({p.dtype for p in pieces}) > 1:
                        raise ValueError(f"{prefix}.{fused}: its parts differ in type; a fused tensor has one")
                    out[f"{prefix}.{fused}.weight"] = torch.cat(pieces)
                    if (kind := kinds.pop()) is not None:
                        types[f"{prefix}.{fused}.weight"] = kind
                break
        else:
            out[name] = weight
    return out, types


def _rows_of(part: str, args: ModelArgs) -> int:
    return {
        "attn_q": args.n_heads * args.head_dim,
        "attn_k": args.n_kv_heads * args.head_dim,
        "attn_v": args.n_kv_heads * args.head_dim,
        "ffn_gate": args.ffn_dim,
        "ffn_up": args.ffn_dim,
    }[part]


def build_model(args: ModelArgs, weights: dict[str, Tensor], **kwargs: Any) -> torch.nn.Module:
    """The model of the file's family: Transformer (llama, qwen2, qwen3) or GemmaTransformer
    (gemma2, gemma3)."""
    if args.arch in GEMMAS:
        from kernels.llama_q4k.gemma import GemmaTransformer

        return GemmaTransformer(args, weights, **kwargs)
    from kernels.llama_q4k.model import Transformer

    return Transformer(args, weights, **kwargs)


def load_gguf(path: str | Path) -> tuple[ModelArgs, dict[str, Tensor], dict[str, str]]:
    """(config, weights on the CPU, GGML type name of every tensor) from a llama GGUF file."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))

    def field(key: str) -> Any:
        value = reader.get_field(key)
        if value is None:
            raise KeyError(f"{path}: no metadata key {key!r}")
        return value.contents()

    def optional(key: str) -> Any:
        value = reader.get_field(key)
        return None if value is None else value.contents()

    arch = field("general.architecture")
    if arch not in FAMILIES:
        raise ValueError(f"{path}: architecture {arch!r}; this model program runs {', '.join(FAMILIES)}")

    weights, types = {}, {}
    for tensor in reader.tensors:
        types[tensor.name] = tensor.tensor_type.name
        if tensor.tensor_type == GGMLQuantizationType.Q4_K:
            weights[tensor.name] = torch.from_numpy(np.array(tensor.data))  # a copy off the mmap
        else:
            values = dequantize(tensor.data, tensor.tensor_type)
            weights[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32))
    if "output.weight" not in weights:  # tied embeddings
        weights["output.weight"] = weights["token_embd.weight"]
    scaling = optional(f"{arch}.rope.scaling.type")
    if optional(f"{arch}.rope.scaling.yarn_log_multiplier"):
        raise ValueError(f"{path}: YaRN's yarn_log_multiplier (DeepSeek's mscale) is not covered")
    if scaling not in (None, "none", "linear", "yarn", "longrope"):
        raise ValueError(f"{path}: rope scaling {scaling!r}; this model program does none, linear, yarn and longrope")
    factor = (
        optional(f"{arch}.rope.scaling.factor") if scaling in ("linear", "yarn") else optional(f"{arch}.rope.scale_linear")
    )
    head_dim = int(optional(f"{arch}.attention.key_length") or int(field(f"{arch}.embedding_length")) // int(field(f"{arch}.attention.head_count")))
    rope_dims = optional(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"{path}: the rope turns {rope_dims} of each head's {head_dim} dimensions; partial rotary (Phi-4-mini) is not covered")

    args = ModelArgs(
        dim=int(field(f"{arch}.embedding_length")),
        n_layers=int(field(f"{arch}.block_count")),
        n_heads=int(field(f"{arch}.attention.head_count")),
        n_kv_heads=int(field(f"{arch}.attention.head_count_kv")),
        ffn_dim=int(field(f"{arch}.feed_forward_length")),
        vocab_size=weights["token_embd.weight"].shape[0],
        context_length=int(field(f"{arch}.context_length")),
        rope_theta=float(field(f"{arch}.rope.freq_base")),
        norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        arch=arch,
        head_dim_override=int(key_length) if (key_length := optional(f"{arch}.attention.key_length")) else None,
        attn_logit_softcap=optional(f"{arch}.attn_logit_softcapping"),
        final_logit_softcap=optional(f"{arch}.final_logit_softcapping"),
        sliding_window=optional(f"{arch}.attention.sliding_window"),
        rope_scaling_factor=float(factor) if factor and float(factor) != 1.0 else None,
        rope_scaling_type="yarn" if scaling == "yarn" else None,
        rope_original_context=int(original) if (original := optional(f"{arch}.rope.scaling.original_context_length")) else None,
        rope_attn_factor=float(optional(f"{arch}.rope.scaling.attn_factor") or 1.0),
        yarn_beta_fast=float(optional(f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
        yarn_beta_slow=float(optional(f"{arch}.rope.scaling.yarn_beta_slow") or 1.0),
    )
    _split_fused(args, weights, types)
    for name, weight in weights.items():
        if (heads := _heads_for(name, args)) is not None:
            weights[name] = from_gguf_rows(weight, heads)
    return args, weights, types


def write_gguf(
    path: str | Path,
    args: ModelArgs,
    weights: dict[str, Tensor],
    quant_types: dict[str, GGMLQuantizationType] | None = None,
    vocab_from: str | Path | None = None,
) -> None:
    """Write `weights` as a llama GGUF file: float tensors as they are, uint8 ones as packed
    rows of Q4_K, or of the type `quant_types` names for them (rows in our q/k order).
    `vocab_from`: a GGUF whose `tokenizer.*` keys (vocabulary, merges, special ids, chat
    template) are copied, e.g. llama.cpp's models/ggml-vocab-*.gguf: llama.cpp refuses a model
    without them, and they make the file a text model (kernels/llama_q4k/tokenizer.py)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    quant_types = quant_types or {}
    writer = GGUFWriter(str(path), arch=args.arch)
    writer.add_name("loom-llama-q4k")
    if vocab_from is not None:
        copy_tokenizer(writer, vocab_from)
    writer.add_context_length(args.context_length)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_dimension_count(args.head_dim)
    if args.head_dim_override:
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)
    if args.attn_logit_softcap:
        writer.add_float32(f"{args.arch}.attn_logit_softcapping", args.attn_logit_softcap)
    if args.final_logit_softcap:
        writer.add_float32(f"{args.arch}.final_logit_softcapping", args.final_logit_softcap)
    if args.sliding_window:
        writer.add_uint32(f"{args.arch}.attention.sliding_window", args.sliding_window)
    if args.rope_scaling_factor:
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.YARN if args.rope_scaling_type == "yarn" else RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(args.rope_scaling_factor)
    if args.rope_original_context:
        writer.add_rope_scaling_orig_ctx_len(args.rope_original_context)
    if args.rope_attn_factor != 1.0:
        writer.add_rope_scaling_attn_factors(args.rope_attn_factor)
    if args.rope_scaling_type == "yarn":
        writer.add_float32(f"{args.arch}.rope.scaling.yarn_beta_fast", args.yarn_beta_fast)
        writer.add_float32(f"{args.arch}.rope.scaling.yarn_beta_slow", args.yarn_beta_slow)
    writer.add_vocab_size(args.vocab_size)
    weights, quant_types = _fuse(args, weights, quant_types)
    for name, weight in weights.items():
        if (heads := _heads_for(name, args)) is not None:
            weight = to_gguf_rows(weight, heads)
        array = weight.contiguous().numpy()
        if weight.dtype == torch.uint8:
            raw_dtype = quant_types.get(name, GGMLQuantizationType.Q4_K)
            writer.add_tensor(name, array, raw_dtype=raw_dtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_tokenizer(writer: Any, source: str | Path) -> int:
    """Copy every `tokenizer.*` key of the GGUF at `source` into `writer`, types kept; returns
    the vocabulary's size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    size = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
        if key == "tokenizer.ggml.tokens":
            size = len(field.data)
    return size


def vocab_size_of(source: str | Path) -> int:
    """How many tokens the vocabulary of the GGUF at `source` has."""
    from gguf import GGUFReader

    field = GGUFReader(str(source)).get_field("tokenizer.ggml.tokens")
    if field is None:
        raise KeyError(f"{source}: no tokenizer.ggml.tokens")
    return len(field.data)


def random_q4k(rows: int, cols: int, generator: torch.Generator) -> Tensor:
    """Random valid Q4_K bytes [rows, cols / 256 * 144], drawn on the generator's device.

    The same draw as kernels/q4k/format.py's `random_q4_k` (random scale, min and code bytes;
    finite fp16 d around 1e-4 and dmin around 7.5e-4, which gives Llama-sized weights), but on
    a GPU when the generator is there: 4.6 GB of Llama-3-8B bytes take seconds, not minutes.
    """
    device, n_blocks = generator.device, cols // QK_K
    blocks = torch.randint(
        0, 256, (rows, n_blocks, BLOCK_BYTES), dtype=torch.uint8, device=device, generator=generator
    )
    d = 1e-4 * (0.5 + torch.rand(rows, n_blocks, device=device, generator=generator))
    dmin = 7.5e-4 * (0.5 + torch.rand(rows, n_blocks, device=device, generator=generator))
    blocks[..., 0:2] = d.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    blocks[..., 2:4] = dmin.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * BLOCK_BYTES)


def random_weights(args: ModelArgs, seed: int = 0, device: str = "cpu") -> dict[str, Tensor]:
    """Random weights, drawn on `device` and returned on the CPU.

    Every matrix (embedding and output too) is random valid Q4_K; norms are fp32 near 1 (a norm
    of all ones would hide a skipped multiply).
    """
    generator = torch.Generator(device).manual_seed(seed)
    weights = {}
    for name, shape in tensor_shapes(args).items():
        if len(shape) == 2:
            weights[name] = random_q4k(*shape, generator).cpu()
        else:
            weights[name] = (
                1.0 + 0.1 * torch.randn(shape, device=device, generator=generator)
            ).cpu()
    return weights


def tiny_args(arch: str, vocab_size: int) -> ModelArgs:
    """A tiny config of each family (Q4_K rows are whole 256-weight blocks), shaped so that
    transformers' GGUF loader, which takes some values from its own defaults, reads the same
    model: Qwen 3 and Gemma assume their head_dim, Gemma 2 its soft-caps and query scale."""
    base: dict[str, Any] = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 512}
    family: dict[str, dict[str, Any]] = {
        "qwen3": {"n_heads": 2, "n_kv_heads": 1, "head_dim_override": 128, "norm_eps": 1e-6},
        "gemma2": {"n_heads": 1, "n_kv_heads": 1, "head_dim_override": 256, "norm_eps": 1e-6,
                   "attn_logit_softcap": 50.0, "final_logit_softcap": 30.0, "sliding_window": 8},
        # six layers: five local and a global one, each with its own rope base
        "gemma3": {"n_layers": 6, "n_heads": 1, "n_kv_heads": 1, "head_dim_override": 256, "norm_eps": 1e-6,
                   "sliding_window": 8, "rope_theta": 1000000.0},
    }
    settings = {"rope_theta": 10000.0, **base, **family.get(arch, {})}
    return ModelArgs(vocab_size=vocab_size, context_length=256, arch=arch, **settings)


def write_tiny_model(path: str | Path, arch: str, vocab_from: str | Path, dense: bool = False, seed: int = 0) -> Path:
    """A tiny random model of `arch` written by write_gguf around a real vocabulary (its
    `tokenizer.*` keys copied from `vocab_from`), for tests and for comparing implementations.
    Matrices are Q4_K (quantized from Llama-sized normals), or with `dense` the same values
    dequantized to F32; norms near 1, biases around 0."""
    from kernels.q4k.format import dequantize_q4_k, quantize_q4_k

    args = tiny_args(arch, vocab_size_of(vocab_from))
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, Tensor] = {}
    for name, shape in tensor_shapes(args).items():
        if len(shape) == 2:
            scale = 1.0 if name == "token_embd.weight" else 0.05
            packed = torch.from_numpy(quantize_q4_k((scale * torch.randn(shape, generator=generator)).numpy()))
            weights[name] = dequantize_q4_k(packed) if dense else packed
        elif name.endswith(".bias"):
            weights[name] = 0.5 * torch.randn(shape, generator=generator)
        else:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
    write_gguf(path, args, weights, vocab_from=vocab_from)
    return Path(path)

