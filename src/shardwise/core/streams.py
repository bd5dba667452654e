"""The CUDA side streams of a sharded model, and the rules that order them with compute.

On CUDA, a unit's gather and reduction run on side streams so that they overlap the compute
stream's work, as in PyTorch's FSDP2: ``copy_in`` (the cast to the compute dtype and, when
offloaded, the copy from pinned host memory), ``gather`` (the all-gather) and ``reduce`` (the
reduce-scatter, the average, and the cast or copy to host memory of the result). Events order
them; no tensor is ever handed to ``record_stream`` (which holds memory until the allocator
next polls, pytorch#147168). On CPU (Gloo) there are no streams: a collective is waited for
on the CPU when its result is needed, and the unit takes the other branch.

Note [stream ordering]: three rules make this safe, and unit.py keeps them.
1. Before work goes to a side stream, that stream waits for the compute stream, so it sees
   everything compute wrote (shards updated by the optimizer, gradients) and everything
   compute freed before that moment is no longer read by compute.
2. The compute stream waits on an event recorded after the side-stream work before it reads
   the result (the copy-out of a gather, the gradients of a reduction).
3. A buffer allocated on the compute stream and used by a side stream (a reduction's rows
   and output) stays referenced by its unit until rule 2's wait has been issued; a buffer
   allocated on a side stream (a gather's receive rows, a cast shard) is dropped only after
   compute's last use of it is issued, and by rule 1 the side stream reuses its memory
   only after that use. Each unit thus holds at most one gather and one reduction.
A collective is issued on its side stream and waited for there at once: with NCCL that makes
the side stream, not the CPU, wait for it (so the CPU never blocks on a gather or reduction).
"""

from __future__ import annotations

import torch


class Streams:
    """The side streams of one sharded model on one device (Note [stream ordering]).

    ``device_module`` is ``torch.cuda``; tests pass a stand-in that records the order of
    every wait and event, to check the rules on a machine without a GPU.
    """

    def __init__(self, device: torch.device, device_module=torch.cuda):
        self._dev = device_module
        # high priority, as FSDP2's: communication kernels are not queued behind compute ones
        self.copy_in = device_module.Stream(device, priority=-1)
        self.gather = device_module.Stream(device, priority=-1)
        self.reduce = device_module.Stream(device, priority=-1)

    def compute(self):
        """The stream the model computes on (the current one where the hook runs)."""
        return self._dev.current_stream()

    def use(self, stream):
        """Context in which new work (and allocations) go to ``stream``."""
        return self._dev.stream(stream)


def for_device(device: torch.device) -> Streams | None:
    """Side streams on CUDA; None elsewhere (Gloo waits for collectives on the CPU)."""
    return Streams(device) if device.type == "cuda" else None
