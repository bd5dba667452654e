"""The planner's result (``Plan``), as text (the table ``shardwise plan`` prints) and as data
(its ``--json``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import ShardwiseError
from ..core.policies import Settings
from . import budget as search
from .estimate import ONE_MEMORY, Estimate


@dataclass
class Plan:
    """Estimates side by side; with a budget, the search's path (planner/budget.py), the
    fastest configuration on it that fits, and why."""

    estimates: list[Estimate]
    title: str
    parameters: int = 0  # the model's, exact (each counted once)
    budget: int | None = None
    choice: Estimate | None = None
    reason: str = ""
    one_memory: bool = False  # a CPU run: host and device are one memory (Note [one memory])
    path: list[search.Step] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # moves that lowered nothing

    @property
    def settings(self) -> Settings:
        """The chosen configuration, as ``shard(model, plan=...)`` applies it."""
        if self.choice is None or self.choice.settings is None:
            raise ShardwiseError(
                f"this plan chose nothing to apply: {self.reason or 'it was made without budget='}"
            )
        return self.choice.settings

    def __str__(self) -> str:
        return render(self)


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _runs(units) -> list[tuple[str, object]]:
    """The units' rows, a run of three or more alike (the same sizes, names that differ only
    in a trailing index: a model's repeated blocks) as one row ``layers.{0..31} (x32, each)``."""
    out: list[tuple[str, object]] = []
    i = 0
    while i < len(units):
        u, j = units[i], i + 1
        stem, _, index = u.name.rpartition(".")
        while (
            index.isdigit()
            and j < len(units)
            and units[j].name == f"{stem}.{int(index) + j - i}"
            and (units[j].params, units[j].shard_bytes, units[j].gathered_bytes, units[j].owned)
            == (u.params, u.shard_bytes, u.gathered_bytes, u.owned)
        ):
            j += 1
        if j - i >= 3:
            out.append((f"{stem}.{{{index}..{int(index) + j - i - 1}}} (x{j - i}, each)", u))
        else:
            out += [(v.name, v) for v in units[i:j]]
        i = j
    return out


def render(p: Plan) -> str:
    """The plan as text: units, then one column per configuration."""
    e0 = p.estimates[0]
    lines = [f"shardwise plan: {p.title}", ""]
    shown = {}
    for e in p.estimates:
        if e.strategy.shard:
            shown.setdefault(e.wrap, e)
    for wrap, e in shown.items():
        head = f"units with wrap {wrap} ({len(e.units)}), per rank:"
        lines.append(f"{head:<46}params     shard    gathered")
        for name, u in _runs(e.units):
            lines.append(
                f"  {name:<32}{u.params:>12,} {_mib(u.shard_bytes)} {_mib(u.gathered_bytes)} MiB"
            )
        top = sorted(e.units, key=lambda u: -u.gathered_bytes)[:3]
        lines.append(
            "  largest gathered: " + ", ".join(f"{u.name} ({_fmt(u.gathered_bytes)})" for u in top)
        )
        lines.append("")
    cols = p.estimates
    rows = [
        ("parameter shards", lambda e: e.param_shards),
        ("gradients", lambda e: e.gradients),
        ("optimizer state", lambda e: e.optimizer),
        ("= model state", lambda e: e.model_state),
        ("gathered at most", lambda e: e.gathered_peak),
        ("activations (peak)", lambda e: e.activations),
        ("predicted peak " + ("(CPU)" if p.one_memory else "(device)"), lambda e: e.peak),
        ("host (offload)", lambda e: e.host),
        ("sent per step: all-gather", lambda e: e.comm["all_gather"]),
        ("  reduce-scatter", lambda e: e.comm["reduce_scatter"]),
        ("  all-reduce", lambda e: e.comm["all_reduce"]),
    ]
    if any(e.comm.get("replicate_all_reduce") for e in cols):  # hybrid: the link across groups
        rows.append(("  across shard groups", lambda e: e.comm.get("replicate_all_reduce", 0)))
    for start in range(0, len(cols), 4):
        chunk = cols[start : start + 4]
        heads = [f"path {start + j}" if p.path else _short(e) for j, e in enumerate(chunk)]
        lines.append(f"{'per rank, MiB':<27}" + "".join(f"{h:>26}" for h in heads))
        for name, get in rows:
            lines.append(f"  {name:<25}" + "".join(f"{_mib(get(e)):>26}" for e in chunk))
        lines.append(f"  {'peak happens at':<25}" + "".join(f"{_tail(e.peak_at, 25):>26}" for e in chunk))
        lines.append("")
    if any(c.wrap == "none" or c.activation_checkpointing or c.cpu_offload for c in cols):
        lines.append("columns: +root = no wrap (one unit), +ac = checkpointing, +off = cpu offload")
    owned = _owned_by_rank(e0)
    if owned:
        lines.append(
            "owned parameters, whole on one rank each (figures above: rank 0's): "
            + ", ".join(f"rank {r} {n} ({_fmt(b)})" for r, (n, b) in sorted(owned.items()))
        )
        for u in e0.units:
            if u.owned:
                lines.append(f"  {u.name}: " + ", ".join(f"{name} -> {r}" for name, r, _ in u.owned))
    elif e0.world_size > 1:
        lines.append(
            "ranks hold equal padded buffers; rank 0 the most optimizer state (most rows)."
        )
    if p.one_memory and (p.budget is not None or any(c.cpu_offload for c in cols)):
        lines.append(ONE_MEMORY + ".")
    if p.budget is not None:
        lines += ["", "the search's path, fastest first (planner/budget.py):"]
        lines += [f"  {i}. {s.why}" for i, s in enumerate(p.path)]
        if p.dropped:
            lines.append("  dropped: " + "; ".join(p.dropped))
        lines.append(f"budget {_fmt(p.budget)}: " + ("choose " if p.choice else "") + p.reason)
        if p.choice is not None:
            lines += search.table(p.choice.settings)
    return "\n".join(lines)


def _owned_by_rank(e: Estimate) -> dict[int, tuple[int, int]]:
    """Per owner rank: how many parameters it owns and their bytes."""
    out: dict[int, tuple[int, int]] = {}
    for u in e.units:
        for _, r, b in u.owned:
            n, total = out.get(r, (0, 0))
            out[r] = (n + 1, total + b)
    return out


def _short(e: Estimate) -> str:
    """A column header: the strategy, then +root (wrap none), +ac (checkpointing), +off."""
    name = f"{e.strategy}" + ("" if e.strategy.shard else " (DDP)")
    return (
        name
        + ("+root" if e.wrap == "none" else "")
        + ("+ac" if e.activation_checkpointing else "")
        + ("+off" if e.cpu_offload else "")
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:9.2f}"


# --- as data: ``shardwise plan --json`` (keys are kept stable; a new key may appear)
FORMAT, VERSION = "shardwise-plan", 1


def as_dict(p: Plan) -> dict:
    """The plan as JSON-ready data: the model's exact parameter count, then per configuration
    its bytes per rank (the largest rank's: model state, peak and when, per-unit table, bytes
    sent), and with a budget the search's path and the chosen per-unit settings."""
    out = {
        "format": FORMAT,
        "version": VERSION,
        "title": p.title,
        "parameters": p.parameters,
        "one_memory": p.one_memory,
        "estimates": [_estimate(e) for e in p.estimates],
        "budget": None,
    }
    if p.budget is not None:
        chosen = next((i for i, e in enumerate(p.estimates) if e is p.choice), None)
        out["budget"] = {
            "bytes": p.budget,
            "chosen": chosen,  # index into estimates, or None: nothing fits
            "settings": _settings(p.choice.settings) if p.choice is not None else None,
            "reason": p.reason,
            "path": [
                {"why": s.why, "peak_bytes": s.estimate.peak, "seconds": s.seconds} for s in p.path
            ],
            "dropped": list(p.dropped),
        }
    return out


def _estimate(e: Estimate) -> dict:
    return {
        "label": e.label,
        "strategy": e.strategy.value,
        "wrap": e.wrap,
        "world_size": e.world_size,
        "mixed_precision": e.mixed_precision,
        "parameter_shard_bytes": e.param_shards,
        "gradient_bytes": e.gradients,
        "optimizer_bytes": e.optimizer,
        "model_state_bytes": e.model_state,
        "gathered_peak_bytes": e.gathered_peak,
        "activation_bytes": e.activations,
        "peak_bytes": e.peak,
        "peak_at": e.peak_at,
        "host_bytes": e.host,
        "sent_bytes": dict(e.comm),
        "phase_peak_bytes": dict(e.phases),
        "units": [
            {
                "name": u.name,
                "parameters": u.params,
                "shard_bytes": u.shard_bytes,
                "gathered_bytes": u.gathered_bytes,
                "owned": [{"parameter": n, "owner": r, "bytes": b} for n, r, b in u.owned],
            }
            for u in e.units
        ],
        "settings": _settings(e.settings) if e.settings is not None else None,
    }


def _settings(s) -> dict:
    """A ``policies.Settings`` (what ``shard(plan=...)`` applies) as data."""
    return {
        "strategy": s.strategy.value,
        "wrap": "none" if s.wrap is None else repr(s.wrap),
        "units": [
            {
                "name": n,
                "reshard_after_forward": c.reshard_after_forward,
                "checkpoint": c.checkpoint,
                "offload": c.offload,
                "offload_activations": c.offload_activations,
            }
            for n, c in s.units
        ],
    }


def _tail(text: str, width: int) -> str:
    """``text`` in ``width`` characters, its end kept (a unit's name ends with what tells it apart)."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]
