"""What a model takes on one GPU: weights by part, activations at a prefill budget, and KV bytes per token.

Weights are counted on the meta model (exact parameter counts, nothing allocated). The engine sizes its KV pool from
the memory left after loading with `activation_bytes` from here; the builder refuses, before loading anything, a model
whose weights and smallest working set do not fit (`check_fits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchvl.config import InternVLConfig
from batchvl.llm.decoder import LLM_LINEARS
from batchvl.llm.kv_cache import KVPool
from batchvl.ops.decode_attention import BLOCK

GIB = 2**30
MIN_PREFILL_TOKENS = 4096  # the engine's smallest automatic prefill budget


def activation_bytes(
    cfg: InternVLConfig, dtype: torch.dtype, prefill_tokens: int, vit_tiles: int, quantization: str = "none"
) -> int:
    """Rough peak of one prefill batch of `prefill_tokens` or one ViT call of `vit_tiles` tiles (the MLPs dominate).
    FP8: the down projection's input is also held in e4m3 and, where unfused (eager), in fp32 (5 B per element)."""
    c, v, el = cfg.llm, cfg.vision, torch.empty((), dtype=dtype).element_size()
    per_token = (3 * c.intermediate_size + 6 * c.hidden_size) * el
    if quantization == "fp8":
        per_token += 5 * c.intermediate_size
    tokens = vit_tiles * (v.num_patches + 1)
    return max(prefill_tokens * per_token, tokens * (2 * v.intermediate_size + 6 * v.hidden_size) * el)


@dataclass
class MemoryPlan:
    """Bytes on one GPU (one rank's share under tensor parallelism)."""

    llm_linears: int  # the decoder layers' qkv, o_proj, gate_up and down weights (+ their FP8 scales)
    llm_other: int  # embeddings, lm_head, norms, biases
    vit: int  # ViT + projector
    activations: int  # at `prefill_tokens`
    prefill_tokens: int
    kv_per_token: int  # every layer's k and v of one token
    dtype: torch.dtype
    quantization: str

    @property
    def weights(self) -> int:
        return self.llm_linears + self.llm_other + self.vit

    def describe(self) -> str:
        q = "FP8 e4m3 + scales" if self.quantization == "fp8" else str(self.dtype).removeprefix("torch.")
        return (
            f"weights {self.weights / GIB:.1f} GiB (LLM linears {self.llm_linears / GIB:.1f} in {q}, embeddings + "
            f"lm_head + norms {self.llm_other / GIB:.1f}, ViT + projector {self.vit / GIB:.1f}), activations "
            f"{self.activations / GIB:.1f} GiB at {self.prefill_tokens} prefill tokens, KV "
            f"{self.kv_per_token / 2**10:.0f} KiB per token"
        )


def memory_plan(
    cfg: InternVLConfig,
    dtype: torch.dtype,
    quantization: str = "none",
    prefill_tokens: int = MIN_PREFILL_TOKENS,
    vit_tiles: int = 64,
    tp: int = 1,
) -> MemoryPlan:
    """The weights of `cfg` in `dtype` (the decoder linears in FP8 under quantization "fp8"; under tensor parallelism
    `tp` ranks share the decoder linears and the KV heads), activations and KV bytes per token."""
    from batchvl.model.loader import build_empty  # the loader imports the decoder, as this module does

    el = torch.empty((), dtype=dtype).element_size()
    linears = other = vit = 0
    for name, p in build_empty(cfg).named_parameters():  # tied weights counted once
        if name.startswith("vision."):
            vit += p.numel() * el
        elif name.startswith("llm.layers.") and name.endswith(tuple(f".{n}.weight" for n in LLM_LINEARS)):
            rows = p.shape[0]
            linears += (p.numel() + 4 * rows if quantization == "fp8" else p.numel() * el) // tp
        else:
            other += p.numel() * el
    c = cfg.llm
    kv = KVPool.bytes_per_block(c.num_layers, c.num_kv_heads // tp, c.head_dim, dtype) // BLOCK
    act = activation_bytes(cfg, dtype, prefill_tokens, vit_tiles, quantization)
    return MemoryPlan(linears, other, vit, act, prefill_tokens, kv, dtype, quantization)


def check_fits(plan: MemoryPlan, free: int, what: str) -> None:
    """MemoryError, with the breakdown, when the weights, the activations and the KV of one prefill batch take more
    than `free` bytes (the least a job runs with). `what` names the model in the message."""
    kv = plan.prefill_tokens * plan.kv_per_token
    need = plan.weights + plan.activations + kv
    if need > free:
        raise MemoryError(
            f"{what} needs at least {need / GIB:.1f} GiB: {plan.describe()}, so {kv / GIB:.1f} GiB of KV for one "
            f"prefill batch; the GPU has {free / GIB:.1f} GiB free. Set model.quantization: fp8 (the LLM's linears "
            f"at 1 byte per weight), model.tp: N, or a smaller engine.max_prefill_tokens"
        )
