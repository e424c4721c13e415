"""Paged KV cache: the per-layer cache tensors and the block allocator with block tables.

Cache tensors are ``[num_blocks, block_size, kv_heads, head_dim]`` per layer for K and V.
Block 0 is the null block (padding writes land there, padded table entries read it).
Block tables live in one ``[max_seqs, max_blocks_per_seq]`` int64 matrix, one row per
running sequence (its ``slot``), so the runner builds a batch's tables with one gather.
"""
from __future__ import annotations

import numpy as np
import torch

from .sequence import Sequence

NULL_BLOCK = 0


def _lazy_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU buffer whose pages are only made resident when written.

    ``torch.zeros`` writes every byte (a 1 GiB cache would be 1 GiB of RSS at once);
    ``calloc`` of a large block maps fresh zero pages lazily. Zero (not garbage) matters:
    masked-out cache slots are still read by the reference attention."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(numel * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)


class PagedKVCache:
    """The cache tensors themselves, one buffer for all layers (zeroed, resident as used)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        per = num_blocks * block_size * num_kv_heads * head_dim
        if torch.device(device).type == "cpu":
            buf = _lazy_zeros(2 * num_layers * per, dtype)
        else:
            buf = torch.zeros(2 * num_layers * per, dtype=dtype, device=device)
        views = buf.view(2, num_layers, *shape)
        self.k = list(views[0].unbind(0))
        self.v = list(views[1].unbind(0))
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class BlockManager:
    """Allocates cache blocks to sequences and keeps their block tables."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._free_blocks: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._free_slots: list[int] = list(range(max_seqs - 1, -1, -1))
        self.block_tables = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int64)
        self.num_seq_blocks = np.zeros(max_seqs, dtype=np.int64)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        return bool(self._free_slots) and self.blocks_needed(num_tokens) + reserve <= len(self._free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` a slot and enough blocks for ``num_tokens`` tokens."""
        n = self.blocks_needed(num_tokens)
        if n > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq.request_id} needs {n} blocks, more than {self.max_blocks_per_seq}")
        if not self._free_slots or n > len(self._free_blocks):
            raise RuntimeError("out of KV cache blocks")
        slot = self._free_slots.pop()
        blocks = [self._free_blocks.pop() for _ in range(n)]
        self.block_tables[slot, :n] = blocks
        self.num_seq_blocks[slot] = n
        seq.slot = slot

    def can_append(self, seqs: list[Sequence]) -> bool:
        return self._blocks_to_grow(seqs) <= len(self._free_blocks)

    def _blocks_to_grow(self, seqs) -> int:
        return sum(1 for s in seqs if self.blocks_needed(s.num_tokens) > self.num_seq_blocks[s.slot])

    def may_append(self, seqs: list[Sequence]) -> None:
        """Make room for each sequence's next token (a new block when it crosses a boundary)."""
        for s in seqs:
            need = self.blocks_needed(s.num_tokens)
            have = int(self.num_seq_blocks[s.slot])
            if need > have:
                if need > self.max_blocks_per_seq:
                    raise ValueError(f"sequence {s.request_id} exceeds {self.max_blocks_per_seq} blocks")
                self.block_tables[s.slot, have] = self._free_blocks.pop()
                self.num_seq_blocks[s.slot] = need

    def free(self, seq: Sequence) -> None:
        if seq.slot < 0:
            return
        n = int(self.num_seq_blocks[seq.slot])
        self._free_blocks.extend(int(b) for b in self.block_tables[seq.slot, :n][::-1])
        self.block_tables[seq.slot, :n] = NULL_BLOCK
        self.num_seq_blocks[seq.slot] = 0
        self._free_slots.append(seq.slot)
        seq.slot = -1
        seq.num_cached = 0
