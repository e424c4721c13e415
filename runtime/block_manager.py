"""Paged KV cache: the per-layer cache tensors and the block allocator with block tables.

Cache tensors are ``[num_blocks, block_size, kv_heads, head_dim]`` per layer for K and V.
Block 0 is the null block (padding writes land there, padded table entries read it).
Block tables live in one ``[max_seqs, max_blocks_per_seq]`` int64 matrix, one row per
running sequence (its ``slot``), so the runner builds a batch's tables with one gather.

Blocks are reference-counted: sequences forked from one another (parallel sampling,
beam search) share blocks, and a shared block that is about to be written is first
copied (copy-on-write; the copies are queued in ``pending_copies`` and done by the model
runner before the step). With prefix caching, every *full* block whose K/V have been
computed is registered under a chained hash of its tokens (``hash((parent_hash, tokens))``);
a later sequence whose leading blocks have the same hashes reuses them instead of
recomputing them. Unreferenced cached blocks stay in the cache until their space is
needed (least recently released first).
"""
from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch

from .sequence import Sequence

NULL_BLOCK = 0
_ROOT_HASH = 0x9E3779B97F4A7C15  # parent hash of a sequence's first block


def _lazy_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU buffer whose pages are only made resident when written, 4 KiB at a time.

    ``torch.zeros`` writes every byte (a 1 GiB cache would be 1 GiB of RSS at once); a fresh anonymous
    mapping is zero pages until written. Zero (not garbage) matters: masked-out cache slots are still read
    by the reference attention. Not ``np.zeros``: numpy advises its large buffers ``MADV_HUGEPAGE``, and a
    cache is written a block (a few KiB) per layer at a time in 2 × layers separate slabs, so each written
    block cost a whole 2 MiB page in each slab (SmolLM2, 16 short requests: 176 MiB resident instead of
    ~60 MiB). The tensor keeps the mapping alive."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, numel * itemsize)
    mapping = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:numel * itemsize].view(dtype)


class PagedKVCache:
    """The cache tensors themselves, one buffer for all layers (zeroed, resident as used).

    ``kv_scales=(k_scales, v_scales)``, each ``[num_layers, num_kv_heads]`` float32, with
    ``dtype=torch.int8``: the int8 KV cache (KV8); ``dtype=torch.float8_e4m3fn``: the fp8 one (KVf8). Each
    layer's tensors get one extra block at the end, the *scale block* holding that layer's scales
    (``fxcompiler.ops.paged_attention.kv8_scales``); the block manager never hands it out (it sees ``num_blocks``)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_scales=None):
        if (dtype in (torch.int8, torch.float8_e4m3fn)) != (kv_scales is not None):
            raise ValueError("an int8 or fp8 KV cache needs kv_scales (k_scales, v_scales), and only those take them")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype
        if kv_scales is not None:
            num_blocks += 1  # the scale block
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        per = num_blocks * block_size * num_kv_heads * head_dim
        if torch.device(device).type == "cpu":
            buf = _lazy_zeros(2 * num_layers * per, dtype)
        else:
            buf = torch.zeros(2 * num_layers * per, dtype=dtype, device=device)
        self._views = buf.view(2, num_layers, *shape)
        self.k = list(self._views[0].unbind(0))
        self.v = list(self._views[1].unbind(0))
        if kv_scales is not None:
            from fxcompiler.ops.paged_attention import kv8_set_scales

            ks, vs = (torch.as_tensor(x, dtype=torch.float32) for x in kv_scales)
            if tuple(ks.shape) != (num_layers, num_kv_heads) or tuple(vs.shape) != (num_layers, num_kv_heads):
                raise ValueError(f"kv_scales must be two [num_layers={num_layers}, num_kv_heads={num_kv_heads}] "
                                 f"tensors, got {tuple(ks.shape)} and {tuple(vs.shape)}")
            for i in range(num_layers):
                kv8_set_scales(self.k[i], ks[i])
                kv8_set_scales(self.v[i], vs[i])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer's K and V (copy-on-write)."""
        if not pairs:
            return
        dev = self._views.device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dev)
        self._views[:, :, dst] = self._views[:, :, src]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes of one block over all layers' K and V at ``dtype``'s element size (int8: 1)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class BlockManager:
    """Allocates cache blocks to sequences and keeps their block tables."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int,
                 enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_prefix_caching = enable_prefix_caching
        self._free_blocks: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._free_slots: list[int] = list(range(max_seqs - 1, -1, -1))
        self.block_tables = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int64)
        self.num_seq_blocks = np.zeros(max_seqs, dtype=np.int64)
        self.ref_counts = np.zeros(num_blocks, dtype=np.int64)
        # prefix cache: hash -> block, block -> hash, unreferenced cached blocks in LRU order
        self._cached: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._registered = np.zeros(max_seqs, dtype=np.int64)  # leading blocks of a slot already in the cache
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner must do first
        # statistics
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found (their prefill was skipped)
        self.evictions = 0
        self.copies_on_write = 0

    # -- pool --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones plus unreferenced cached ones)."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if self._free_blocks:
            b = self._free_blocks.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)  # least recently released
            self._uncache(b)
            self.evictions += 1
        else:
            raise RuntimeError("out of KV cache blocks")
        self.ref_counts[b] = 1
        return b

    def _uncache(self, b: int) -> None:
        h = self._hash_of.pop(b, None)
        if h is not None:
            self._tokens_of.pop(b, None)
            if self._cached.get(h) == b:
                del self._cached[h]

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                self._free_blocks.append(b)

    def _acquire_cached(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self._evictable[b]
        self.ref_counts[b] += 1

    # -- prefix hashes -------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_full: int) -> list[int]:
        """Chained hashes of ``seq``'s first ``num_full`` full blocks (memoised on the sequence)."""
        hs = seq.block_hashes
        if len(hs) < num_full:
            toks = seq.all_token_ids()
            bs = self.block_size
            parent = hs[-1] if hs else _ROOT_HASH
            for i in range(len(hs), num_full):
                parent = hash((parent, tuple(toks[i * bs:(i + 1) * bs])))
                hs.append(parent)
        return hs[:num_full]

    def _lookup(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Cached blocks holding ``seq``'s leading tokens; the block of its last token is never
        reused (its logits have to be computed)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        full = (num_tokens - 1) // self.block_size
        if full <= 0:
            return []
        toks = seq.all_token_ids()
        bs = self.block_size
        hits = []
        for i, h in enumerate(self.block_hashes(seq, full)):
            b = self._cached.get(h)
            if b is None or self._tokens_of[b] != tuple(toks[i * bs:(i + 1) * bs]):
                break
            hits.append(b)
        return hits

    def cached_prefix_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """Leading tokens of ``seq`` whose K/V admitting it now would reuse from the cache."""
        return len(self._lookup(seq, num_tokens)) * self.block_size

    def prefix_tokens(self, token_ids: list[int], queued: Iterable[Sequence] = ()) -> int:
        """Leading tokens of a new prompt ``token_ids`` whose K/V this cache holds, or that one of the
        ``queued`` sequences (same leading blocks) computes before it would: what a data-parallel
        router saves by sending the prompt here. The last token's block is never counted (as in
        :meth:`_lookup`)."""
        bs = self.block_size
        full = (len(token_ids) - 1) // bs
        if not self.enable_prefix_caching or full <= 0:
            return 0
        planned: dict[int, tuple[Sequence, int]] = {}
        for s in queued:
            n = min(full, (len(s.prompt_token_ids) - 1) // bs)
            for i, h in enumerate(self.block_hashes(s, n)):
                planned.setdefault(h, (s, i))
        parent, hits = _ROOT_HASH, 0
        for i in range(full):
            blk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash((parent, blk))
            b = self._cached.get(parent)
            if b is not None and self._tokens_of[b] == blk:
                hits += 1
                continue
            q = planned.get(parent)
            if q is not None and tuple(q[0].prompt_token_ids[q[1] * bs:(q[1] + 1) * bs]) == blk:
                hits += 1
                continue
            break
        return hits * bs

    def blocks_to_allocate(self, seq: Sequence, num_tokens: int) -> int:
        """How many blocks admitting ``seq`` with ``num_tokens`` tokens takes from the free pool."""
        return self.admission(seq, num_tokens)[1]

    def admission(self, seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """(tokens the prefix cache would provide, blocks taken from the free pool) if ``seq`` were
        admitted now with ``num_tokens`` tokens (one cache lookup for both)."""
        hits = self._lookup(seq, num_tokens)
        taken = self.blocks_needed(num_tokens) - len(hits) + sum(1 for b in hits if self.ref_counts[b] == 0)
        return len(hits) * self.block_size, taken

    # -- sequences -----------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        return bool(self._free_slots) and self.blocks_needed(num_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Give ``seq`` a slot and enough blocks for ``num_tokens`` tokens, reusing cached prefix
        blocks; sets ``seq.num_cached`` to the reused tokens and returns that count."""
        n = self.blocks_needed(num_tokens)
        if n > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq.request_id} needs {n} blocks, more than {self.max_blocks_per_seq}")
        hits = self._lookup(seq, num_tokens)
        if not self._free_slots or self.blocks_to_allocate(seq, num_tokens) > self.num_free_blocks:
            raise RuntimeError("out of KV cache blocks")
        slot = self._free_slots.pop()
        for b in hits:
            self._acquire_cached(b)
        blocks = hits + [self._take() for _ in range(n - len(hits))]
        self.block_tables[slot, :n] = blocks
        self.num_seq_blocks[slot] = n
        self._registered[slot] = len(hits)
        seq.slot = slot
        seq.num_cached = len(hits) * self.block_size
        if self.enable_prefix_caching and seq.params.prompt_logprobs is None:
            self.prefix_queries += num_tokens
            self.prefix_hits += seq.num_cached
        return seq.num_cached

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` a slot whose table shares every block of ``parent`` (reference counted)."""
        if not self._free_slots:
            raise RuntimeError("out of sequence slots")
        slot = self._free_slots.pop()
        n = int(self.num_seq_blocks[parent.slot])
        row = self.block_tables[parent.slot, :n]
        self.block_tables[slot, :n] = row
        self.num_seq_blocks[slot] = n
        self.ref_counts[row] += 1
        self._registered[slot] = self._registered[parent.slot]
        child.slot = slot
        child.num_cached = parent.num_cached
        child.block_hashes = list(parent.block_hashes)

    def commit(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V are now computed in the prefix cache."""
        if not self.enable_prefix_caching or seq.slot < 0:
            return
        full = min(seq.num_cached // self.block_size, int(self.num_seq_blocks[seq.slot]))
        start = int(self._registered[seq.slot])
        if full <= start:
            return
        toks = seq.all_token_ids()
        bs = self.block_size
        hashes = self.block_hashes(seq, full)
        for i in range(start, full):
            b = int(self.block_tables[seq.slot, i])
            h = hashes[i]
            if h not in self._cached and b not in self._hash_of:
                self._cached[h] = b
                self._hash_of[b] = h
                self._tokens_of[b] = tuple(toks[i * bs:(i + 1) * bs])
        self._registered[seq.slot] = full

    def _growth(self, s: Sequence) -> tuple[bool, bool]:
        """(needs a new block, needs a copy of its shared last block) for ``s``'s next token."""
        need = self.blocks_needed(s.num_tokens)
        have = int(self.num_seq_blocks[s.slot])
        if need > have:
            return True, False
        last = int(self.block_tables[s.slot, (s.num_tokens - 1) // self.block_size])
        return False, bool(self.ref_counts[last] > 1)

    def can_append(self, seqs: list[Sequence]) -> bool:
        return self._blocks_to_grow(seqs) <= self.num_free_blocks

    def _blocks_to_grow(self, seqs) -> int:
        return sum(1 for s in seqs if any(self._growth(s)))

    def may_append(self, seqs: list[Sequence]) -> None:
        """Make room for each sequence's next token (a new block when it crosses a boundary, a
        private copy when the block it writes into is shared)."""
        for s in seqs:
            grow, cow = self._growth(s)
            if grow:
                need = self.blocks_needed(s.num_tokens)
                if need > self.max_blocks_per_seq:
                    raise ValueError(f"sequence {s.request_id} exceeds {self.max_blocks_per_seq} blocks")
                self.block_tables[s.slot, need - 1] = self._take()
                self.num_seq_blocks[s.slot] = need
            elif cow:
                i = (s.num_tokens - 1) // self.block_size
                old = int(self.block_tables[s.slot, i])
                new = self._take()
                self.pending_copies.append((old, new))
                self._release(old)
                self.block_tables[s.slot, i] = new
                self.copies_on_write += 1

    def take_pending_copies(self) -> list[tuple[int, int]]:
        pairs, self.pending_copies = self.pending_copies, []
        return pairs

    def free(self, seq: Sequence) -> None:
        if seq.slot < 0:
            return
        n = int(self.num_seq_blocks[seq.slot])
        for b in self.block_tables[seq.slot, :n][::-1].tolist():  # tail blocks are evicted first
            self._release(int(b))
        self.block_tables[seq.slot, :n] = NULL_BLOCK
        self.num_seq_blocks[seq.slot] = 0
        self._registered[seq.slot] = 0
        self._free_slots.append(seq.slot)
        seq.slot = -1
        seq.num_cached = 0

    # -- speculative decoding: slots for drafted tokens, given back when they are rejected --------
    def reserve_lookahead(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``seq``'s first ``num_tokens`` tokens (drafted tokens beyond its current
        ones); False, taking nothing, when the table or the pool cannot hold them."""
        have = int(self.num_seq_blocks[seq.slot])
        need = self.blocks_needed(num_tokens)
        if need <= have:
            return True
        if need > self.max_blocks_per_seq or need - have > self.num_free_blocks:
            return False
        for i in range(have, need):
            self.block_tables[seq.slot, i] = self._take()
        self.num_seq_blocks[seq.slot] = need
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release ``seq``'s blocks beyond its first ``num_tokens`` tokens (rejected drafts' slots)."""
        keep = self.blocks_needed(num_tokens)
        have = int(self.num_seq_blocks[seq.slot])
        for i in range(have - 1, keep - 1, -1):
            self._release(int(self.block_tables[seq.slot, i]))
            self.block_tables[seq.slot, i] = NULL_BLOCK
        if have > keep:
            self.num_seq_blocks[seq.slot] = keep
            self._registered[seq.slot] = min(int(self._registered[seq.slot]), keep)

    def check_invariants(self) -> None:
        """Reference counts equal table references; every block is in exactly one place (tests)."""
        refs = np.zeros(self.num_blocks, dtype=np.int64)
        for slot in range(self.block_tables.shape[0]):
            n = int(self.num_seq_blocks[slot])
            np.add.at(refs, self.block_tables[slot, :n], 1)
        assert (refs == self.ref_counts).all(), "reference counts differ from the block tables"
        free = set(self._free_blocks)
        evict = set(self._evictable)
        used = set(np.nonzero(refs)[0].tolist())
        assert len(free) == len(self._free_blocks) and not (free & evict) and not (free & used) and not (evict & used)
        assert free | evict | used == set(range(1, self.num_blocks)), "a block went missing"
        assert all(self._cached[h] == b for b, h in self._hash_of.items())
