"""Greedy and temperature / top-p sampling, each row from its own random stream.

A row's draws are a pure function of (its seed, the index of the token being drawn, the token id): counter-based
noise (splitmix64 in int64 arithmetic, exact on every device), so a row samples the same tokens whatever rows share
its batch, after a resume and on any number of ranks.
"""

from __future__ import annotations

import hashlib

import torch

ROWS_PER_DRAW = 64  # rows whose [rows, vocab] noise is made at once (int64: 77 MB for a 151k vocabulary)


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _C1, _C2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def row_seed(seed: int, key: str) -> int:
    """A row's stream: 63 bits of blake2b(job seed, row id)."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (multiplies wrap; the masks make the shifts logical)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _C1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _C2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 in (0, 1): row b's draw for token `steps[b]` of its stream `seeds[b]` (int64 [B])."""
    base = _mix(seeds * _GOLDEN + steps)
    token = torch.arange(1, vocab + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN
    x = _mix(base[:, None] + token[None, :])
    return (((x >> 40) & ((1 << 24) - 1)).float() + 0.5) / (1 << 24)


def probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[B, V] float32: softmax(logits / temperature), cut to the top-p nucleus and renormalized."""
    x = logits.float()
    # shift by the max first: at a tiny temperature x / t overflows to inf and the softmax to NaN
    probs = torch.softmax((x - x.amax(-1, keepdim=True)) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p * keep)
    return probs / probs.sum(-1, keepdim=True)


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64). temperature 0 is greedy; otherwise the exponential race
    argmax(p / E), E ~ Exp(1) from each row's own stream, which draws token i with probability p_i."""
    if temperature <= 0:
        return logits.argmax(-1)
    out = []
    for i in range(0, logits.shape[0], ROWS_PER_DRAW):
        probs = probabilities(logits[i : i + ROWS_PER_DRAW], temperature, top_p)
        race = -torch.log(
            uniforms(seeds[i : i + ROWS_PER_DRAW], steps[i : i + ROWS_PER_DRAW], probs.shape[-1])
        )
        out.append((probs / race).argmax(-1))
    return torch.cat(out)


def sample_rows(logits: torch.Tensor, settings: list, seeds: list[int], steps: list[int]) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: row b with settings[b].temperature / .top_p (greedy at 0), drawing token
    number steps[b] of its stream seeds[b]."""
    out = logits.argmax(-1)
    groups: dict[tuple[float, float], list[int]] = {}
    for b, s in enumerate(settings):
        if s.temperature > 0:
            groups.setdefault((s.temperature, s.top_p), []).append(b)
    dev = logits.device
    for (temperature, top_p), rows in groups.items():
        idx = torch.tensor(rows, device=dev)
        seed_t = torch.tensor([seeds[b] for b in rows], dtype=torch.int64, device=dev)
        step_t = torch.tensor([steps[b] for b in rows], dtype=torch.int64, device=dev)
        out[idx] = sample(logits[idx], temperature, top_p, seed_t, step_t)
    return out
