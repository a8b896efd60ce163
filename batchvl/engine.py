"""The engine: one batch of prepared requests in, generated tokens and stage times out.

The pipeline (jobs, queues, Parquet) talks to the model only through `Engine.run_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """One prepared row: token ids with <IMG_CONTEXT> placeholders, and its tiles."""

    input_ids: torch.Tensor  # [L] int64, CPU
    pixel_values: torch.Tensor | None = None  # [tiles, 3, 448, 448] float32, CPU
    image_key: str | None = None  # content hash of the image(s) + tiling, for the embedding cache


@dataclass
class Sampling:
    max_new_tokens: int = 4
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class BatchResult:
    output_ids: list[list[int]]
    vit_ms: float  # GPU time of the ViT + projector for the whole batch (CUDA events on GPU)
    prefill_ms: float
    decode_ms: float
    first_token_s: float  # time.perf_counter() when the first tokens were on the host
    end_s: float  # time.perf_counter() when the last tokens were on the host
    stats: dict = field(default_factory=dict)  # cache hits, tokens, etc.
