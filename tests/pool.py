"""A pool of long-lived worker processes that form one Gloo process group, shared by tests.

Spawning a process and importing torch costs seconds, so tests do not spawn per test: a pool
is started once per world size and runs many small tasks. Every task runs on all ranks; its
results, or its failures, come back per rank. A pool that a task broke (a rank died, a task
overran its timeout, the group no longer passes a health check) is killed and respawned
transparently by the next ``run``.

This module imports no torch at top level: workers unpickle their entry point from here and
must set ``OMP_NUM_THREADS`` before torch is first imported.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import Any

__all__ = ["Outcome", "WorkerError", "WorkerPool", "WorkerTimeout"]


@contextlib.contextmanager
def framework_task():
    """Around a task that runs a training framework in a pool worker: the framework edits
    os.environ (Lightning's teardown drops WORLD_SIZE, transformers sets its own variables) and
    warns about the tiny models; the worker lives on with its environment as it was."""
    saved = dict(os.environ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class WorkerError(RuntimeError):
    """A task failed on one or more ranks, or a worker died; ``outcomes`` holds every rank's."""

    def __init__(self, message: str, outcomes: list[Outcome] | None = None) -> None:
        super().__init__(message)
        self.outcomes = outcomes or []


class WorkerTimeout(WorkerError):
    """A task did not finish on every rank within the pool's timeout."""


@dataclass
class Outcome:
    """What one rank did with one task: a value, a raised error, an exit, or no answer."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str | None = None  # qualified exception type, "died" or "timeout"
    error_message: str | None = None
    exitcode: int | None = None  # set when the worker process ended
    elapsed: float = 0.0  # seconds from dispatch until the answer (or death, or deadline)
    traceback: str | None = None  # remote traceback text
    exception: BaseException | None = None  # the remote exception, when it survived pickling


# --------------------------------------------------------------------------- worker side


def _failure(exc: BaseException) -> dict[str, Any]:
    """Describe an exception as plain data; keep the object only if it pickles both ways."""
    info: dict[str, Any] = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "exception": None,
    }
    try:
        pickle.loads(pickle.dumps(exc))
        info["exception"] = exc
    except Exception:
        pass
    return info


def _reply(conn: connection.Connection, *msg: Any) -> None:
    """Send with plain pickle: torch's ForkingPickler would move tensors to shared memory."""
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an unpicklable result becomes a failure
        data = pickle.dumps((*msg[:2], False, _failure(exc)), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone, even while a task is stuck in a collective."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(70)


def _health(seq: int, timeout: float) -> bool | str:
    """A tiny all_reduce with a short timeout: does the default group still line up?"""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0, float(seq)])
    dist.all_reduce(t, async_op=True).wait(timeout=timedelta(seconds=timeout))
    n = dist.get_world_size()
    if t.tolist() != [float(n), float(n * seq)]:
        return f"health all_reduce gave {t.tolist()}, expected {[n, n * seq]}"
    return True


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    sys_path: list[str],
    conn: connection.Connection,
    group_timeout: float,
    parent_pid: int,
) -> None:
    """Entry point of a worker: join the group, then run tasks until told to stop."""
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=group_timeout)
        )
    except BaseException as exc:
        _reply(conn, "init_error", _failure(exc))
        return
    _reply(conn, "ready", os.getpid())
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent closed its end or is gone
            return
        kind, seq, arg = msg
        if kind == "stop":
            _exit_now(dist)
        try:
            if kind == "health":
                _reply(conn, "result", seq, True, _health(seq, arg))
                continue
            fn, args, kwargs = pickle.loads(arg)
            value = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit from a task is a failure, not an exit
            _reply(conn, "result", seq, False, _failure(exc))
        else:
            _reply(conn, "result", seq, True, value)


def _exit_now(dist: Any) -> None:
    """Leave the group and exit at once: a normal exit spends ~0.6 s tearing down torch."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    atexit._run_exitfuncs()  # what a normal exit would run first (coverage saves here)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- parent side


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close()


class WorkerPool:
    """``world_size`` spawned workers in one Gloo group that run module-level functions.

    ``timeout`` bounds each task (seconds) and is also the group's collective timeout unless
    ``group_timeout`` is given. When one rank raises in ``run``, the others get ``error_grace``
    seconds to answer before the pool is killed: they may be blocked in a collective waiting
    for the failed rank.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 120.0,
        group_timeout: float | None = None,
        start_timeout: float = 120.0,
        error_grace: float = 5.0,
        health_timeout: float = 5.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.group_timeout = timeout if group_timeout is None else group_timeout
        self.start_timeout = start_timeout
        self.error_grace = error_grace
        self.health_timeout = min(health_timeout, timeout)
        self.generation = 0  # how many times workers were (re)spawned
        self.spawn_seconds = 0.0  # how long the last spawn took
        self._procs: list[Any] = []
        self._conns: list[connection.Connection] = []
        self._seq = 0
        self._broken = True
        self._closed = False
        _live_pools.add(self)
        self._spawn()

    # -- public API

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def broken(self) -> bool:
        """True when the next ``run`` will respawn the workers first."""
        return self._broken or not all(p.is_alive() for p in self._procs)

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the values, index = rank.

        Raises ``WorkerError`` if a rank raised or died and ``WorkerTimeout`` if the task
        overran. After a raise the pool is kept when a health check passes, else respawned.
        """
        outcomes = self._execute(fn, args, kwargs, grace=self.error_grace)
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            return [o.value for o in outcomes]
        raised = [o for o in failed if o.error_type not in ("died", "timeout")]
        if len(raised) == len(failed):
            verdict = self._check_health()
        else:
            self._kill()
            verdict = "pool killed; the next run respawns it"
        message = _describe(fn, outcomes, verdict)
        if all(o.error_type == "timeout" for o in failed):
            raise WorkerTimeout(message, outcomes)
        raise WorkerError(message, outcomes)

    def run_outcomes(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Outcome]:
        """Run ``fn`` on every rank and report each rank's outcome, failures included.

        Waits until every rank answered or died, at most ``timeout``. Any failure leaves the
        pool broken: it is killed now and respawned by the next run.
        """
        outcomes = self._execute(fn, args, kwargs, grace=None)
        if not all(o.ok for o in outcomes):
            self._kill()
        return outcomes

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers: a stop message, a join bounded by ``timeout``, then SIGKILL."""
        if self._closed:
            return
        self._closed = True
        _live_pools.discard(self)
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("stop", 0, None)))
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self.broken else "ready"
        return f"WorkerPool(world_size={self.world_size}, {state}, generation={self.generation})"

    # -- internals

    def _spawn(self, attempts: int = 2) -> None:
        """Start fresh workers; retry once, since the free port we picked may be taken."""
        # (the parent's: workers import no torch early)
        from shardwise.core.addresses import free_port

        ctx = get_context("spawn")
        started = time.monotonic()
        for attempt in range(attempts):
            port = free_port()
            for rank in range(self.world_size):
                ours, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, port, list(sys.path), theirs,
                          self.group_timeout, os.getpid()),
                    name=f"pool{self.world_size}-rank{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
            outcomes = self._collect(None, time.monotonic(), self.start_timeout, grace=0.0)
            if all(o.ok for o in outcomes):
                self._broken = False
                self.generation += 1
                self.spawn_seconds = time.monotonic() - started
                return
            self._kill()
            if attempt == attempts - 1:
                raise WorkerError(
                    _describe(None, outcomes, f"workers failed to start ({attempts} tries)"),
                    outcomes,
                )

    def _execute(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, *, grace: float | None
    ) -> list[Outcome]:
        if self._closed:
            raise RuntimeError("WorkerPool is closed")
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cannot pickle task {fn!r}: use a module-level function and picklable "
                f"arguments ({exc})"
            ) from exc
        if self.broken:
            self._kill()
            self._spawn()
        return self._dispatch("task", payload, self.timeout, grace)

    def _dispatch(self, kind: str, arg: Any, timeout: float, grace: float | None) -> list[Outcome]:
        self._seq += 1
        data = pickle.dumps((kind, self._seq, arg), protocol=pickle.HIGHEST_PROTOCOL)
        start = time.monotonic()
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead worker: _collect reports its exit code
                conn.send_bytes(data)
        try:
            return self._collect(self._seq, start, timeout, grace=grace)
        except BaseException:  # e.g. KeyboardInterrupt: the task state is unknown
            self._kill()
            raise

    def _collect(
        self, seq: int | None, start: float, timeout: float, *, grace: float | None
    ) -> list[Outcome]:
        """Wait for one answer per rank (``seq=None``: the start-up message), polling liveness.

        With a ``grace``, the first failure shortens the wait for the remaining ranks.
        """
        outcomes: list[Outcome | None] = [None] * self.world_size
        deadline = start + timeout
        waited_for = "timeout"
        while (pending := [r for r, o in enumerate(outcomes) if o is None]) and (
            now := time.monotonic()
        ) < deadline:
            ready = set(
                connection.wait(
                    [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                    timeout=min(1.0, deadline - now),
                )
            )
            for r in pending:
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    outcomes[r] = self._receive(r, seq, start)
                elif proc.sentinel in ready or not proc.is_alive():
                    outcomes[r] = self._died(r, start)
            failed = grace is not None and any(o is not None and not o.ok for o in outcomes)
            if failed and time.monotonic() + grace < deadline:
                deadline = time.monotonic() + grace
                waited_for = f"no answer within {grace:g} s after another rank failed"
        elapsed = time.monotonic() - start
        if waited_for == "timeout":
            waited_for = f"no answer within {timeout:g} s"
        return [
            o or Outcome(r, False, error_type="timeout", error_message=waited_for, elapsed=elapsed)
            for r, o in enumerate(outcomes)
        ]

    def _receive(self, rank: int, seq: int | None, start: float) -> Outcome | None:
        """Read one message from ``rank``; a stale one (an older seq) reads as no answer."""
        try:
            msg = pickle.loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError):  # the worker exited, maybe mid-send
            return self._died(rank, start)
        except Exception as exc:  # e.g. the value's class cannot be imported here
            return Outcome(rank, False, error_type=type(exc).__qualname__,
                           error_message=f"cannot unpickle the answer: {exc}",
                           elapsed=time.monotonic() - start)
        elapsed = time.monotonic() - start
        if msg[0] == "ready":
            return Outcome(rank, True, value=msg[1], elapsed=elapsed)
        if msg[0] == "init_error":
            return _failed(rank, msg[1], elapsed)
        _, got, ok, value = msg
        if got != seq:
            return None
        return Outcome(rank, True, value, elapsed=elapsed) if ok else _failed(rank, value, elapsed)

    def _died(self, rank: int, start: float) -> Outcome:
        proc = self._procs[rank]
        proc.join(1.0)
        return Outcome(
            rank, False, error_type="died", exitcode=proc.exitcode,
            error_message=f"worker process exited with code {proc.exitcode}",
            elapsed=time.monotonic() - start,
        )

    def _check_health(self) -> str:
        """After a task raised: keep the pool if a short all_reduce still lines up on all ranks."""
        outcomes = self._dispatch("health", self.health_timeout, self.health_timeout + 5.0, None)
        bad = [o for o in outcomes if not (o.ok and o.value is True)]
        if not bad:
            return "the group passed a health check; the pool stays up"
        self._kill()
        why = "; ".join(f"rank {o.rank}: {o.error_message or o.value}" for o in bad)
        return f"the group failed a health check ({why}); the next run respawns the pool"

    def _kill(self) -> None:
        """Kill every worker at once and forget them; the next run respawns."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._broken = True


def _failed(rank: int, info: dict[str, Any], elapsed: float) -> Outcome:
    return Outcome(
        rank, False, error_type=info["type"], error_message=info["message"], elapsed=elapsed,
        traceback=info["traceback"], exception=info["exception"],
    )


def _describe(fn: Callable[..., Any] | None, outcomes: list[Outcome], verdict: str) -> str:
    """A readable report of the failed ranks, remote tracebacks included."""
    failed = [o for o in outcomes if not o.ok]
    name = "start-up" if fn is None else f"{fn.__module__}.{fn.__qualname__}"
    lines = [f"{name} failed on rank(s) {[o.rank for o in failed]} of {len(outcomes)}; {verdict}"]
    for o in failed:
        head = f"--- rank {o.rank}: {o.error_type}: {o.error_message} ({o.elapsed:.2f} s)"
        lines.append(head)
        if o.traceback:
            lines.append(o.traceback.rstrip())
    return "\n".join(lines)
