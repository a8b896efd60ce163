"""One decode step of the whole decoder: eager, or replayed from a CUDA graph (gpt-fast's "reduce-overhead",
by hand). Decode at 64 layers is thousands of small kernels per token; a graph launches them as one.

A graph bakes in addresses, so it is keyed by the KV cache's shape and buffers: `KVArena` gives every batch of
the same padded (rows, max_len) the same buffers, so a graph captured for one batch replays for the next.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from batchvl.llm.kv_cache import KVCache
from batchvl.ops.prefill_attention import AttnMeta

log = logging.getLogger(__name__)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def decode_forward(llm, tok: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """tok [R] at positions pos [R] (row r writes its k/v at pos[r]) -> next-token logits [R, V] float32.
    No host syncs, so it can be captured."""
    rows = tok.shape[0]
    idx = torch.arange(rows, device=tok.device)
    meta = AttnMeta(
        cu_seqlens=torch.arange(rows + 1, device=tok.device, dtype=torch.int32),
        max_seqlen=1,
        slot_b=idx,
        slot_pos=pos,
        is_decode=True,
        kv_lens=pos + 1,
    )
    h = llm(llm.embed_tokens(tok), pos, meta, cache, max_position=-1)  # positions checked by the caller
    return llm.logits(h)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # static inputs, copied into before each replay
    pos: torch.Tensor
    logits: torch.Tensor  # static output, overwritten by each replay


class DecodeStep:
    """`step(tok, pos, cache)` = `decode_forward`, through a CUDA graph per cache shape when `graphs` is on."""

    def __init__(self, llm, graphs: bool, max_graphs: int = 16):
        self.llm, self.graphs, self.max_graphs = llm, graphs, max_graphs
        self.cache: OrderedDict[tuple, _Graph] = OrderedDict()
        self.captures = 0
        self.failed: str | None = None  # why capturing failed, if it did (then `graphs` is off)

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not self.graphs:
            return decode_forward(self.llm, tok, pos, cache)
        key = (tuple(cache.k.shape), cache.k.data_ptr(), cache.v.data_ptr(), tok.dtype)
        g = self.cache.get(key)
        if g is None:
            try:
                g = self._capture(tok, pos, cache)
            except Exception as e:  # noqa: BLE001 - a job should slow down, not fail: decode eagerly from now on
                log.warning(
                    "CUDA graph capture of the decode step failed (%s: %s); decoding eagerly from now on",
                    type(e).__name__,
                    e,
                )
                self.graphs, self.failed = False, f"{type(e).__name__}: {e}"
                self.cache.clear()
                if tok.is_cuda:
                    torch.cuda.synchronize(tok.device)
                return decode_forward(self.llm, tok, pos, cache)
            self.cache[key] = g
            while len(self.cache) > self.max_graphs:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        g.tok.copy_(tok)
        g.pos.copy_(pos)
        g.graph.replay()
        return g.logits

    def _capture(self, tok: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> _Graph:
        """Warm up on a side stream (the step's k/v writes are the ones the replay makes again), then capture."""
        s_tok, s_pos = tok.clone(), pos.clone()
        side = torch.cuda.Stream(tok.device)
        side.wait_stream(torch.cuda.current_stream(tok.device))
        with torch.cuda.stream(side):
            decode_forward(self.llm, s_tok, s_pos, cache)
        torch.cuda.current_stream(tok.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = decode_forward(self.llm, s_tok, s_pos, cache)
        self.captures += 1
        return _Graph(graph, s_tok, s_pos, logits)
