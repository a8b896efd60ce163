"""Admission: which prepared rows the engine prefills next, under budgets that count only the work to be done.

A batch takes rows in arrival order while
- its prompt tokens not served by the prefix cache stay within `max_prefill_tokens`,
- its tiles that need the ViT (each distinct image once) stay within `max_vit_tiles`,
- the engine has a free row and the KV blocks for each (prompt and every new token, less shared prefix blocks;
  blocks that only cached prefixes no row of the batch reads hold count as free).
A single row over a budget runs alone. Rows that do not fit wait for sequences in flight to retire.

Rows reach admission longest `max_new_tokens` first (`longest_first`): a row retires at its own length, so rows
taken in source order leave the longest of the last ones decoding almost alone while the pool drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batchvl.data import SourceRow


def next_batch(ready: deque, engine: Any, max_tokens: int, max_tiles: int) -> list:
    """Pop from `ready` (items with a `.request`) the rows to admit now; [] when the first does not fit yet."""
    batch: list = []
    tokens = tiles = blocks = 0
    images: set[str] = set()
    spare = engine.spare_prefix_blocks()  # blocks only the prefix cache holds: admission takes them back
    rows, free = engine.free_rows(), engine.pool.free + sum(spare.values())
    for it in ready:
        r = it.request
        free -= spare.pop(engine.prefix_hit(r), 0)  # a prefix a row reads stays
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


def longest_first(
    rows: Iterable[SourceRow], length: Callable[[SourceRow], int], cap: int, block: int
) -> Iterator[SourceRow]:
    """`rows` reordered for admission: longest `length` (the row's max_new_tokens) first, ties in source order.

    A row at `cap` (every row without its own max_new_tokens) passes at once: no later row can go before it, so a
    job whose rows have no lengths of their own keeps its source order, with no delay. The other rows are held and
    released in blocks of `block` consecutive held rows, each block sorted; a block goes once `block` more rows are
    held behind it, so the last one, the job's tail, holds block..2*block rows sorted together (a short last block
    would end the job with a few long rows running alone). Holding at most 2*block rows bounds memory on huge
    sources (parquet and hf rows carry their image bytes). An error row whose id a held row has waits right behind
    it (a duplicate is written after its first occurrence); other error rows pass at once."""
    held: list[tuple[int, SourceRow]] = []
    held_ids: dict[str, int] = {}  # id -> length of the held (non-error) row with that id
    for row in rows:
        n = held_ids.get(row.id, cap) if row.error else length(row)
        if n >= cap:
            yield row
            continue
        held.append((n, row))
        if not row.error:
            held_ids[row.id] = n
        if len(held) >= 2 * block:
            yield from _release(held[:block], held_ids)
            del held[:block]
    yield from _release(held, held_ids)


def _release(block: list[tuple[int, SourceRow]], held_ids: dict[str, int]) -> Iterator[SourceRow]:
    for _, row in sorted(block, key=lambda x: -x[0]):  # stable: ties keep source order
        if not row.error:
            held_ids.pop(row.id, None)
        yield row
