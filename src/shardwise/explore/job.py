"""The rank processes of one explorer run, seen from the server: started, spoken to over
their stdin and stdout (one JSON object a line), watched until they exit, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import deque
from collections.abc import Callable

from ..core.addresses import free_port

ERROR_LINES = 12  # the tail of a rank's stderr kept to show why it died

# (rank, message) for each line a rank writes; (rank, exit code, what it raised or the tail of
# its stderr) when one exits
OnMessage = Callable[[int, dict], None]
OnExit = Callable[[int, int, str], None]


class Job:
    """``ranks`` processes of ``python -m shardwise.explore.rank`` forming one process group on
    this machine (NCCL on one GPU each where there are enough, else Gloo: machine.py). Their
    stdin closing (this server gone, however it ended) makes them exit."""

    def __init__(self, ranks: int, on_message: OnMessage, on_exit: OnExit):
        self.ranks = ranks
        self.on_message, self.on_exit = on_message, on_exit
        self.procs: list[asyncio.subprocess.Process] = []
        self.stopping = False
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        port = free_port()
        for rank in range(self.ranks):
            env = dict(
                os.environ, RANK=str(rank), WORLD_SIZE=str(self.ranks), LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "shardwise.explore.rank",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=env, limit=1 << 24,
            )
            self.procs.append(proc)
            self._tasks.append(asyncio.create_task(self._watch(rank, proc)))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def _watch(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        tail: deque[str] = deque(maxlen=ERROR_LINES)
        error = ""

        async def errors() -> None:
            async for line in proc.stderr:
                tail.append(line.decode(errors="replace").rstrip())

        reading = asyncio.create_task(errors())
        async for line in proc.stdout:
            message = json.loads(line)
            if message["type"] == "error":
                error = message["error"]
            if not self.stopping:  # (a job being stopped speaks for a run that is over)
                self.on_message(rank, message)
        code = await proc.wait()
        await reading
        if not self.stopping:
            self.on_exit(rank, code, error or "\n".join(tail))

    def send(self, command: dict) -> None:
        line = (json.dumps(command) + "\n").encode()
        for proc in self.procs:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    proc.stdin.write(line)

    async def stop(self, grace: float = 3.0) -> None:
        """Ask every rank to quit, then kill those still there after ``grace`` seconds."""
        self.stopping = True
        self.send({"cmd": "quit"})
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.procs)), grace)
        except asyncio.TimeoutError:
            for proc in self.procs:
                if proc.returncode is None:
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in self.procs))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
