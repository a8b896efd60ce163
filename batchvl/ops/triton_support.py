"""Triton where it is installed; `interpreting()` when its interpreter runs the kernels on the CPU (tests)."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every op runs its reference
    triton = tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(x) -> bool:
    """Whether a Triton kernel can take tensor x: on CUDA, or anywhere under the interpreter."""
    return triton is not None and (x.is_cuda or interpreting())
