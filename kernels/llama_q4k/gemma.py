"""Gemma 2 and 3 on the same weights and linears as the Llama model (model.py), where they differ:

- embeddings scaled by sqrt(dim);
- "sandwich" norms: each sublayer's output is normalized again (post_attention_norm,
  post_ffw_norm) before it joins the residual stream;
- GeGLU (tanh-approximated GELU of the gate, times up) instead of SwiGLU;
- attention scores scaled by 1/sqrt(head_dim), soft-capped (cap * tanh(s / cap)) before the
  mask, with a sliding window on every other layer (the even ones, as transformers and
  llama.cpp count them);
- the final logits soft-capped too; the output matrix is the embedding's.

Gemma 3 drops the soft-caps, normalizes each head of q and k (like Qwen 3), makes five layers
in six local (sliding window, rope base 10 000) and the sixth global (the file's rope base).

GGUF stores Gemma's norm weights with the 1 added (llama.cpp's converter does it), so every norm
here is x * rsqrt(mean(x^2) + eps) * w, as in the Llama model. Attention is written out in
PyTorch (scaled_dot_product_attention has no soft-cap): the Q4_K linears are the fast part here,
the attention kernels of model.py are not used.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.llama_q4k.model import Embedding, KVCache, ModelArgs, make_linear, rope_frequencies, torch_rms_norm
from kernels.q4k.format import dequantize_q4_k
from kernels.rope.rope import torch_rope


def softcap(x: Tensor, cap: float | None) -> Tensor:
    return x if not cap else cap * torch.tanh(x / cap)


def sliding_layer(index: int, args: ModelArgs) -> bool:
    if not args.sliding_window:
        return False
    return (index + 1) % 6 != 0 if args.arch == "gemma3" else index % 2 == 0


class GemmaAttention(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        index: int,
        wqkv: nn.Module,
        wo: nn.Module,
        inv_freq: Tensor,
        q_norm: Tensor | None = None,
        k_norm: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.args, self.index = args, index
        self.q_size, self.kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv, self.wo = wqkv, wo
        self.register_buffer("inv_freq", inv_freq)
        self.register_buffer("q_norm", q_norm)  # gemma3's per-head norms, or None
        self.register_buffer("k_norm", k_norm)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, input_pos: Tensor) -> Tensor:
        assert self.kv_cache is not None, "call setup_caches first"
        args, (batch, seq, _) = self.args, x.shape
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(batch, seq, args.n_heads, args.head_dim)
        k = k.reshape(batch, seq, args.n_kv_heads, args.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = torch_rms_norm(q, self.q_norm, args.norm_eps).to(x.dtype)
            k = torch_rms_norm(k, self.k_norm, args.norm_eps).to(x.dtype)
        cache = self.kv_cache
        v = v.reshape(batch, seq, args.n_kv_heads, args.head_dim)
        if seq == 1 and input_pos.numel() == batch > 1:
            # A decode step with one position per row (continuous batching): the rows are the
            # rope's sequence, and each row writes its own cache position.
            q, k = (t.transpose(0, 1) for t in torch_rope(input_pos, q.transpose(0, 1), k.transpose(0, 1), self.inv_freq))
            rows = torch.arange(batch, device=x.device)
            cache.k[rows, :, input_pos] = k[:, 0].to(cache.k.dtype)
            cache.v[rows, :, input_pos] = v[:, 0].to(cache.v.dtype)
            query_pos = input_pos[:, None]  # [batch, 1]
        else:
            q, k = torch_rope(input_pos, q, k, self.inv_freq)
            cache.k[:, :, input_pos] = k.transpose(1, 2).to(cache.k.dtype)
            cache.v[:, :, input_pos] = v.transpose(1, 2).to(cache.v.dtype)
            query_pos = input_pos[None, :]  # [1, seq]
        keys = cache.k.repeat_interleave(args.n_heads // args.n_kv_heads, dim=1).float()
        values = cache.v.repeat_interleave(args.n_heads // args.n_kv_heads, dim=1).float()
        scores = torch.einsum("bqhd,bhkd->bhqk", q.float(), keys) / math.sqrt(args.head_dim)
        scores = softcap(scores, args.attn_logit_softcap)
        positions = torch.arange(keys.shape[2], device=x.device)
        visible = positions <= query_pos[..., None]  # [batch or 1, seq, keys]
        if sliding_layer(self.index, args):
            visible &= positions > query_pos[..., None] - int(args.sliding_window or 0)
        probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
        y = torch.einsum("bhqk,bhkd->bqhd", probs, values).reshape(batch, seq, self.q_size)
        return self.wo(y.to(x.dtype))


class GemmaBlock(nn.Module):
    def __init__(self, attention: GemmaAttention, w_gate_up: nn.Module, w_down: nn.Module, norms: dict[str, Tensor], eps: float) -> None:
        super().__init__()
        self.attention, self.w_gate_up, self.w_down, self.eps = attention, w_gate_up, w_down, eps
        for name, weight in norms.items():
            self.register_buffer(name, weight.float())

    def forward(self, x: Tensor, input_pos: Tensor) -> Tensor:
        h = torch_rms_norm(x, self.attn_norm, self.eps)
        x = x + torch_rms_norm(self.attention(h, input_pos), self.post_attention_norm, self.eps)
        gate, up = self.w_gate_up(torch_rms_norm(x, self.ffn_norm, self.eps)).float().chunk(2, dim=-1)
        ffn = self.w_down((F.gelu(gate, approximate="tanh") * up).to(x.dtype))
        return x + torch_rms_norm(ffn, self.post_ffw_norm, self.eps)


class GemmaTransformer(nn.Module):
    """Gemma 2 or 3 from GGUF-named weights (see weights.py); the interface of model.Transformer,
    a decode step included: tokens [batch, 1] at one position per row."""

    per_row_positions = True

    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        dequantize: bool = False,
        **_: object,
    ) -> None:
        super().__init__()
        self.args, self.dtype = args, dtype

        def get(name: str) -> Tensor:
            return weights[name].to(device)

        def linear(*names: str) -> nn.Module:
            return make_linear([get(name) for name in names], dtype, dequantize)

        # gemma3 4B and larger scale the rope of their global layers only (linear, factor 8)
        global_freq = rope_frequencies(args, weights).to(device)
        local_freq = rope_frequencies(args, weights, args.rope_local_theta, scaled=False).to(device)
        layers = []
        for i in range(args.n_layers):
            blk = f"blk.{i}."
            local = args.arch == "gemma3" and sliding_layer(i, args)
            attention = GemmaAttention(
                args,
                i,
                linear(blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"),
                linear(blk + "attn_output.weight"),
                local_freq if local else global_freq,
                get(blk + "attn_q_norm.weight").float() if args.qk_norm else None,
                get(blk + "attn_k_norm.weight").float() if args.qk_norm else None,
            )
            norms = {n: get(blk + n + ".weight") for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")}
            layers.append(
                GemmaBlock(attention, linear(blk + "ffn_gate.weight", blk + "ffn_up.weight"), linear(blk + "ffn_down.weight"), norms, args.norm_eps)
            )
        self.layers = nn.ModuleList(layers)
        embedding = get("token_embd.weight")
        if dequantize and embedding.dtype == torch.uint8:
            embedding = dequantize_q4_k(embedding)
        self.tok_embeddings = Embedding(embedding, dtype)
        self.register_buffer("norm", get("output_norm.weight").float())
        self.output = linear("output.weight")

    def setup_caches(self, batch: int, max_seq: int) -> None:
        device = self.norm.device
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, self.args.n_kv_heads, max_seq, self.args.head_dim, self.dtype).to(device)

    def forward(self, tokens: Tensor, input_pos: Tensor, last_only: bool = False) -> Tensor:
        x = self.tok_embeddings(tokens)
        x = x * torch.tensor(self.args.dim**0.5, dtype=x.dtype)  # in the activations' dtype, as Gemma does
        for layer in self.layers:
            x = layer(x, input_pos)
        if last_only:
            x = x[:, -1:]
        logits = self.output(torch_rms_norm(x, self.norm, self.args.norm_eps).to(x.dtype))
        return softcap(logits.float(), self.args.final_logit_softcap)
