"""The paged KV pool shared by every sequence in flight.

k, v: [layers, blocks, kv_heads, BLOCK, head_dim] (heads before slots, as attention reads them). A sequence holds a
list of blocks (its row of the engine's block table); position p sits in its block p // BLOCK at slot p % BLOCK.
Blocks are handed out with reference counts, so the blocks of a shared prefix serve several sequences and go back
to the free list when the last of them lets go. Block 0 is never handed out: a decode step's padding rows write there.
"""

from __future__ import annotations

import torch

from batchvl.ops.decode_attention import BLOCK


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, head_dim: int, device, dtype) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks, got {num_blocks}")
        shape = (num_layers, num_blocks, kv_heads, BLOCK, head_dim)
        # zeros, not empty: the reference decode attention reads masked slots too (0 * NaN would be NaN)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # block 0: scratch

    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * BLOCK * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    @property
    def free(self) -> int:
        """Blocks that can be handed out now."""
        return len(self._free)

    def limit(self, num_blocks: int) -> None:
        """Hand out no block from `num_blocks` on (the ranks of a tensor-parallel group must admit alike)."""
        self._free = [b for b in self._free if b < num_blocks]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool: {n} blocks asked for, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def retain(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)
