"""A KV cache for one batch: a row per request, padded to the longest request plus the decode steps."""

from __future__ import annotations

import torch


class KVCache:
    """k, v: [layers, rows, kv_heads, max_len, head_dim] (heads before positions, as attention reads them)."""

    def __init__(self, num_layers: int, rows: int, max_len: int, kv_heads: int, head_dim: int, device, dtype):
        shape = (num_layers, rows, kv_heads, max_len, head_dim)
        # zeros, not empty: masked-out slots still enter the attention matmul (0 * NaN would be NaN)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(
        self, layer: int, slot_b: torch.Tensor, slot_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """Scatter k/v [T, kv_heads, head_dim] into (row, position) slots."""
        self.k[layer][slot_b, :, slot_pos] = k
        self.v[layer][slot_b, :, slot_pos] = v

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def set_prefix(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy a cached prefix's k/v [layers, kv_heads, P, head_dim] into the start of `row`."""
        self.k[:, row, :, : k.shape[2]] = k
        self.v[:, row, :, : v.shape[2]] = v

    def prefix(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of `row`, [layers, kv_heads, length, head_dim] copies."""
        return self.k[:, row, :, :length].clone(), self.v[:, row, :, :length].clone()
