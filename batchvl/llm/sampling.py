"""Greedy and temperature / top-p sampling with a seeded generator."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def sample_rows(logits: torch.Tensor, settings: list, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B], row b sampled with settings[b].temperature / .top_p (greedy at 0)."""
    out = logits.argmax(-1)
    groups: dict[tuple[float, float], list[int]] = {}
    for b, s in enumerate(settings):
        if s.temperature > 0:
            groups.setdefault((s.temperature, s.top_p), []).append(b)
    for (temperature, top_p), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = sample(logits[idx], temperature, top_p, generator)
    return out
