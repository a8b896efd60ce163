"""Tensor parallelism for the LLM, applied from outside the model (gpt-fast style).

qkv and gate_up are column-parallel (each rank keeps its heads / its slice of the MLP), o_proj and down are
row-parallel, and each is followed by one all-reduce (the hook below is the only place it happens).
Embedding and lm_head stay replicated. Use `shard_llm` on the meta model before loading, and pass the returned
function to the loader so each rank keeps only its slice of each tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from batchvl.llm.decoder import Decoder


def _all_reduce_hook(group):
    def hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out, group=group)
        return out

    return hook


def shard_llm(llm: Decoder, rank: int, world: int, group=None):
    """Shard `llm` (built on the meta device) in place; returns shard(name, full_tensor) -> this rank's slice."""
    c = llm.cfg
    if world == 1:
        return lambda name, t: t
    for what, n in (
        ("attention heads", c.num_heads),
        ("kv heads", c.num_kv_heads),
        ("MLP size", c.intermediate_size),
    ):
        if n % world:
            raise ValueError(f"LLM tensor parallelism {world} does not divide {what} ({n})")
    nh, nkv, hd, inter = (
        c.num_heads // world,
        c.num_kv_heads // world,
        c.head_dim,
        c.intermediate_size // world,
    )
    dev = llm.embed_tokens.weight.device
    with torch.device(dev):
        for layer in llm.layers:
            a, m = layer.attn, layer.mlp
            a.n_heads, a.n_kv = nh, nkv
            a.qkv = nn.Linear(c.hidden_size, (nh + 2 * nkv) * hd, bias=c.qkv_bias)
            a.o_proj = nn.Linear(nh * hd, c.hidden_size, bias=False)
            m.gate_up = nn.Linear(c.hidden_size, 2 * inter, bias=False)
            m.down = nn.Linear(inter, c.hidden_size, bias=False)
            a.o_proj.register_forward_hook(_all_reduce_hook(group))
            m.down.register_forward_hook(_all_reduce_hook(group))

    q_full, kv_full = c.num_heads * hd, c.num_kv_heads * hd

    def rows(t: torch.Tensor, start: int, size: int, chunk: int) -> torch.Tensor:
        return t[start + rank * chunk : start + (rank + 1) * chunk] if size else t

    def shard(name: str, t: torch.Tensor) -> torch.Tensor:
        """`name` is the whole model's parameter name (llm.layers.N....)."""
        if not name.startswith("llm.layers."):
            return t
        if name.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
            return torch.cat(
                [
                    rows(t, 0, q_full, nh * hd),
                    rows(t, q_full, kv_full, nkv * hd),
                    rows(t, q_full + kv_full, kv_full, nkv * hd),
                ]
            )
        if name.endswith(".mlp.gate_up.weight"):
            return torch.cat([rows(t, 0, 1, inter), rows(t, c.intermediate_size, 1, inter)])
        if name.endswith(".attn.o_proj.weight"):
            return t[:, rank * nh * hd : (rank + 1) * nh * hd]
        if name.endswith(".mlp.down.weight"):
            return t[:, rank * inter : (rank + 1) * inter]
        return t

    return shard
