"""Arrival counters for split-KV launches whose last split merges the partials
(`InputFeatures.split_ticket`, arch/sm90/flash_fwd.py `_merge_if_last`).

Such a launch needs one int32 counter per output tile, zero when it starts; every split adds
one, and the split that brings it to num_splits merges the tile and sets it back to zero. So a
counter is cleared by the launch that used it, never per call, and two launches may share
counters only if they cannot run at the same time:

* eager launches on one CUDA stream run in stream order, so each stream gets a region of its
  own (REGION counters), which all its launches reuse;
* a launch captured into a CUDA graph may later be replayed beside anything (another graph,
  another stream), so it gets counters of its own for good (they are never handed out again).

Both come out of one zeroed block per device (BLOCK counters), allocated by the first eager
split launch on that device, outside any capture (a capture cannot allocate memory that
outlives its graph). Where no counters can be had that way (a capture before any eager split
launch on the device, a block used up, or a launch of more tiles than a region holds), the
launch gets fresh counters from `torch.zeros`: a memset before it, so correct and slower.

A stream's region stays with its handle for the process's life; torch hands out pooled streams
(a few dozen handles a device), so the regions stay few.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "REGION", "tickets"]

BLOCK = 1 << 20  # counters per device (4 MiB)
REGION = 1 << 12  # counters per stream: a split launch's tiles (the table splits grids < 1 wave)


class _Block:
    def __init__(self, index: int):
        self.counters = torch.zeros(BLOCK, dtype=torch.int32, device=torch.device("cuda", index))
        # the memset ran on this stream; launches on any other stream must see zeros
        torch.cuda.synchronize(index)
        self.used = 0
        self.regions: dict[int, torch.Tensor] = {}  # stream handle -> its counters

    def take(self, n: int) -> torch.Tensor | None:
        if self.used + n > BLOCK:
            return None
        view = self.counters[self.used : self.used + n]
        self.used += n
        return view


_blocks: dict[int, _Block] = {}


def tickets(index: int, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters (at least `tiles`) for one split launch on device `index` from
    torch's current stream, which the launch leaves zeroed."""
    if tiles <= REGION:
        capturing = torch.cuda.is_current_stream_capturing()
        block = _blocks.get(index)
        if block is None and not capturing:
            block = _blocks[index] = _Block(index)
        if block is not None:
            if capturing:
                view = block.take(tiles)
            else:
                stream = torch.cuda.current_stream(index).cuda_stream
                view = block.regions.get(stream)
                if view is None:
                    view = block.take(REGION)
                    if view is not None:
                        block.regions[stream] = view
            if view is not None:
                return view
    return torch.zeros(tiles, dtype=torch.int32, device=torch.device("cuda", index))
