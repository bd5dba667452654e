"""Old home of the planner, observer and benchmark harness (before 0.2).

``shardwise.tools.<name>`` still imports, with a DeprecationWarning, until 0.3: use
``shardwise.planner``, ``shardwise.observer`` or ``shardwise.bench``.
"""

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "plan": "shardwise.planner.plan",
    "budget": "shardwise.planner.budget",
    "costs": "shardwise.planner.costs",
    "trace": "shardwise.observer.trace",
    "allocations": "shardwise.observer.allocations",
    "accounting": "shardwise.observer.accounting",
    "report": "shardwise.observer.report",
    "charts": "shardwise.observer.charts",
    "bench": "shardwise.bench.harness",
    "bench_counts": "shardwise.bench.counts",
    "bench_optim": "shardwise.bench.optimizers",
    "machine": "shardwise.bench.machine",
    "netns": "shardwise.bench.netns",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``shardwise.tools.<name>`` to the module that now holds it."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix == __name__ and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        new = MOVED[module.__name__.rpartition(".")[2]]
        warnings.warn(f"{module.__name__} moved to {new}; the old name goes in 0.3", DeprecationWarning, stacklevel=2)
        module.__getattr__ = functools.partial(getattr, importlib.import_module(new))


sys.meta_path.insert(0, _Alias())
