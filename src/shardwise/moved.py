"""Old import paths of modules that moved (in 0.2, and since), kept importable (with a DeprecationWarning)
until 0.3.

``import shardwise.tools.plan`` (or ``from shardwise.checkpointing import ...``) imports the
module's new home and binds the old name to that very module, so attributes, patches and
``isinstance`` checks see one module, not a copy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "shardwise.tools.plan": "shardwise.planner.plan",
    "shardwise.tools.budget": "shardwise.planner.budget",
    "shardwise.tools.costs": "shardwise.planner.costs",
    "shardwise.tools.trace": "shardwise.observer.trace",
    "shardwise.tools.allocations": "shardwise.observer.allocations",
    "shardwise.tools.accounting": "shardwise.observer.accounting",
    "shardwise.tools.report": "shardwise.observer.report",
    "shardwise.tools.charts": "shardwise.observer.charts",
    "shardwise.tools.bench": "shardwise.bench.harness",
    "shardwise.tools.bench_counts": "shardwise.bench.counts",
    "shardwise.tools.bench_optim": "shardwise.bench.optimizers",
    "shardwise.tools.machine": "shardwise.bench.machine",
    "shardwise.tools.netns": "shardwise.bench.netns",
    "shardwise.checkpointing": "shardwise.core.recompute",
    "shardwise.activations": "shardwise.core.activation_offload",
    "shardwise.quantize": "shardwise.core.codecs",
    # one name per concept (issue 43)
    "shardwise.outer": "shardwise.core.replica_groups",
    "shardwise.rl.trainer": "shardwise.rl.sender",
    "shardwise.rl.wire": "shardwise.rl.packing",
    # the core in core/, the built-in job in job/ (issue 43)
    "shardwise.activation_offload": "shardwise.core.activation_offload",
    "shardwise.addresses": "shardwise.core.addresses",
    "shardwise.buckets": "shardwise.core.buckets",
    "shardwise.build": "shardwise.core.build",
    "shardwise.codecs": "shardwise.core.codecs",
    "shardwise.collectives": "shardwise.core.collectives",
    "shardwise.conversions": "shardwise.core.conversions",
    "shardwise.data": "shardwise.job.data",
    "shardwise.errors": "shardwise.core.errors",
    "shardwise.events": "shardwise.core.events",
    "shardwise.flight": "shardwise.core.flight",
    "shardwise.groups": "shardwise.core.groups",
    "shardwise.layout": "shardwise.core.layout",
    "shardwise.models": "shardwise.job.models",
    "shardwise.models.gpt": "shardwise.job.models.gpt",
    "shardwise.models.mha": "shardwise.job.models.mha",
    "shardwise.models.mlp": "shardwise.job.models.mlp",
    "shardwise.optimizer_guard": "shardwise.core.optimizer_guard",
    "shardwise.placement": "shardwise.core.placement",
    "shardwise.policies": "shardwise.core.policies",
    "shardwise.recompute": "shardwise.core.recompute",
    "shardwise.replica_groups": "shardwise.core.replica_groups",
    "shardwise.runtime": "shardwise.core.runtime",
    "shardwise.scaler": "shardwise.core.scaler",
    "shardwise.streams": "shardwise.core.streams",
    "shardwise.train": "shardwise.job.train",
    "shardwise.unit": "shardwise.core.unit",
    "shardwise.wrap": "shardwise.core.wrap",
}


class _OldName(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names only; every other import passes by after one dict lookup."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder, replaced in sys.modules by the new home below

    def exec_module(self, module):
        new = MOVED[module.__name__]
        # stacklevel 2: the import machinery's own frames are skipped, so this names the
        # caller's import line
        warnings.warn(
            f"{module.__name__} moved to {new}; the old name goes in 0.3", DeprecationWarning, stacklevel=2
        )
        # the import system returns what sys.modules holds after exec_module: the new home
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once (``import shardwise`` does): first, so
    that ``shardwise.models.gpt``, whose parent is the moved package itself, is this alias of
    its new home and not a second copy of it loaded from that package's folder."""
    if not any(isinstance(f, _OldName) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldName())
