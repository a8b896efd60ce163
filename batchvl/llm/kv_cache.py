"""A KV cache for one batch: a row per request, padded to the longest request plus the decode steps.

`KVArena` hands out those caches as views of one pair of flat buffers, so two batches of the same (rows, max_len)
use the same addresses: a decode step captured in a CUDA graph for one batch replays for the next.
"""

from __future__ import annotations

import torch


class KVCache:
    """k, v: [layers, rows, kv_heads, max_len, head_dim] (heads before positions, as attention reads them)."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        device,
        dtype,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
        clear: bool = True,
    ):
        shape = (num_layers, rows, kv_heads, max_len, head_dim)
        # zeros, not empty: the reference decode attention (masked SDPA) multiplies masked-out slots by 0 (0 * NaN
        # would be NaN)
        if storage is None:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        else:  # views of an arena's buffers, cleared unless `clear` is off (a previous batch left its values there)
            self.k, self.v = (s.view(shape).zero_() if clear else s.view(shape) for s in storage)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def set_prefix(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy a cached prefix's k/v [layers, kv_heads, P, head_dim] into the start of `row`."""
        self.k[:, row, :, : k.shape[2]] = k
        self.v[:, row, :, : v.shape[2]] = v

    def prefix(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of `row`, [layers, kv_heads, length, head_dim] copies."""
        return self.k[:, row, :, :length].clone(), self.v[:, row, :, :length].clone()


class KVArena:
    """Flat k/v buffers that every batch's KVCache views from their start. It grows when a batch needs more
    (and bumps `generation`: whatever captured the old addresses is stale); it never shrinks.
    clear: zero each batch's view (the reference decode attention reads every slot); off where nothing reads a slot
    past a row's length (the Triton decode kernel): then only a new buffer is zeroed. At the 8B seed job's shapes the
    per-batch clear wrote 10.7 GB."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device, dtype, clear: bool = True):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.device, self.dtype, self.clear = torch.device(device), dtype, clear
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.generation = 0

    def cache(self, rows: int, max_len: int) -> KVCache:
        n = self.num_layers * rows * self.kv_heads * max_len * self.head_dim
        if self.k is None or self.k.numel() < n:
            self.k = self.v = None  # let the old buffers go before the new ones are allocated
            self.k = torch.zeros(n, device=self.device, dtype=self.dtype)
            self.v = torch.zeros(n, device=self.device, dtype=self.dtype)
            self.generation += 1
        return KVCache(
            self.num_layers,
            rows,
            max_len,
            self.kv_heads,
            self.head_dim,
            self.device,
            self.dtype,
            storage=(self.k[:n], self.v[:n]),
            clear=self.clear,
        )
