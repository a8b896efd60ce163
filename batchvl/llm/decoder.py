"""Qwen2 and InternLM2 decoders in one module (they differ only in qkv bias and checkpoint layout).

Packed interface: hidden states are flat [T, hidden] (no padding); `AttnMeta` says where each token sits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchvl.config import LLMConfig
from batchvl.llm.kv_cache import KVPool
from batchvl.ops.decode_attention import decode_attention
from batchvl.ops.fp8 import Fp8Linear, fp8_linear, to_fp8
from batchvl.ops.norm import RMSNorm
from batchvl.ops.prefill_attention import AttnMeta, prefill_attention

_MM_FLOAT_OUT: dict[torch.device, bool] = {}


def mm_float_out_ok(h: torch.Tensor) -> bool:
    """Whether `torch.mm(..., out_dtype=torch.float32)` runs for h (CUDA, bf16/fp16; the op is newer than some
    torches). Probed once per device, outside any CUDA graph capture (during one: False until probed)."""
    if not h.is_cuda or h.dtype not in (torch.bfloat16, torch.float16):
        return False
    if h.device not in _MM_FLOAT_OUT:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            a = torch.ones(2, 16, device=h.device, dtype=h.dtype)
            _MM_FLOAT_OUT[h.device] = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_FLOAT_OUT[h.device] = False
    return _MM_FLOAT_OUT[h.device]


def linear_rows(lin: nn.Module, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """`lin(x)[..., lo:hi]`, computing only those output features (an `nn.Linear` or an `Fp8Linear`)."""
    b = lin.bias[lo:hi] if lin.bias is not None else None
    if isinstance(lin, Fp8Linear):
        return fp8_linear(x, lin.weight[lo:hi], lin.weight_scale[:, lo:hi], b)
    return F.linear(x, lin.weight[lo:hi], b)


class Rotary(nn.Module):
    """RoPE, rotate-half layout (Qwen2 and InternLM2). Linear scaling divides positions; dynamic NTK
    only changes anything past max_position_embeddings, which batchvl refuses (prompts are capped)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.reset()
        scaling = cfg.rope_scaling or {}
        self.pos_scale = 1.0 / scaling["factor"] if scaling.get("type") == "linear" else 1.0
        self.max_pos = cfg.max_position_embeddings if scaling.get("type") == "dynamic" else None

    def reset(self, device: torch.device | None = None) -> None:
        """(Re)compute inv_freq, e.g. after the model was built on the meta device."""
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if device is not None or self.inv_freq.device.type != "meta":
            self.inv_freq = inv.float().to(device or self.inv_freq.device)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [T] -> cos, sin [T, 1, head_dim] (float32)."""
        freqs = (pos.float() * self.pos_scale)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], rotated in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(
            cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x, cos, sin, meta: AttnMeta, kv: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """x [T, hidden]; kv: this layer's pool (k, v), each [blocks, kv_heads, BLOCK, head_dim], or None."""
        t = x.shape[0]
        q_sz, kv_sz = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.qkv(x).split([q_sz, kv_sz, kv_sz], dim=-1)
        q = apply_rope(q.view(t, self.n_heads, self.head_dim), cos, sin)  # [T, heads, head_dim]
        k = apply_rope(k.view(t, self.n_kv, self.head_dim), cos, sin)  # [T, kv_heads, head_dim]
        v = v.view(t, self.n_kv, self.head_dim)
        kc, vc = kv if kv is not None else (None, None)
        if kv is not None:
            kc[meta.slot_b, :, meta.slot_pos] = k
            vc[meta.slot_b, :, meta.slot_pos] = v
        if meta.is_decode:
            o = decode_attention(q, kc, vc, meta.kv_lens, meta.block_table)
        else:
            o = prefill_attention(q, k, v, meta, kc, vc)
        return self.o_proj(o.reshape(t, q_sz))

    def forward_last(
        self, x, cos, sin, meta: AttnMeta, kv: tuple[torch.Tensor, torch.Tensor], last: torch.Tensor
    ) -> torch.Tensor:
        """`forward(...)[last]` for a prefill into the pool, computing only those queries: x [T, hidden], last [B]
        (sequence b's last token) -> [B, hidden]. Every token's k / v still goes into the pool; the B queries then
        attend to their sequences' keys there (`meta.block_table`, `meta.kv_lens`)."""
        t, n = x.shape[0], last.shape[0]
        q_sz, kv_sz = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        k, v = linear_rows(self.qkv, x, q_sz, q_sz + 2 * kv_sz).split([kv_sz, kv_sz], dim=-1)
        k = apply_rope(k.view(t, self.n_kv, self.head_dim), cos, sin)  # [T, kv_heads, head_dim]
        kc, vc = kv
        kc[meta.slot_b, :, meta.slot_pos] = k
        vc[meta.slot_b, :, meta.slot_pos] = v.view(t, self.n_kv, self.head_dim)
        q = linear_rows(self.qkv, x[last], 0, q_sz)  # [B, heads * head_dim]
        q = apply_rope(q.view(n, self.n_heads, self.head_dim), cos[last], sin[last])
        o = decode_attention(q, kc, vc, meta.kv_lens, meta.block_table)  # [B, heads, head_dim]
        return self.o_proj(o.reshape(n, q_sz))


class MLP(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # [gate; up]
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, kv):
        x = x + self.attn(self.input_norm(x), cos, sin, meta, kv)
        return x + self.mlp(self.post_attn_norm(x))

    def forward_last(self, x, cos, sin, meta, kv, last: torch.Tensor) -> torch.Tensor:
        """`forward(...)[last]` (a prefill into a cache; see `Attention.forward_last`): the attention output, the
        residuals and the MLP for the B rows `last` only -> [B, hidden]."""
        x = x[last] + self.attn.forward_last(self.input_norm(x), cos, sin, meta, kv, last)
        return x + self.mlp(self.post_attn_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self._head_padded: torch.Tensor | None = None  # lm_head rows padded in storage (`pad_vocab`)
        # `DecoderLayer.forward` and `.forward_last` as the model builder compiled them (each called with the layer
        # first: one graph serves every layer), or None: eager
        self.compiled_layer: Callable | None = None
        self.compiled_last: Callable | None = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def check_position(self, top: int) -> None:
        """Refuse positions where dynamic-NTK RoPE would start to rescale (batchvl does not implement it)."""
        if self.rotary.max_pos is not None and top >= self.rotary.max_pos:
            raise ValueError(f"position {top} is past max_position_embeddings={self.rotary.max_pos}")

    def forward(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        meta: AttnMeta,
        cache: KVPool | None,
        max_position: int | None = None,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [T, hidden] input embeddings, pos [T] -> final-normed hidden [T, hidden].
        max_position: the largest of `pos` when the caller knows it (no device sync); -1: checked already.
        last: rows [B] (each sequence's last token, in a prefill into `cache`) -> only those rows, [B, hidden]. No
        later layer reads the last layer's outputs, so it computes them for those rows alone (its k / v for all)."""
        if self.rotary.max_pos is not None and max_position != -1:
            self.check_position(int(pos.max()) if max_position is None else max_position)
        if last is not None and (cache is None or meta.is_decode):
            raise ValueError("Decoder(last=...) is for a prefill into a KV cache")
        cos, sin = self.rotary(pos)
        full = len(self.layers) - (last is not None)
        # eager: through the module's call (its hooks run: tools and tests use them)
        layer_fn = self.compiled_layer or (lambda layer, *args: layer(*args))
        for i, layer in enumerate(self.layers[:full]):
            h = layer_fn(layer, h, cos, sin, meta, cache.layer(i) if cache is not None else None)
        if last is not None:
            last_fn = self.compiled_last or DecoderLayer.forward_last
            h = last_fn(self.layers[full], h, cos, sin, meta, cache.layer(full), last)
        return self.norm(h)

    def pad_vocab(self, multiple: int = 128) -> None:
        """Keep lm_head's rows in storage padded to a multiple of `multiple` (zero rows), and multiply by all of
        them. A vocabulary like InternLM2.5's 92 553 makes [T, V] logits rows unaligned, and cuBLAS then picks a
        slow kernel. The parameter stays [V, hidden], a view of the padded storage (tied or not). Call it
        after the model's last `.to()`: the padded storage is a plain attribute, which `.to()` does not move."""
        w = self.lm_head.weight
        vp = -(-w.shape[0] // multiple) * multiple
        if vp == w.shape[0] or self._head_padded is not None:
            return
        padded = torch.zeros(vp, w.shape[1], device=w.device, dtype=w.dtype)
        padded[: w.shape[0]] = w.detach()
        view = nn.Parameter(padded[: w.shape[0]], requires_grad=False)  # same storage as `padded`
        tied = self.embed_tokens.weight is w
        self.lm_head.weight = view
        if tied:
            self.embed_tokens.weight = view
        self._head_padded = padded

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, V] float32. On CUDA the bf16/fp16 product is written in float32 straight from the
        GEMM's accumulator (`mm_float_out_ok`), at the bf16 product's cost: logits rounded to bf16 flip near-ties."""
        v = self.lm_head.weight.shape[0]
        w = self._head_padded if self._head_padded is not None else self.lm_head.weight
        if mm_float_out_ok(h):
            return torch.mm(h, w.t(), out_dtype=torch.float32)[:, :v]  # [T, V_padded] -> [T, V]
        return F.linear(h, w)[:, :v].float()


LLM_LINEARS = ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down")


def fp8_llm(llm: Decoder) -> Decoder:
    """Swap the four linears of every decoder layer for `Fp8Linear`s, in place (on the meta device: empty, for the
    loader to fill); embeddings, norms and lm_head stay as they are. Returns `llm`."""
    to_fp8(llm, [f"layers.{i}.{n}" for i in range(len(llm.layers)) for n in LLM_LINEARS])
    return llm
