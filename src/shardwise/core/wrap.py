"""Wrap policies: which submodules become units. A policy is ``callable(module, name) -> bool``.

Units nest: a module selected inside a selected module forms its own inner unit, and each
parameter belongs to the innermost unit that holds every module using it. ``auto(model)``
picks a policy from the model itself and is the one to reach for first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch.nn as nn

Policy = Callable[[nn.Module, str], bool]

# Containers are never called, so hooks on them would never fire: they are never units.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


class by_class:
    """Select every submodule that is an instance of one of ``classes`` (e.g. the block class)."""

    def __init__(self, *classes: type[nn.Module]):
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"by_class takes nn.Module subclasses, got {classes!r}")
        self.classes = classes

    def __call__(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, self.classes)

    def __repr__(self) -> str:
        return f"by_class({', '.join(c.__name__ for c in self.classes)})"

    def __eq__(self, other) -> bool:  # (a plan's settings compare by what they select)
        return isinstance(other, by_class) and self.classes == other.classes

    def __hash__(self) -> int:
        return hash(self.classes)


class by_size:
    """Select a submodule when it holds at least ``min_params`` parameters not already in a
    selected submodule of its own (bottom-up, like a size-based auto-wrap policy)."""

    def __init__(self, min_params: int):
        if not isinstance(min_params, int) or min_params < 1:
            raise ValueError(f"by_size(min_params) needs a positive int, got {min_params!r}")
        self.min_params = min_params
        # module -> its parameters that no selected submodule of its own holds
        self._unclaimed: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

    def _count(self, module: nn.Module) -> int:
        if module not in self._unclaimed:
            n = sum(p.numel() for p in module.parameters(recurse=False))
            for child in module.children():
                if not self._selects(child):
                    n += self._count(child)
            self._unclaimed[module] = n
        return self._unclaimed[module]

    def _selects(self, module: nn.Module) -> bool:
        return not isinstance(module, CONTAINERS) and self._count(module) >= self.min_params

    def __call__(self, module: nn.Module, name: str) -> bool:
        return self._selects(module)

    def __repr__(self) -> str:
        return f"by_size({self.min_params})"

    def __eq__(self, other) -> bool:
        return isinstance(other, by_size) and self.min_params == other.min_params

    def __reduce__(self):  # without its cache (a plan travels to every rank: plan() broadcasts it)
        return by_size, (self.min_params,)

    def __hash__(self) -> int:
        return hash(self.min_params)


def auto(model: nn.Module) -> Policy:
    """The policy to reach for first: one unit per repeated block of ``model``.

    - A Hugging Face transformers model: the classes its ``_no_split_modules`` names (the
      decoder layer, e.g. ``LlamaDecoderLayer``; what accelerate's and torch's FSDP wrap
      by), found anywhere in the tree, so a peft-wrapped model gets them too.
    - Another model: the class of the blocks of its largest ``nn.ModuleList`` (by parameter
      count), when they are all of one class (``by_class(Block)`` for a GPT).
    - Else ``by_size``, with a threshold of 1/8 of the model's parameters.

    The policy returned shows its choice (``print(wrap.auto(model))``).
    """
    classes = _no_split_classes(model) or _block_class(model)
    if classes:
        return by_class(*classes)
    total = sum(p.numel() for p in model.parameters())
    return by_size(max(1, total // 8))


def _no_split_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    found: dict[str, type[nn.Module]] = {}
    for m in model.modules():
        if type(m).__name__ in names and not isinstance(m, CONTAINERS):
            found.setdefault(type(m).__name__, type(m))
    return tuple(found.values())


def _block_class(model: nn.Module) -> tuple[type[nn.Module], ...]:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return ()
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    kinds = {type(m) for m in largest}
    if len(kinds) != 1 or next(iter(kinds)) in CONTAINERS:
        return ()
    return (kinds.pop(),)
