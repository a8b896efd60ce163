"""Admission: which prepared rows the engine prefills next, under budgets that count only the work to be done.

A batch takes rows in arrival order while
- its prompt tokens not served by the prefix cache stay within `max_prefill_tokens`,
- its tiles that need the ViT (each distinct image once) stay within `max_vit_tiles`,
- the engine has a free row and the KV blocks for each (prompt and every new token, less shared prefix blocks).
A single row over a budget runs alone. Rows that do not fit wait for sequences in flight to retire.
"""

from __future__ import annotations

from collections import deque
from typing import Any


def next_batch(ready: deque, engine: Any, max_tokens: int, max_tiles: int) -> list:
    """Pop from `ready` (items with a `.request`) the rows to admit now; [] when the first does not fit yet."""
    batch: list = []
    tokens = tiles = blocks = 0
    images: set[str] = set()
    rows, free = engine.free_rows(), engine.pool.free
    for it in ready:
        r = it.request
        n = r.input_ids.shape[0] - engine.cached_tokens(r)
        units = r.image_units() if engine.needs_vit(r) else []
        own = {key or f"#{id(r)}.{j}": count for j, (key, _, count) in enumerate(units)}  # image -> its tiles
        t = sum(count for key, count in own.items() if key not in images)
        b = engine.blocks_needed(r)
        if batch and (tokens + n > max_tokens or tiles + t > max_tiles):
            break
        if len(batch) + 1 > rows or blocks + b > free:
            break
        batch.append(it)
        tokens, tiles, blocks = tokens + n, tiles + t, blocks + b
        images.update(own)
        if tokens >= max_tokens or tiles >= max_tiles:
            break
    for _ in batch:
        ready.popleft()
    return batch
