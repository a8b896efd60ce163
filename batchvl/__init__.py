"""batchvl: batch offline inference for InternVL2.5. `from batchvl import Pipeline` is the Python API (batchvl.api)."""

from typing import Any

__all__ = ["Pipeline"]


def __getattr__(name: str) -> Any:
    # imported on first use: `import batchvl` (and so every preprocess worker) stays free of torch
    if name == "Pipeline":
        from batchvl.api import Pipeline

        return Pipeline
    raise AttributeError(f"module 'batchvl' has no attribute {name!r}")
