"""One decode step of the whole decoder over the sequences in flight: eager, or replayed from a CUDA graph
(gpt-fast's "reduce-overhead", by hand). Decode at 64 layers is thousands of small kernels per token; a graph
launches them as one.

A graph bakes in addresses: the KV pool and the engine's block table never move, so a graph is keyed by the number of
rows alone, padded up to a bucket (`row_bucket`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from batchvl.llm.kv_cache import KVPool
from batchvl.ops.decode_attention import BLOCK
from batchvl.ops.prefill_attention import AttnMeta

log = logging.getLogger(__name__)


def row_bucket(rows: int) -> int:
    """8, 16, 32, ... : the decode graphs' row counts."""
    return max(8, 1 << (rows - 1).bit_length())


def decode_forward(
    llm, tok: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, pool: KVPool
) -> torch.Tensor:
    """tok [R] at positions pos [R], each row's blocks in table [R, W] (row r writes its k / v at pos[r]) ->
    next-token logits [R, V] float32. No host syncs, so it can be captured."""
    rows = tok.shape[0]
    meta = AttnMeta(
        cu_seqlens=torch.arange(rows + 1, device=tok.device, dtype=torch.int32),
        max_seqlen=1,
        slot_b=table.gather(1, (pos // BLOCK)[:, None])[:, 0].long(),
        slot_pos=pos % BLOCK,
        is_decode=True,
        kv_lens=pos + 1,
        block_table=table,
    )
    h = llm(llm.embed_tokens(tok), pos, meta, pool, max_position=-1)  # positions checked by the caller
    return llm.logits(h)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # static inputs, copied into before each replay
    pos: torch.Tensor
    logits: torch.Tensor  # static output, overwritten by each replay


class DecodeStep:
    """`step(tok, pos, table, pool)` = `decode_forward`, through a CUDA graph per row count when `graphs` is on.
    `table` must be a view from row 0 of one persistent tensor, and `pool` the same pool, at every call."""

    def __init__(self, llm, graphs: bool):
        self.llm, self.graphs = llm, graphs
        self.cache: dict[int, _Graph] = {}
        self.mempool = None  # one memory pool for every graph: only one replays at a time
        self.failed: str | None = None  # why capturing failed, if it did (then `graphs` is off)
        self.capture_s = 0.0  # seconds spent capturing (the warm-up's and a job's first steps of each bucket)

    @property
    def captures(self) -> int:
        return len(self.cache)

    def clear(self) -> None:
        """Drop every graph and their memory pool (capturing into a pool whose graphs are gone trips an assert in
        PyTorch's allocator)."""
        self.cache.clear()
        self.mempool = None

    def __call__(
        self, tok: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        if not self.graphs:
            return decode_forward(self.llm, tok, pos, table, pool)
        g = self.cache.get(tok.shape[0])
        if g is None:
            t0 = time.perf_counter()
            try:
                g = self.cache[tok.shape[0]] = self._capture(tok, pos, table, pool)
                torch.cuda.synchronize(tok.device)
                self.capture_s += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a job should slow down, not fail: decode eagerly from now on
                log.warning("CUDA graph capture of the decode step failed (%s: %s); decoding eagerly from now on",
                            type(e).__name__, e)  # fmt: skip
                self.graphs, self.failed = False, f"{type(e).__name__}: {e}"
                self.clear()
                if tok.is_cuda:
                    torch.cuda.synchronize(tok.device)
                return decode_forward(self.llm, tok, pos, table, pool)
        g.tok.copy_(tok)
        g.pos.copy_(pos)
        g.graph.replay()
        return g.logits

    def _capture(self, tok: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, pool: KVPool) -> _Graph:
        """Warm up on a side stream (the step's k / v writes are the ones the replay makes again), then capture.
        thread_local: another thread's CUDA call (e.g. pinning a batch's tiles) does not break the capture."""
        s_tok, s_pos = tok.clone(), pos.clone()
        side = torch.cuda.Stream(tok.device)
        side.wait_stream(torch.cuda.current_stream(tok.device))
        with torch.cuda.stream(side):
            decode_forward(self.llm, s_tok, s_pos, table, pool)
        torch.cuda.current_stream(tok.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.mempool = self.mempool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            logits = decode_forward(self.llm, s_tok, s_pos, table, pool)
        return _Graph(graph, s_tok, s_pos, logits)
