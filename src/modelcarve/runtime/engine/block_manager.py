"""The paged KV cache's bookkeeping: which block holds which tokens, with prefix caching.

Pure Python (no tensors): the generation engine's rank 0 owns one ``BlockManager`` per model
replica; the model ranks only see the resulting block tables. A block holds ``block_size``
consecutive tokens of one sequence (position ``p`` lives in ``block_table[p // block_size]``,
slot ``p % block_size``).

* Block 0 is reserved: never handed out, it is the scratch slot padded tokens write to.
* Reference counts: a block shared by several sequences (a common prompt prefix) is freed when
  its last user lets it go.
* Prefix caching: a *full* block whose KV has been computed is registered under the hash of its
  contents chained to its predecessor's (``hash((parent_hash, tokens))``, so equal blocks at
  different prefixes differ; the tokens are kept and compared too, so a hash collision can never
  share the wrong KV). A new sequence takes over the longest run of registered blocks matching
  its prompt; at least one prompt token is always left to compute (the last block is not taken
  when it would cover the whole prompt) so the step that follows yields the next token's logits.
* A registered block with no user is kept, *evictable*, in least-recently-freed order; a fresh
  block is taken from the never-used free list first, then by evicting the oldest of them.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockManager:
    """Allocation, reference counts and prefix caching over ``num_blocks`` blocks (block 0 reserved)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is the scratch block)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free: deque[int] = deque(range(1, num_blocks))
        self._ref = [0] * num_blocks
        self._key: dict[int, tuple] = {}      # block -> (hash, parent hash, tokens)
        self._cached: dict[int, int] = {}     # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.query_tokens = 0
        self.hit_tokens = 0

    # --- capacity ------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free(self) -> int:
        """Blocks a sequence could get now (never used, or cached without users)."""
        return len(self._free) + len(self._evictable)

    def num_used(self) -> int:
        return self.usable_blocks - self.num_free()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- allocation ----------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._key.pop(block)[0]
            del self._cached[h]
        else:
            raise RuntimeError("no free KV block (the scheduler must check num_free first)")
        self._ref[block] = 1
        return block

    def grow(self, table: list[int], tokens: int) -> bool:
        """Append blocks to ``table`` until it holds ``tokens`` tokens; False (nothing changed)
        when there are not enough free blocks."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free():
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def release(self, table: list[int]) -> None:
        """Drop one reference to every block of ``table`` (last blocks first, so a sequence's
        tail is evicted before its shared head)."""
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._key:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        table.clear()

    # --- prefix caching --------------------------------------------------------------------
    def _chain(self, tokens: list[int], count: int):
        parent = None
        bs = self.block_size
        for i in range(count):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, chunk))
            yield h, parent, chunk
            parent = h

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """The cached blocks covering the longest matching prefix of ``tokens`` (a reference taken
        on each), never all of ``tokens``."""
        if not self.prefix_caching:
            return []
        full = (len(tokens) - 1) // self.block_size
        blocks = []
        for h, parent, chunk in self._chain(tokens, full):
            block = self._cached.get(h)
            if block is None or self._key[block][1:] != (parent, chunk):
                break
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            blocks.append(block)
        return blocks

    def count_query(self, tokens: int, hit_blocks: int) -> None:
        """Statistics of one admitted sequence's prefix lookup (not of lookups undone)."""
        if self.prefix_caching:
            self.query_tokens += tokens
            self.hit_tokens += hit_blocks * self.block_size

    def register(self, table: list[int], tokens: list[int], computed: int, first: int = 0) -> int:
        """Register the full blocks of ``table`` whose KV is computed (``computed`` tokens), from
        block ``first`` on; returns the number of leading blocks now known (the next ``first``)."""
        if not self.prefix_caching:
            return first
        full = min(computed // self.block_size, len(table))
        for i, (h, parent, chunk) in enumerate(self._chain(tokens, full)):
            if i < first:
                continue
            block = table[i]
            if block in self._key or h in self._cached:
                continue  # already registered, or the same contents computed by another sequence
            self._key[block] = (h, parent, chunk)
            self._cached[h] = block
        return max(first, full)
