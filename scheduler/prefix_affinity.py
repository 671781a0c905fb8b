"""Which engine replica likely holds a prompt's leading KV blocks.

Each replica keeps its own prefix cache (`scheduler/prefix_cache.py`); a
request that shares a system prompt or a conversation's earlier turns with
an earlier one is served fastest where that one ran.  The Scheduler
deployment cannot see the replicas' caches, so, as SGLang's cache-aware
router does with an approximate radix tree, it remembers where it sent each
prefix: the ingress sends a key per full block of the prompt before its
last token, for at most `MAX_KEY_BLOCKS` (128) blocks (chained, so a key
stands for the whole prefix up to its block), and this maps the most
recent keys to the replicas that got them, up to `_REPLICAS_PER_KEY` (4)
per key.  The map is a hint: a replica may have evicted the blocks since,
and placement weighs the hint against load (`scheduler/placement.py`).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Collection, Sequence

# Blocks of a prompt the ingress sends keys for: enough for a long system
# prompt and several turns of a conversation, few enough that a request's
# admission call stays small.
MAX_KEY_BLOCKS = 128


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                max_blocks: int = MAX_KEY_BLOCKS) -> list[int]:
    """One key per full block before the prompt's last token (the blocks
    an engine may adopt, `PrefixCache.match`), each standing for every
    token up to its block's end (and the request's `cache_salt`).  Python's
    hash of a tuple of ints is the same in every process; a str's is not,
    so a salt enters by its bytes' CRC."""
    n = min((len(token_ids) - 1) // block_size, max_blocks)
    keys: list[int] = []
    h = 0 if salt is None else zlib.crc32(salt.encode()) + 1
    for i in range(n):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        keys.append(h)
    return keys


def route_key(prompt_cache_key: str) -> int:
    """The affinity key of OpenAI's `prompt_cache_key`: requests a client
    marks with one key share a long prefix, as far as it knows, before any
    of their blocks is known here.  Tagged apart from the prefix keys."""
    return hash(("prompt_cache_key", zlib.crc32(prompt_cache_key.encode())))


# Replicas remembered per key: a prefix every request shares (a system
# prompt) ends up cached on several replicas as load spreads it.
_REPLICAS_PER_KEY = 4


class PrefixAffinity:
    def __init__(self, max_keys: int = 200_000) -> None:
        self.max_keys = max_keys
        # Key -> the replicas that got it, latest first; least recently
        # sent key first.
        self._where: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def match(self, keys: Sequence[int], live: Collection[str]) -> dict[str, int]:
        """For each live replica, how many of `keys`' leading blocks it was
        sent (a key stands for its whole prefix, so the deepest key a
        replica got counts)."""
        depth: dict[str, int] = {}
        for i, key in enumerate(keys):
            replicas = self._where.get(key)
            if replicas is None:
                break
            for r in replicas:
                if r in live:
                    depth[r] = i + 1
        return depth

    def record(self, keys: Sequence[int], replica: str) -> None:
        """`replica` was sent a prompt with these keys."""
        where = self._where
        # Tail first, so that a prefix's head is the last of it to age out
        # (`match` stops at the first key it does not know).
        for key in reversed(keys):
            old = where.get(key, ())
            if old[:1] != (replica,):
                where[key] = (replica, *(r for r in old if r != replica))[:_REPLICAS_PER_KEY]
            where.move_to_end(key)
        while len(where) > self.max_keys:
            where.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica that failed: whatever it held is gone."""
        for key, replicas in list(self._where.items()):
            if replica in replicas:
                rest = tuple(r for r in replicas if r != replica)
                if rest:
                    self._where[key] = rest
                else:
                    del self._where[key]
