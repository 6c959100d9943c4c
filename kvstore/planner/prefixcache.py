"""The prefix cache a prefill-capable worker keeps (block ids of prompts it has prefilled)."""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    """LRU set of prefix-block ids held by one worker."""

    def __init__(self, capacity_blocks: int):
        self.capacity = max(0, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, ids: tuple[int, ...]) -> int:
        n = 0
        for block in ids:
            if block not in self._blocks:
                break
            n += 1
        return n

    def insert(self, ids: tuple[int, ...]) -> None:
        for block in ids:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
