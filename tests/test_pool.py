"""Tests of the multi-process test harness itself (tests/pool.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pool import Outcome, WorkerError, WorkerPool, WorkerTimeout

# ----------------------------------------------------------------- tasks (run in the workers)


def rank_and_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def environment() -> dict[str, str | int]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env: dict[str, str | int] = {name: os.environ[name] for name in names}
    env["threads"] = torch.get_num_threads()
    env["backend"] = dist.get_backend()
    return env


def rank_tensor() -> torch.Tensor:
    return torch.arange(3.0) + dist.get_rank()


def raise_on(rank: int) -> int:
    if dist.get_rank() == rank:
        raise ValueError(f"boom from rank {rank}")
    return dist.get_rank()


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickle calls cls(*args): one arg, fails
        super().__init__(f"needs {a} and {b}")


def raise_unpicklable() -> None:
    raise _Unpicklable(1, 2)


def return_unpicklable() -> object:
    return lambda: None


def exit_in_allreduce(victim: int, code: int) -> float:
    """Every rank but ``victim`` enters an all_reduce; ``victim`` exits while they wait."""
    if dist.get_rank() == victim:
        time.sleep(0.3)
        os._exit(code)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def exit_on(rank: int, code: int) -> int:
    if dist.get_rank() == rank:
        os._exit(code)
    return dist.get_rank()


def raise_while_others_wait(rank: int) -> float:
    if dist.get_rank() == rank:
        raise KeyError("left before the all_reduce")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


_unwaited: list[dist.Work] = []


def desync(rank: int) -> None:
    """``rank`` raises; the other leaves a collective in flight: the ranks no longer line up."""
    if dist.get_rank() == rank:
        raise ValueError("left early")
    _unwaited.append(dist.all_reduce(torch.ones(1), async_op=True))


def sleep_on(rank: int, seconds: float) -> int:
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def noop() -> None:
    return None


# ----------------------------------------------------------------- shared, warm pools


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_run_returns_one_value_per_rank(pools, world_size: int) -> None:
    results = pools(world_size).run(rank_and_sum)
    total = world_size * (world_size + 1) / 2
    assert results == [(rank, world_size, total) for rank in range(world_size)]


def test_workers_have_a_launcher_environment(pools) -> None:
    envs = pools(2).run(environment)
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["threads"] == 1
        assert env["backend"] == "gloo"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_tensors_come_back(pools) -> None:
    a, b = pools(2).run(rank_tensor)
    torch.testing.assert_close(a, torch.arange(3.0))
    torch.testing.assert_close(b, torch.arange(3.0) + 1)


def test_raising_rank_keeps_the_pool(pools) -> None:
    pool = pools(2)
    pool.run(noop)
    before = (pool.generation, pool.pids)
    with pytest.raises(WorkerError) as info:
        pool.run(raise_on, 1)
    message = str(info.value)
    assert "rank(s) [1]" in message and "ValueError: boom from rank 1" in message
    assert "in raise_on" in message  # the remote traceback
    assert "health check" in message
    assert not isinstance(info.value, WorkerTimeout)
    first, second = info.value.outcomes
    assert first.ok and first.value == 0
    assert isinstance(second.exception, ValueError)
    assert (pool.generation, pool.pids) == before
    assert pool.run(rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_unpicklable_exception_and_result_come_back_as_text(pools) -> None:
    pool = pools(2)
    generation = pool.generation
    with pytest.raises(WorkerError) as info:
        pool.run(raise_unpicklable)
    outcome = info.value.outcomes[0]
    assert outcome.error_type == "test_pool._Unpicklable"
    assert outcome.error_message == "needs 1 and 2"
    assert outcome.exception is None and "raise_unpicklable" in outcome.traceback
    with pytest.raises(WorkerError, match="rank\\(s\\) \\[0, 1\\]"):
        pool.run(return_unpicklable)
    assert pool.generation == generation
    assert pool.run(noop) == [None, None]


def test_unpicklable_task_fails_in_the_parent(pools) -> None:
    with pytest.raises(TypeError, match="cannot pickle"):
        pools(1).run(lambda: None)


def test_round_trip_is_cheap(pools) -> None:
    pool = pools(4)
    pool.run(noop)
    start = time.perf_counter()
    for _ in range(50):
        pool.run(noop)
    assert (time.perf_counter() - start) / 50 < 0.02  # measured ~0.3 ms


# ----------------------------------------------------------------- a pool to break


@pytest.fixture(scope="module")
def scratch() -> Iterator[WorkerPool]:
    """A 2-rank pool of its own, with short timeouts, for tests that break it."""
    with WorkerPool(
        2, timeout=3.0, group_timeout=2.0, error_grace=1.0, health_timeout=1.0
    ) as pool:
        yield pool


def _recovers(pool: WorkerPool, generation: int) -> None:
    assert pool.broken
    assert pool.run(rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert pool.generation == generation + 1 and not pool.broken


def test_rank_exiting_mid_collective(scratch: WorkerPool) -> None:
    generation = scratch.generation
    start = time.monotonic()
    survivor, victim = scratch.run_outcomes(exit_in_allreduce, 1, 3)
    assert time.monotonic() - start < scratch.timeout
    assert isinstance(victim, Outcome)
    assert (victim.ok, victim.error_type, victim.exitcode) == (False, "died", 3)
    # Gloo sees the closed socket at once: no wait for the group timeout.
    assert not survivor.ok and survivor.exitcode is None
    assert survivor.error_type == "RuntimeError"
    assert "Connection closed by peer" in survivor.error_message
    assert survivor.elapsed < scratch.group_timeout
    _recovers(scratch, generation)


def test_run_reports_a_dead_rank(scratch: WorkerPool) -> None:
    generation = scratch.generation
    with pytest.raises(WorkerError, match="rank 1: died: worker process exited with code 5"):
        scratch.run(exit_on, 1, 5)
    _recovers(scratch, generation)


def test_raise_while_others_block(scratch: WorkerPool) -> None:
    """The others wait in a collective for the rank that raised: cut short, not hung."""
    generation = scratch.generation
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        scratch.run(raise_while_others_wait, 0)
    assert time.monotonic() - start < scratch.error_grace + 5.0
    assert not isinstance(info.value, WorkerTimeout)
    assert "KeyError" in str(info.value)
    assert info.value.outcomes[1].error_type == "timeout"
    _recovers(scratch, generation)


def test_desynced_group_fails_the_health_check(scratch: WorkerPool) -> None:
    generation = scratch.generation
    with pytest.raises(WorkerError, match="failed a health check") as info:
        scratch.run(desync, 1)
    assert [o.ok for o in info.value.outcomes] == [True, False]
    _recovers(scratch, generation)


def test_timeout_names_the_slow_rank(scratch: WorkerPool) -> None:
    generation = scratch.generation
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match="rank\\(s\\) \\[1\\]") as info:
        scratch.run(sleep_on, 1, 60.0)
    assert scratch.timeout <= time.monotonic() - start < scratch.timeout + 3.0
    assert info.value.outcomes[0].ok
    _recovers(scratch, generation)


def test_workers_die_with_their_parent() -> None:
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pool import WorkerPool
        if __name__ == "__main__":
            print(*WorkerPool(1).pids, flush=True)
            os._exit(0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    (pid,) = map(int, out.stdout.split())
    deadline = time.monotonic() + 10.0
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow to collect it)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
