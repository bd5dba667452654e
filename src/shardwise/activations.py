"""Activation offload: the activations a unit saves for backward wait in host memory.

A chosen module's forward runs inside ``torch.autograd.graph.saved_tensors_hooks``: each
tensor autograd saves (parameters excepted: the runtime gathers and frees those) is copied to
host memory, and autograd keeps the copy instead of the original, which is freed as soon as
the forward no longer uses it. In backward the copies come back: when autograd first asks for
one of a forward call's tensors, all of that call's tensors and those of the call that
backward reaches next are copied back on a side stream, so that the next unit's copy overlaps
this one's compute (PyTorch's ``save_on_cpu`` copies one tensor at a time, when asked).

On CUDA the copies run on one side stream under the rules of Note [stream ordering]
(streams.py): the side stream waits for compute before it reads an activation or writes a
buffer allocated on the compute stream; compute waits on the copy's event before it reads
the result; an activation being copied out stays referenced until its copy is done. Host
buffers are pinned. On CPU host and device are one memory: the copy is made and kept, and
saves nothing (the planner never chooses it there); it is exact all the same.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn

from .errors import ShardwiseError


class _Saved:
    """One saved tensor: its host copy and, in backward, its copy back."""

    __slots__ = ("back", "back_done", "host", "out_done", "source")

    def __init__(self, host: torch.Tensor, source: torch.Tensor | None, out_done):
        self.host = host
        self.source = source  # CUDA: the activation, held until its copy out is done
        self.out_done = out_done
        self.back: torch.Tensor | None = None
        self.back_done = None


class _Call:
    """The tensors one forward call of an offloaded module saved, in order."""

    def __init__(self, label: str):
        self.label = label
        self.saved: list[_Saved] = []
        self.fetched = False


class Offload:
    """The activation offload of one model: its forward calls since the last backward, in
    order, and the CUDA side stream the copies run on (None on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CUDA: forward calls whose tensors have not been fetched back, in order; weak, so a
        # graph dropped without a backward (evaluation with grad enabled) takes its copies along
        self.calls: list[weakref.ref[_Call]] = []
        self.bytes_out = 0  # bytes copied to host memory since creation (tests, tools)

    def wrap(self, module: nn.Module, label: str) -> None:
        """Offload what ``module``'s forward saves for backward."""
        if getattr(module, "_shardwise_checkpointed", False):
            raise ShardwiseError(f"'{label}' recomputes its activations: it has none to offload")
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            call = _Call(label)
            if self.stream is not None:
                self._release_copied()
                self.calls.append(weakref.ref(call))
            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(self._pack, call), functools.partial(self._unpack, call)
            ):
                return inner(*args, **kwargs)

        module.forward = forward

    # --- forward: out to host memory
    def _pack(self, call: _Call, t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return t
        self.bytes_out += t.numel() * t.element_size()
        if self.stream is None:
            saved = _Saved(t.detach().to("cpu", copy=True), None, None)
        else:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)  # rule 1: the activation is written
            with torch.cuda.stream(self.stream):
                host.copy_(t.detach(), non_blocking=True)
                done = self.stream.record_event()
            saved = _Saved(host, t, done)
        call.saved.append(saved)
        return saved

    # --- backward: back, with the next call's prefetched
    def _unpack(self, call: _Call, saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if self.stream is None:
            return saved.host
        if not call.fetched:
            self._fetch(call)
            earlier = self._pending()
            if earlier:  # backward reaches the forward call before this one next
                self._fetch(earlier[-1])
        torch.cuda.current_stream(self.device).wait_event(saved.back_done)  # rule 2
        return saved.back

    def _fetch(self, call: _Call) -> None:
        """Copy a forward call's tensors back to the device on the side stream."""
        call.fetched = True
        compute = torch.cuda.current_stream(self.device)
        backs = [torch.empty_like(s.host, device=self.device) for s in call.saved]  # on compute
        self.stream.wait_stream(compute)  # rule 1: compute is done with that memory
        with torch.cuda.stream(self.stream):
            for s, back in zip(call.saved, backs):
                back.copy_(s.host, non_blocking=True)
                s.back = back
                s.back_done = self.stream.record_event()
        for s in call.saved:
            s.out_done.synchronize()  # (long done: the forward has ended)
            s.source = None
        self.calls = [r for r in self.calls if r() is not None and r() is not call]

    def _pending(self) -> list[_Call]:
        """The live forward calls not fetched back yet, in forward order."""
        self.calls = [r for r in self.calls if r() is not None]
        return [c for c in (r() for r in self.calls) if c is not None and not c.fetched]

    def _release_copied(self) -> None:
        """Drop the activations whose copy out is done (rule 3), as each forward call starts."""
        for call in self._pending():
            for s in call.saved:
                if s.source is not None and s.out_done.query():
                    s.source = None


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
