"""The allocation logs the tracer replays (Note [memory categories] in trace.py), and the
planner reads: every allocation and free, as (time, block, signed bytes, time watched).

On CPU, torch's profiler with memory profiling and no activity (``Allocations``): the CPU
allocator reports every allocation and free from C++, so no Python runs per operator. On fake
tensors (the planner's), a dispatch mode keeps the same log by hand (``FakeAllocations``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from functools import partial

import torch
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    _ExperimentalConfig,
    _ExtraFields_Allocation,
)
from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.runtime import flat_tensors


class Allocations:
    """Every allocation and free of the CPU allocator on the entering thread, while active.

    Torch's profiler with ``profile_memory`` and no activity to record: no operator callbacks,
    only the allocator's own report of each block (address, signed size, time) from C++, read
    once, at ``stop``. It misses frees made on other threads (a collective's worker dropping
    the last reference to its buffers), so the category storages the tracer reads and the
    buffers of every collective it follows are ``watch``ed too: a weak reference notes when
    each is freed, on whichever thread; and ``_replay`` takes an address allocated again as
    freed.
    """

    def __init__(self):
        self._watched: dict[int, weakref.ref] = {}  # id(storage) -> its weak reference
        self._buffers: list[tuple[int, weakref.ref]] = []  # the followed collectives'
        self._freed: list[tuple[int, int, int, int]] = []

    def start(self) -> None:
        if torch.autograd._profiler_enabled():
            raise RuntimeError(
                "shardwise.trace measures CPU memory with torch's profiler, which is already "
                "running on this thread: trace and profile in separate runs"
            )
        config = ProfilerConfig(
            ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig()
        )
        activities = {ProfilerActivity.MTIA}  # nothing to record on CPU or CUDA machines
        with _quiet():  # kineto announces every start and stop on stderr
            _prepare_profiler(config, activities)
            _enable_profiler(config, activities)

    @staticmethod
    def now() -> int:
        """The log's clock (its entries' first field): nanoseconds since the epoch."""
        return time.time_ns()

    @staticmethod
    def key(st: torch.UntypedStorage) -> int:
        """How the log names a storage's block: its address."""
        return st.data_ptr()

    def watch(self, st: torch.UntypedStorage, ptr: int) -> None:
        key = id(st)
        if key not in self._watched:
            self._watched[key] = weakref.ref(st, partial(self._on_free, key, ptr, time.time_ns()))

    def watch_buffers(self, tensors: list[torch.Tensor]) -> None:
        """Watch the buffers of a collective just issued: the last reference to them (e.g. a
        reduce-scatter's rows) may go on the backend's worker thread, with its work."""
        for t in tensors:
            if t.device.type == "cpu":
                st = t.untyped_storage()
                if st.nbytes():
                    self.watch(st, st.data_ptr())
                    self._buffers.append((id(st), weakref.ref(st)))

    def settle(self, keep: set[int], timeout: float = 1.0) -> None:
        """Wait, at most ``timeout`` seconds, until the followed collectives' buffers that the
        traced code no longer holds (their storage ids not in ``keep``) are freed. Gloo drops
        a finished work, and with it its buffers, on its worker thread some time after the
        waiter woke up (under load, many milliseconds later): the last sample must not count
        them as held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
            key not in keep and ref() is not None for key, ref in self._buffers
        ):
            time.sleep(0.001)

    def _on_free(self, key: int, ptr: int, seen: int, _ref) -> None:
        self._watched.pop(key, None)
        self._freed.append((time.time_ns(), ptr, 0, seen))

    def stop(self) -> list[tuple[int, int, int, int]]:
        """End the log: (time in ns since the epoch, address, signed bytes, 0) per allocator
        event and (time, address, 0, time it was watched) per watched storage freed."""
        with _quiet():  # and warns that memory events have no kineto counterpart
            result = _disable_profiler()
            cpu = torch.device("cpu")
            out = [
                (e.start_time_ns, f.ptr, f.alloc_size, 0)
                for e in result.experimental_event_tree()
                if isinstance(f := e.extra_fields, _ExtraFields_Allocation) and f.device == cpu
            ]
        self._watched.clear()  # no callbacks from here on
        out += self._freed
        self._freed = []
        out.sort(key=lambda e: e[0])
        return out


class FakeAllocations(TorchDispatchMode):
    """The allocation log of a run on fake tensors (the planner's), in ``Allocations``' format.

    Fake tensors allocate nothing, so the log is kept by hand: a dispatch mode notes each
    storage an operator creates (an output whose storage none of its inputs holds), a weak
    reference its free, and ``UntypedStorage.resize_`` (which does not dispatch; patched while
    active, as torch's MemTracker does) each resize, by which units gather and free their
    parameters. Blocks are named by the storage's id; the clock ticks once per entry.
    """

    def __init__(self):
        super().__init__()
        self._log: list[tuple[int, int, int, int]] = []
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes it holds as logged
        self._real: dict[int, int] = {}  # id(storage) -> the real kernel's bytes (Note [kernels' storages])
        self._refs: dict[int, weakref.ref] = {}
        self._resize = None

    def now(self) -> int:
        return len(self._log)

    @staticmethod
    def key(st: torch.UntypedStorage) -> int:
        return id(st)

    def watch(self, st: torch.UntypedStorage, key: int) -> None:
        pass  # every free is logged already

    def watch_buffers(self, tensors: list[torch.Tensor]) -> None:
        pass

    def settle(self, keep: set[int]) -> None:
        pass  # torch's fake group holds no buffers

    def _note(self, st: torch.UntypedStorage, nbytes: int | None = None) -> None:
        """Log the bytes ``st`` holds now (``nbytes``: what the real kernel's holds), if they
        changed (a freed block counts as -1)."""
        key = id(st)
        if nbytes is not None:
            self._real[key] = nbytes
        n = max(st.nbytes(), self._real.get(key, 0))
        if key not in self._refs:
            self._refs[key] = weakref.ref(st, partial(self._on_free, key))
        if n != self._sizes.get(key, 0):
            self._sizes[key] = n
            self._log.append((len(self._log) + 1, key, n or -1, 0))

    def _on_free(self, key: int, _ref) -> None:
        self._refs.pop(key, None)
        self._real.pop(key, None)
        if self._sizes.pop(key, 0):
            self._log.append((len(self._log) + 1, key, -1, 0))

    def start(self) -> None:
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int):
            out = original(st, size)
            self._note(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        self.__enter__()

    def stop(self) -> list[tuple[int, int, int, int]]:
        self.__exit__(None, None, None)
        torch.UntypedStorage.resize_ = self._resize
        self._refs.clear()  # no callbacks from here on
        self._real.clear()
        return self._log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in flat_tensors(out, []):
            if t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            if id(st) in self._refs:
                self._note(st)  # an output written in place may have grown (out=, resize_)
                continue
            if inputs is None:
                inputs = {id(a.untyped_storage()) for a in flat_tensors((args, kwargs), []) if a.layout == torch.strided}
            if id(st) not in inputs:  # else a view, or in place: no new memory
                self._note(st, _real_nbytes(func, args, t))
        return out


# Note [kernels' storages]: a few reduced losses' CPU kernels sum into the unreduced loss and
# return the scalar as a view of it (CUDA's are the same structured kernels: not checked, no
# GPU here), so the loss a loop holds through backward keeps an input-sized storage alive;
# their fake (meta) kernels return a scalar of its own. Found by comparing each loss's storage, real and fake (on an MLP
# with F.mse_loss the plan was 2.0% under MemTracker); huber_loss, l1_loss, nll_loss,
# cross_entropy and the with-logits BCE hold only their scalar.
_REDUCED_INTO_UNREDUCED = {
    torch.ops.aten.mse_loss.default,
    torch.ops.aten.smooth_l1_loss.default,
    torch.ops.aten.binary_cross_entropy.default,
    torch.ops.aten.soft_margin_loss.default,
}


def _real_nbytes(func, args, out: torch.Tensor) -> int | None:
    """The bytes the real kernel's output storage holds, where it differs from the fake's."""
    if func in _REDUCED_INTO_UNREDUCED and out.dim() == 0:
        return args[0].numel() * out.element_size()
    return None


@contextlib.contextmanager
def _quiet():
    """Send this process's stderr (file descriptor 2) to /dev/null for the block."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
