"""Shared fixtures: warm multi-process Gloo pools, one per world size, for the whole session."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:  # `pool` must import under any --import-mode
    sys.path.insert(0, str(_TESTS))
if importlib.util.find_spec("shardwise") is None:  # a checkout, not installed
    sys.path.insert(0, str(_TESTS.parent / "src"))

from pool import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], WorkerPool]]:
    """``pools(world_size)``: the session's pool of that size, started on first use.

    A pool a test broke respawns itself on its next run; tests that break pools on purpose
    should make their own ``WorkerPool`` so that the others keep a warm one.
    """
    cache: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        pool = cache.get(world_size)
        if pool is None or pool.closed:
            pool = cache[world_size] = WorkerPool(world_size)
        return pool

    yield get
    for pool in cache.values():
        pool.close()


@pytest.fixture
def pool(request: pytest.FixtureRequest, pools: Callable[[int], WorkerPool]) -> WorkerPool:
    """The shared pool of ``world_size`` given by indirect parametrization (default 2)."""
    return pools(getattr(request, "param", 2))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The vLLM engines tests/test_rl.py uses take about a minute to boot on two cores: start
    them as soon as the session's tests are known to need them, so that they boot while the
    tests before that file run (its ``servers`` fixture waits for them and stops them)."""
    if session.config.option.collectonly:
        return
    if any("servers" in getattr(item, "fixturenames", ()) for item in session.items):
        import rl_engines

        rl_engines.start_servers()


def pytest_sessionfinish(session: pytest.Session) -> None:
    engines = sys.modules.get("rl_engines")
    if engines is not None:  # an interrupted session never reached the fixture's end
        engines.stop_servers()
