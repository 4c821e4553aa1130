"""A small Llama-style decoder whose linear layers are GGUF Q4_K, run on our kernels.

The shape follows gpt-fast: Transformer -> TransformerBlock -> Attention + FeedForward.

- Linears keep their Q4_K bytes packed (uint8 [out, in / 256 * 144], as GGUF stores them).
  Decode (at most 8 rows) runs the q4k_gemv kernels, which dequantize in registers. Prefill
  runs the q4k_gemm kernel's path: one Triton pass dequantizes the matrix to the activation
  dtype, then the framework's dense matmul (cuBLAS on a GPU).
- q/k/v and gate/up are each fused into one matrix, so decode launches one GEMV where it
  would otherwise launch three (or two); packed rows concatenate like any other rows.
- RMSNorm, RoPE and SwiGLU call the rmsnorm, rope and silu_mul kernels. These run Triton on
  GPU tensors and under TRITON_INTERPRET=1, and fall back to their torch paths on plain CPU
  tensors. Each residual add is done by the kernel that normalizes its sum (add_rmsnorm.py):
  a layer hands its last output to the next one unsummed. RoPE writes k and v into the KV
  cache itself (rope_cache.py). Four launches fewer per layer than the unfused ops.
- Attention runs over a static, preallocated KV cache, masked by position, so a decode step
  has fixed shapes and can be captured as a CUDA graph (generate.py). Prefill uses
  F.scaled_dot_product_attention with GQA; a decode token takes decode_attention.py's two
  kernels (rope, the cache write and split-K attention), which replace the rope kernel and the
  six kernels SDPA launched per layer.

The same Transformer built with `ops=TORCH_OPS, dequantize=True` is the plain PyTorch model
(the bf16 prefill baseline). `reference_logits` is a separate fp32 forward on the same
dequantized weights (no cache, explicit softmax), used for the logits check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.llama_q4k.add_rmsnorm import add_rms_norm, torch_add_rms_norm
from kernels.llama_q4k.decode_attention import decode_attention, torch_decode_attention
from kernels.llama_q4k.rope_cache import rope_cache
from kernels.q4k.format import dequantize_q4_k
from kernels.q4k_gemm.q4k_gemm import dequantize_to
from kernels.q4k_gemv.q4k_gemv import q4k_gemv
from kernels.rmsnorm.rmsnorm import rmsnorm
from kernels.rope.rope import rope_inv_freq, torch_rope
from kernels.silu_mul.silu_mul import silu_mul

# Up to 8 rows the q4k_gemv kernels (on Hopper its CUDA kernels, `cuda_path`; its Triton
# kernel otherwise); past that, prefill.
GEMV_MAX_ROWS = 8


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    context_length: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    # The family, as GGUF's general.architecture names it: "llama" (Llama 2/3.x, Mistral),
    # "qwen2" (biases on q, k and v), "qwen3" (an RMSNorm on each head of q and k), "phi3" (a
    # llama whose file fuses q/k/v and gate/up, and keeps Hugging Face's q/k row order).
    arch: str = "llama"
    head_dim_override: int | None = None  # qwen3 and gemma2 set it apart from dim / n_heads
    # gemma2's (gemma.py): attention scores and final logits soft-capped, a sliding window
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    rope_local_theta: float = 10000.0  # gemma3's sliding layers (its global ones: rope_theta)
    # Linear rope scaling ({arch}.rope.scaling.type "linear"): positions divided by this factor;
    # gemma3 applies it to its global layers only. Llama 3.1's scaling is a tensor instead,
    # rope_freqs.weight (see rope_frequencies). With rope_scaling_type "yarn" the factor is
    # YaRN's: each frequency blends interpolated and original by where its wavelength falls
    # against rope_original_context (between yarn_beta_fast and yarn_beta_slow turns).
    rope_scaling_factor: float | None = None
    rope_scaling_type: str | None = None  # None or "linear" (as above), or "yarn"
    rope_original_context: int | None = None  # yarn's, and LongRoPE's switch to its long factors
    rope_attn_factor: float = 1.0  # cos and sin scaled by it (LongRoPE's, from the file)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "gemma3")


def rope_frequencies(
    args: ModelArgs,
    weights: dict[str, Tensor],
    theta: float | None = None,
    scaled: bool = True,
    context: int | None = None,
) -> Tensor:
    """The rope's inverse frequencies as llama.cpp computes them: base `theta` (the file's by
    default), each divided by its factor in `rope_freqs.weight` where the file has one (Llama
    3.1 and later: the converter's llama3 scaling, one factor per frequency), or in LongRoPE's
    `rope_factors_short.weight`, `rope_factors_long.weight` when the KV cache (`context`) is
    longer than the original context, as llama.cpp picks by its context size (Phi-3 128k,
    Phi-3.5); then, where `scaled`, the linear or YaRN scaling."""
    theta = args.rope_theta if theta is None else theta
    inv_freq = rope_inv_freq(args.head_dim, theta)
    factors = weights.get("rope_freqs.weight")
    if factors is None and "rope_factors_short.weight" in weights:
        original = args.rope_original_context or args.context_length
        factors = weights["rope_factors_long.weight" if context is not None and context > original else "rope_factors_short.weight"]
    if factors is not None:
        inv_freq = inv_freq / factors.float().reshape(-1).to(inv_freq.device)
    if scaled and args.rope_scaling_factor:
        if args.rope_scaling_type == "yarn":
            inv_freq = _yarn(inv_freq, args, theta)
        else:
            inv_freq = inv_freq / args.rope_scaling_factor
    return inv_freq


def _yarn(inv_freq: Tensor, args: ModelArgs, theta: float) -> Tensor:
    """YaRN's frequencies: pair i blends interpolated (divided by the factor) and original by a
    ramp over the pairs whose wavelength falls between beta_fast and beta_slow turns of the
    original context (ggml's rope_yarn_corr_dims and rope_yarn_ramp)."""
    assert args.rope_scaling_factor
    dims = args.head_dim
    original = args.rope_original_context or args.context_length

    def pair_turning(turns: float) -> float:
        return dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(0.0, math.floor(pair_turning(args.yarn_beta_fast)))
    high = min(dims - 1.0, math.ceil(pair_turning(args.yarn_beta_slow)))
    pairs = torch.arange(dims // 2, dtype=torch.float32, device=inv_freq.device)
    extrapolate = 1 - ((pairs - low) / max(0.001, high - low)).clamp(0, 1)
    return inv_freq / args.rope_scaling_factor * (1 - extrapolate) + inv_freq * extrapolate


def rope_mscale(args: ModelArgs) -> float:
    """How much the rope scales cos and sin (so q.k by its square): YaRN's 1 + 0.1 ln(factor),
    times the file's attn_factor (LongRoPE's sqrt(1 + ln(scale) / ln(original context)))."""
    mscale = args.rope_attn_factor
    if args.rope_scaling_type == "yarn" and args.rope_scaling_factor and args.rope_scaling_factor > 1:
        mscale *= 1 + 0.1 * math.log(args.rope_scaling_factor)
    return mscale


CONFIGS: dict[str, ModelArgs] = {
    # Q4_K rows hold whole 256-weight blocks, so dim and ffn_dim are multiples of 256.
    "tiny": ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=1024),
    "llama3-8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256
    ),
}


# ---------------------------------------------------------------- elementwise ops


def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype)


def torch_silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


class Ops(NamedTuple):
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    silu_mul: Callable[[Tensor], Tensor]
    # (x + delta, rms_norm(x + delta)): the residual add and the norm after it
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    # rope on q and k with k and v written into the KV cache; returns the rotated q
    rope_cache: Callable[..., Tensor]
    # one decode token per batch row: rope, the cache write and attention over the cache
    decode_attention: Callable[..., Tensor]


# The model's norm weights never change and a decode step's cache is settled when it starts:
# under PDL those reads may start before the kernels ahead of them finish.
KERNEL_OPS = Ops(
    rmsnorm,
    silu_mul,
    partial(add_rms_norm, constant_weight=True),
    rope_cache,
    partial(decode_attention, settled_cache=True),
)
TORCH_OPS = Ops(
    torch_rms_norm,
    torch_silu_mul,
    torch_add_rms_norm,
    partial(rope_cache, rope=torch_rope),
    partial(torch_decode_attention, rope=torch_rope),
)


# ---------------------------------------------------------------- weights


class Q4KLinear(nn.Module):
    """`follows_small_kernel`: in decode every projection comes right after a norm, attention
    or SwiGLU, short kernels beside which the GEMV's CTAs start filling their rings (the
    kernel prefetches deeper there); False for a part that runs after another projection."""

    def __init__(self, packed: Tensor, follows_small_kernel: bool = True) -> None:
        super().__init__()
        self.register_buffer("weight", packed)  # uint8 [out, in / 256 * 144]
        self.follows_small_kernel = follows_small_kernel

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= GEMV_MAX_ROWS:
            out = q4k_gemv(  # parameters: never written
                rows, self.weight, constant_weight=True, follows_small_kernel=self.follows_small_kernel
            )
        else:
            # Prefill: compute-bound from ~60 rows; the dense matmul wants the weights dequantized.
            out = rows @ dequantize_to(self.weight, x.dtype).T
        return out.reshape(*x.shape[:-1], -1)


class DenseLinear(nn.Module):
    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class ConcatLinear(nn.Module):
    """Fused rows whose parts have different formats: one product per part, outputs joined."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def make_linear(
    parts: list[Tensor], dtype: torch.dtype, dequantize: bool, follows_small_kernel: bool = True
) -> nn.Module:
    """One linear over `parts` stacked by rows: Q4_K bytes stay packed unless `dequantize`."""
    if dequantize:
        parts = [dequantize_q4_k(p) if p.dtype == torch.uint8 else p for p in parts]
    packed = [p.dtype == torch.uint8 for p in parts]
    if all(packed):
        return Q4KLinear(torch.cat(parts), follows_small_kernel)
    if not any(packed):
        return DenseLinear(torch.cat([p.to(dtype) for p in parts]))
    # Q4_K_M files keep some attn_v and ffn_down tensors at Q6_K (dequantized at load). The
    # parts run one after another: only the first follows the small kernel before the layer.
    return ConcatLinear(
        [make_linear([p], dtype, False, follows_small_kernel and i == 0) for i, p in enumerate(parts)]
    )


class Embedding(nn.Module):
    def __init__(self, weight: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("weight", weight if weight.dtype == torch.uint8 else weight.to(dtype))

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.weight[tokens]
        if rows.dtype == torch.uint8:  # gather the packed rows, then dequantize only those
            rows = dequantize_q4_k(rows)
        return rows.to(self.dtype)


# ---------------------------------------------------------------- the model


class KVCache(nn.Module):
    def __init__(
        self, batch: int, n_kv_heads: int, max_seq: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v", torch.zeros(shape, dtype=dtype))



class Attention(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        wqkv: nn.Module,
        wo: nn.Module,
        ops: Ops,
        inv_freq: Tensor,
        bias: Tensor | None = None,
        q_norm: Tensor | None = None,
        k_norm: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv, self.wo, self.ops, self.eps = wqkv, wo, ops, args.norm_eps
        self.register_buffer("inv_freq", inv_freq)
        self.register_buffer("bias", bias)  # qwen2's q, k and v biases, or None
        self.register_buffer("q_norm", q_norm)  # qwen3's per-head norms (fp32), or None
        self.register_buffer("k_norm", k_norm)
        self.kv_cache: KVCache | None = None
        # A rope that scales cos and sin by m scales q.k by m^2: q takes it all, as the rope is
        # linear and the cached keys stay as they are.
        self.q_scale = rope_mscale(args) ** 2

    def forward(self, x: Tensor, input_pos: Tensor, mask: Tensor | None) -> Tensor:
        assert self.kv_cache is not None, "call Transformer.setup_caches first"
        batch, seq, _ = x.shape
        qkv = self.wqkv(x)
        if self.bias is not None:
            qkv = qkv + self.bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rope
            q = self.ops.rms_norm(q.reshape(batch, seq, self.n_heads, self.head_dim), self.q_norm, self.eps)
            k = self.ops.rms_norm(k.reshape(batch, seq, self.n_kv_heads, self.head_dim), self.k_norm, self.eps)
            q, k = q.to(v.dtype).reshape(batch, seq, self.q_size), k.to(v.dtype).reshape(batch, seq, self.kv_size)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if seq == 1:  # decode: two launches for rope, the cache write and attention
            y = self.ops.decode_attention(
                input_pos,
                q.reshape(batch, self.n_heads, self.head_dim),
                k.reshape(batch, self.n_kv_heads, self.head_dim),
                v.reshape(batch, self.n_kv_heads, self.head_dim),
                self.inv_freq,
                self.kv_cache.k,
                self.kv_cache.v,
            )
            return self.wo(y.view(batch, 1, self.q_size))

        # One launch rotates q and k and writes k and v into the cache at their positions (the
        # launcher takes [tokens, heads, head_dim] and one position per token).
        q = self.ops.rope_cache(
            input_pos.repeat(batch),
            q.reshape(batch * seq, self.n_heads, self.head_dim),
            k.reshape(batch * seq, self.n_kv_heads, self.head_dim),
            v.reshape(batch * seq, self.n_kv_heads, self.head_dim),
            self.inv_freq,
            self.kv_cache.k,
            self.kv_cache.v,
        )
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_cache.k, self.kv_cache.v
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, w_gate_up: nn.Module, w_down: nn.Module, ops: Ops) -> None:
        super().__init__()
        self.w_gate_up, self.w_down, self.ops = w_gate_up, w_down, ops

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(self.ops.silu_mul(self.w_gate_up(x)))


class TransformerBlock(nn.Module):
    def __init__(
        self,
        attention: Attention,
        feed_forward: FeedForward,
        attn_norm: Tensor,
        ffn_norm: Tensor,
        eps: float,
        ops: Ops,
    ) -> None:
        super().__init__()
        self.attention, self.feed_forward, self.ops, self.eps = attention, feed_forward, ops, eps
        self.register_buffer("attn_norm", attn_norm.float())
        self.register_buffer("ffn_norm", ffn_norm.float())

    def forward(
        self, x: Tensor, delta: Tensor | None, input_pos: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The residual stream is x + delta (delta: the previous layer's last output, or None);
        returns this layer's stream and last output, still unsummed, so that each add is done
        by the kernel that normalizes its result."""
        if delta is None:
            normed = self.ops.rms_norm(x, self.attn_norm, self.eps)
        else:
            x, normed = self.ops.add_rms_norm(x, delta, self.attn_norm, self.eps)
        h, normed = self.ops.add_rms_norm(
            x, self.attention(normed, input_pos, mask), self.ffn_norm, self.eps
        )
        return h, self.feed_forward(normed)


class Transformer(nn.Module):
    """The decoder, built on `device` from GGUF-named weights (see weights.py).

    `weights` maps llama.cpp tensor names to packed Q4_K rows (uint8) or float tensors, on any
    device; they are copied to `device` one matrix at a time. Activations, dense weights and the
    KV cache are in `dtype`; norms and their statistics stay fp32.
    """

    # A decode step (one token per row) takes one position per row: continuous batching.
    per_row_positions = True

    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        ops: Ops = KERNEL_OPS,
        dequantize: bool = False,
    ) -> None:
        super().__init__()
        self.args, self.dtype, self.ops = args, dtype, ops

        def get(name: str) -> Tensor:
            return weights[name].to(device)

        def linear(*names: str) -> nn.Module:
            return make_linear([get(name) for name in names], dtype, dequantize)

        inv_freq = rope_frequencies(args, weights).to(device)
        # LongRoPE's two factor sets: which one runs depends on the cache length (setup_caches)
        self._rope_factors = {
            name: weights[name].float().to(device)
            for name in ("rope_factors_short.weight", "rope_factors_long.weight")
            if name in weights
        }
        layers = []
        for i in range(args.n_layers):
            blk = f"blk.{i}."
            bias = (
                torch.cat([get(blk + f"attn_{p}.bias").to(dtype) for p in "qkv"]) if args.qkv_bias else None
            )
            attention = Attention(
                args,
                linear(blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"),
                linear(blk + "attn_output.weight"),
                ops,
                inv_freq,
                bias,
                get(blk + "attn_q_norm.weight").float() if args.qk_norm else None,
                get(blk + "attn_k_norm.weight").float() if args.qk_norm else None,
            )
            feed_forward = FeedForward(
                linear(blk + "ffn_gate.weight", blk + "ffn_up.weight"),
                linear(blk + "ffn_down.weight"),
                ops,
            )
            attn_norm, ffn_norm = get(blk + "attn_norm.weight"), get(blk + "ffn_norm.weight")
            layers.append(
                TransformerBlock(attention, feed_forward, attn_norm, ffn_norm, args.norm_eps, ops)
            )
        self.layers = nn.ModuleList(layers)

        embedding = get("token_embd.weight")
        if dequantize and embedding.dtype == torch.uint8:
            embedding = dequantize_q4_k(embedding)
        self.tok_embeddings = Embedding(embedding, dtype)
        self.register_buffer("norm", get("output_norm.weight").float())
        self.output = linear("output.weight")
        self.register_buffer("key_positions", torch.zeros(0, dtype=torch.long, device=device))

    def setup_caches(self, batch: int, max_seq: int) -> None:
        device = self.norm.device
        if self._rope_factors:
            inv_freq = rope_frequencies(self.args, self._rope_factors, context=max_seq).to(device)
            for layer in self.layers:
                layer.attention.inv_freq.copy_(inv_freq)
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(
                batch, self.args.n_kv_heads, max_seq, self.args.head_dim, self.dtype
            ).to(device)
        self.key_positions = torch.arange(max_seq, device=device)

    def forward(self, tokens: Tensor, input_pos: Tensor, last_only: bool = False, embeds: Tensor | None = None) -> Tensor:
        """Logits [batch, seq (1 if last_only), vocab] for tokens [batch, seq] at input_pos [seq].

        Positions must be consecutive; keys past each query's position are masked, which also
        hides whatever an earlier, longer sequence left in the cache. `embeds` [batch, seq, dim]
        replaces the token embeddings (a prompt with an image's embeddings in it: vision.py).
        """
        # Prefill's mask [seq, max_seq]; decode masks by position inside its attention kernel.
        mask = self.key_positions[None, :] <= input_pos[:, None] if tokens.shape[1] > 1 else None
        x, delta = (self.tok_embeddings(tokens) if embeds is None else embeds.to(self.dtype)), None
        for layer in self.layers:
            x, delta = layer(x, delta, input_pos, mask)
        if last_only:
            x, delta = x[:, -1:], delta[:, -1:]
        return self.output(self.ops.add_rms_norm(x, delta, self.norm, self.args.norm_eps)[1])


# ---------------------------------------------------------------- the float reference


@torch.no_grad()
def reference_logits(args: ModelArgs, weights: dict[str, Tensor], tokens: Tensor, context: int | None = None) -> Tensor:
    """fp32 logits [batch, seq, vocab] of the whole sequence, on tokens' device. `context`: the
    KV cache length of the model it is compared with (LongRoPE picks its factors by it; default
    the sequence's length).

    Plain PyTorch written apart from the model above, so that a bug in the cache, the mask, the
    fusion or the GQA head mapping shows as a mismatch: no cache, one matrix per GGUF tensor,
    K/V heads repeated by hand, an explicit causal softmax. Every weight is dequantized to
    fp32 as it is used, with the same dequantizer; so differences come from kernel arithmetic.
    """
    device = tokens.device
    batch, seq = tokens.shape
    n_rep = args.n_heads // args.n_kv_heads

    def w(name: str) -> Tensor:
        t = weights[name].to(device)
        return dequantize_q4_k(t) if t.dtype == torch.uint8 else t.float()

    def heads(x: Tensor, n: int) -> Tensor:
        return x.view(batch, seq, n, args.head_dim)

    embedding = weights["token_embd.weight"].to(device)[tokens]
    x = dequantize_q4_k(embedding) if embedding.dtype == torch.uint8 else embedding.float()
    positions = torch.arange(seq, device=device)
    inv_freq = rope_frequencies(args, weights, context=context or seq).to(device)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    for i in range(args.n_layers):
        blk = f"blk.{i}."
        h = torch_rms_norm(x, w(blk + "attn_norm.weight"), args.norm_eps)
        q, k, v = (h @ w(blk + f"attn_{p}.weight").T for p in "qkv")
        if args.qkv_bias:
            q, k, v = (t + w(blk + f"attn_{p}.bias") for t, p in zip((q, k, v), "qkv"))
        q, k, v = heads(q, args.n_heads), heads(k, args.n_kv_heads), heads(v, args.n_kv_heads)
        if args.qk_norm:
            q = torch_rms_norm(q, w(blk + "attn_q_norm.weight"), args.norm_eps)
            k = torch_rms_norm(k, w(blk + "attn_k_norm.weight"), args.norm_eps)
        q, k = torch_rope(positions, q, k, inv_freq)
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * rope_mscale(args) ** 2 / math.sqrt(args.head_dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        attn = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, -1)
        x = x + attn @ w(blk + "attn_output.weight").T

        h = torch_rms_norm(x, w(blk + "ffn_norm.weight"), args.norm_eps)
        gated = F.silu(h @ w(blk + "ffn_gate.weight").T) * (h @ w(blk + "ffn_up.weight").T)
        x = x + gated @ w(blk + "ffn_down.weight").T
    return torch_rms_norm(x, w("output_norm.weight"), args.norm_eps) @ w("output.weight").T
