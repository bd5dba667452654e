"""A flight recorder of this rank's recent collectives, and the diagnosis when one fails.

Every collective shardwise issues is recorded (call number, kind, unit, elements, dtype) in
a ring of the last ``RING`` and folded into a digest of the sequence since the last step
check (``take_digest``), which ranks compare once per step (Runtime's step check). When a
wait fails or times out, or the digests differ, each rank posts its ring to the store that
torchrun (or ``init_process_group``'s ``env://``) already runs, reads the others', and raises
a ``CollectiveError`` that names, per rank, the collective where the ranks parted or where
each one was stuck. Recording costs a couple of microseconds per collective; the store is
touched only on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zlib
from collections import deque
from datetime import timedelta

import torch.distributed as dist

from . import groups
from .errors import CollectiveError

RING = 64
EXCHANGE_WAIT_S = 10.0  # at most this, and half the collective timeout, a failing rank waits
# for the others' records: ranks stuck on each other time out within about the same moment
_MASK = (1 << 62) - 1

FIX = (
    "Every rank must run the same units in the same order. A unit that runs on some ranks but "
    "not on others (a branch taken by the data, an expert wrapped as its own unit) cannot be "
    "sharded: wrap the parent module instead, so that the branches share one unit that every "
    "rank gathers (parameters unused on some ranks are then reduced as in DDP). "
    "The time limit is set with shardwise.init(timeout=seconds)."
)


class Record:
    """One collective as this rank issued it."""

    __slots__ = ("seq", "kind", "label", "numel", "dtype", "done")

    def __init__(self, seq: int, kind: str, label: str, numel: int, dtype: str):
        self.seq, self.kind, self.label, self.numel, self.dtype = seq, kind, label, numel, dtype
        self.done = False

    def describe(self) -> str:
        state = "completed" if self.done else "not completed"
        return (
            f"call #{self.seq} {self.kind} for unit '{self.label}' "
            f"({self.numel} {self.dtype} elements), {state}"
        )

    def key(self) -> tuple:
        return (self.kind, self.label, self.numel, self.dtype)


_ring: deque[Record] = deque(maxlen=RING)
_seq = 0
_digest = 0
_fingerprints: dict[tuple, int] = {}
_dtype_names: dict = {}  # torch.float32 -> "float32"
_incidents = 0
_apart = 0  # depth of apart() blocks


@contextlib.contextmanager
def apart():
    """Collectives issued inside are those of some ranks only, by design (with hybrid
    sharding, one replica gathers a full state dict while the others, which hold the same
    rows, do not): they stay out of the digest and of the call numbering that ranks compare,
    and a failed one is still named by its own rank."""
    global _apart
    _apart += 1
    try:
        yield
    finally:
        _apart -= 1


def record(kind: str, label: str, numel: int, dtype) -> Record:
    """Note a collective about to be issued; returns its record (mark ``done`` at completion)."""
    global _seq, _digest
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    dtype = name
    rec = Record(_seq, kind, label, numel, dtype)
    if _apart:
        return rec
    _seq += 1
    _ring.append(rec)
    key = (kind, label, numel, dtype)
    fp = _fingerprints.get(key)
    if fp is None:
        fp = _fingerprints[key] = zlib.crc32("|".join(map(str, key)).encode())
    _digest = (_digest * 1_000_003 + fp) & _MASK
    return rec


def take_digest() -> int:
    """The digest of the collectives recorded since the last call (62 bits), and restart it.
    Inside ``apart()`` (the planner's fake world among them), 0, and the digest goes on: what
    is issued there is not recorded, and the step check it ends takes nothing from outside."""
    global _digest
    if _apart:
        return 0
    d, _digest = _digest, 0
    return d


def diagnose(failed: Record | None, cause: str) -> CollectiveError:
    """The error every rank raises when collectives went wrong: ``cause`` says what this rank
    saw; the records of all ranks (exchanged over the store) say where each one was."""
    global _incidents
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = [[r.seq, r.kind, r.label, r.numel, r.dtype, r.done] for r in _ring]
    rings = _exchange(_incidents, rank, world, mine)
    _incidents += 1
    where = _where(rings, world)
    head = f"rank {rank}: {cause}"
    if failed is not None:
        head = f"rank {rank}: {failed.kind} for unit '{failed.label}' did not complete ({cause})"
    return CollectiveError(f"{head}. Where each rank was:\n" + "\n".join(where) + "\n" + FIX)


def _exchange(incident: int, rank: int, world: int, mine: list) -> dict[int, list]:
    """Post this rank's ring, collect the others' until they all answer or the wait ends."""
    rings = {rank: mine}
    store = _store()
    if store is None or world == 1:
        return rings
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"shardwise/flight/{attempt}/{incident}/"
    try:
        store.set(prefix + str(rank), json.dumps(mine))
        deadline = time.monotonic() + min(EXCHANGE_WAIT_S, groups.timeout_s() / 2)
        while len(rings) < world and time.monotonic() < deadline:
            for r in range(world):
                if r not in rings and store.check([prefix + str(r)]):
                    rings[r] = json.loads(store.get(prefix + str(r)))
            time.sleep(0.05)
    except Exception:  # the store went with a dead rank: report what we have
        pass
    return rings


def _store():
    """A client of the store the default group rendezvoused on (torchrun's, or env://)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=5))
    except Exception:
        return None


def _where(rings: dict[int, list], world: int) -> list[str]:
    """Per rank: the record at the first call where the ranks differ, else the first one not
    completed (where it was waiting), else its last."""
    by_seq = {r: {rec[0]: rec for rec in ring} for r, ring in rings.items()}
    common = sorted(set.intersection(*(set(s) for s in by_seq.values()))) if by_seq else []
    first_diff = next(
        (s for s in common if len({tuple(by_seq[r][s][1:5]) for r in by_seq}) > 1), None
    )
    lines = []
    for r in range(world):
        ring = rings.get(r)
        if ring is None:
            lines.append(f"  rank {r}: no answer (its process died, or it is stuck outside shardwise)")
            continue
        if not ring:
            lines.append(f"  rank {r}: no collective issued yet")
            continue
        if first_diff is not None:
            rec = by_seq[r][first_diff]
        else:
            rec = next((x for x in ring if not x[5]), ring[-1])
        shown = Record(rec[0], rec[1], rec[2], rec[3], rec[4])
        shown.done = rec[5]
        lines.append(f"  rank {r}: {shown.describe()}")
    if first_diff is not None:
        lines.append(f"  (the ranks parted at call #{first_diff})")
    return lines
