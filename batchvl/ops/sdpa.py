"""Which SDPA kernel runs: one backend tried first, torch's others as the fallback."""

from __future__ import annotations

import contextlib
import inspect

import torch


def sdpa_context(
    backend: str = "auto", device: torch.device | str = "cpu"
) -> contextlib.AbstractContextManager:
    """Prefer one SDPA backend ("flash" | "cudnn" | "efficient" | "math"); "auto" keeps torch's choice."""
    if backend == "auto" or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    first = names[backend]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        rest = [b for b in names.values() if b != first]
        return sdpa_kernel([first, *rest], set_priority=True)  # falls back if `first` can't take the shape
    return sdpa_kernel([first])
