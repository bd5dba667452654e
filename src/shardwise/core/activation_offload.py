"""Activation offload: the activations a unit saves for backward wait in host memory.

A chosen module's forward runs inside ``torch.autograd.graph.saved_tensors_hooks``: each
tensor autograd saves (parameters and views of them excepted: the runtime gathers and frees
those) is copied to host memory, and autograd keeps the copy instead of the original. The
originals are let go when the module's forward returns, and freed as soon as the rest of the
forward no longer uses them. In backward the copies come back: when autograd first asks for
one of a forward call's tensors, all of that call's tensors and those of the call that
backward reaches next are copied back and their host copies dropped, so that the next unit's
copy overlaps this one's compute (PyTorch's ``save_on_cpu`` copies one tensor at a time, when
asked). A copy back is freed as soon as autograd has used the saved tensors that come back
from it, as the originals would be without offload.

On CUDA the copies run on one side stream under the rules of Note [stream ordering]
(streams.py): the side stream waits for compute before it reads an activation or writes a
buffer allocated on the compute stream; compute waits for the copies out before the module's
forward returns (its activations' memory is then free for compute to reuse) and on a copy
back's event before it reads the result. Host buffers are pinned. On CPU the same steps run
with plain copies: host and device are one memory, so it saves nothing there (the planner
never chooses it on CPU), but it is exact, and the planner's run on fake tensors takes the
device's steps (Note [host copies]).

Note [host copies]: the planner's device peak leaves out the bytes that wait in host memory.
An ``activations`` event (``host``: the bytes of host copies held from here on) is emitted
just before each copy out is allocated and just after a call's host copies are dropped, so
between two events host memory changes only at the start (a copy) or at the end (a drop):
each traced interval's highest total less the host bytes of the event before it is the
device's highest (planner/plan.py, ``_held``).

Note [one copy a storage]: autograd often saves several views of one storage (a tensor and
its transpose, an input saved by two operations, an expanded tensor). A tensor that spans
its whole storage in no fewer bytes than it has is copied as that storage, flat, and each
later saved tensor of the same storage (same version and dtype) comes back as a view of that
copy with its own size, stride and offset: the aliasing autograd saw is kept and the bytes
are counted once. Any other tensor is copied on its own (once, if the same view of its
storage is saved again), so the bytes copied never exceed those of copying each saved tensor.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn

from . import events
from .errors import ShardwiseError
from .recompute import recomputes


def is_activation(t: torch.Tensor) -> bool:
    """Whether a tensor autograd saves is an activation (not a parameter, nor a view of one)."""
    return not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter)


class _Copy:
    """One host copy and, in backward, its copy back."""

    __slots__ = ("back", "back_done", "host")

    def __init__(self, host: torch.Tensor):
        self.host: torch.Tensor | None = host
        self.back: torch.Tensor | None = None
        self.back_done = None  # CUDA: the copy back's event

    def __del__(self):
        # rule 3 of Note [stream ordering]: the copy back (allocated on compute, written on the
        # side stream) is freed only after compute waits for its copy, even when autograd
        # drops it unused (a graph released mid-backward)
        if self.back_done is not None:
            torch.cuda.current_stream(self.back.device).wait_event(self.back_done)


class _Saved:
    """One saved tensor: the copy it comes back from, and where in it (None: the whole copy)."""

    __slots__ = ("copy", "view")

    def __init__(self, copy: _Copy, view: tuple | None):
        self.copy = copy
        self.view = view

    def tensor(self) -> torch.Tensor:
        back = self.copy.back
        return back if self.view is None else back.as_strided(*self.view)


class _Call:
    """The tensors one forward call of an offloaded module saved, in order."""

    def __init__(self, label: str):
        self.label = label
        self.copies: list[_Copy] = []
        self.storages: dict[tuple, _Copy] = {}  # (Note [one copy a storage])
        self.sources: list[torch.Tensor] = []  # the activations, held until the forward returns
        self.host_bytes = 0  # of its host copies still held
        self.fetched = False


class Offload:
    """The activation offload of one model: its forward calls whose host copies are held, in
    order, and the CUDA side stream the copies run on (None on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # weak, so a graph dropped without a backward (evaluation with grad enabled) takes its
        # copies along
        self.calls: list[weakref.ref[_Call]] = []
        self.bytes_out = 0  # bytes copied to host memory since creation (tests, tools)

    @property
    def on_host(self) -> int:
        """Bytes of host copies held now."""
        return sum(c.host_bytes for c in self._live())

    def wrap(self, module: nn.Module, label: str) -> None:
        """Offload what ``module``'s forward saves for backward."""
        if recomputes(module):
            raise ShardwiseError(f"'{label}' recomputes its activations: it has none to offload")
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            call = _Call(label)
            self.calls.append(weakref.ref(call))
            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(self._pack, call), functools.partial(self._unpack, call)
            ):
                out = inner(*args, **kwargs)
            if self.stream is not None:  # compute reuses the activations' memory after their copies
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            call.sources = []
            return out

        module.forward = forward

    # --- forward: out to host memory
    def _pack(self, call: _Call, t: torch.Tensor):
        if not is_activation(t):
            return t
        storage = t.untyped_storage()
        key = (storage._cdata, 0 if t.is_inference() else t._version, t.dtype)
        size = t.element_size()
        view = (tuple(t.size()), tuple(t.stride()), t.storage_offset())
        if key in call.storages:
            return _Saved(call.storages[key], view)
        if (key, view) in call.storages:  # the same part of a larger storage, saved again
            return _Saved(call.storages[key, view], None)
        whole = storage.nbytes() <= t.numel() * size and storage.nbytes() % size == 0
        source = t.detach()
        if whole:  # the whole storage, flat
            source = source.as_strided((storage.nbytes() // size,), (1,), 0)
        copy = self._copy_out(call, source)
        if not whole:
            call.storages[key, view] = copy
            return _Saved(copy, None)
        call.storages[key] = copy
        return _Saved(copy, view)

    def _copy_out(self, call: _Call, t: torch.Tensor) -> _Copy:
        n = t.numel() * t.element_size()
        self.bytes_out += n
        call.host_bytes += n
        if events.listeners:  # (Note [host copies])
            events.emit("activations", call.label, host=self.on_host)
        host = torch.empty_like(t, device="cpu", pin_memory=self.stream is not None)
        if self.stream is None:
            host.copy_(t)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # rule 1: t is written
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
        call.sources.append(t)
        copy = _Copy(host)
        call.copies.append(copy)
        return copy

    # --- backward: back, with the next call's prefetched
    def _unpack(self, call: _Call, saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if not call.fetched:
            self._fetch(call)
            earlier = self._live()  # (the fetched ones are dropped from it)
            if earlier:  # backward reaches the forward call before this one next
                self._fetch(earlier[-1])
        if saved.copy.back_done is not None:
            torch.cuda.current_stream(self.device).wait_event(saved.copy.back_done)  # rule 2
        return saved.tensor()

    def _fetch(self, call: _Call) -> None:
        """Copy a forward call's tensors back to the device (on CUDA on the side stream) and
        drop their host copies."""
        call.fetched = True
        backs = [torch.empty_like(c.host, device=self.device) for c in call.copies]  # on compute
        if self.stream is None:
            for c, back in zip(call.copies, backs):
                c.back = back.copy_(c.host)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # rule 1: memory free
            with torch.cuda.stream(self.stream):
                for c, back in zip(call.copies, backs):
                    c.back = back.copy_(c.host, non_blocking=True)
                    c.back_done = self.stream.record_event()
        for c in call.copies:  # (CUDA: the host allocator reuses a pinned block after its copies)
            c.host = None
        # from here each copy back lives as long as the saved tensors that come back from it:
        # autograd frees them one by one as the call's backward uses them, as it frees the
        # originals when nothing is offloaded
        call.copies, call.storages = [], {}
        call.host_bytes = 0
        self.calls = [r for r in self.calls if r() is not None and r() is not call]
        if events.listeners:  # (Note [host copies])
            events.emit("activations", call.label, host=self.on_host)

    def _live(self) -> list[_Call]:
        """The forward calls whose graphs are alive and host copies held, in forward order."""
        self.calls = [r for r in self.calls if r() is not None]
        return [c for c in (r() for r in self.calls) if c is not None]


def _same(t):
    return t


def _keep_own(module: nn.Module) -> None:
    """``module`` keeps what it saves, inside a module that offloads (hooks nest: the
    innermost apply)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            return inner(*args, **kwargs)

    module.forward = forward


def offload_activations(
    model: nn.Module, names: list[str], units: list[str], device: torch.device
) -> Offload:
    """Offload the saved activations of the units of ``model`` named ``names`` (``units``:
    every unit's name); a unit that does not offload keeps its own, even inside one that does."""
    offload = Offload(device)
    modules = dict(model.named_modules())
    for name in names:
        offload.wrap(modules[name], name or "<root>")
    for name in units:
        inside = any(n == "" or name.startswith(n + ".") for n in names if n != name)
        if name not in names and inside:
            _keep_own(modules[name])
    return offload
