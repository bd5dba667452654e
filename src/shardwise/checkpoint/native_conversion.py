"""``convert(ckpt, out, to="shardwise", model=..., optimizer=...)``: a torch.distributed.checkpoint
directory (FSDP2's or torchtitan's layout, or shardwise's ``save(format="dcp")``) as a checkpoint
in shardwise's own format, offline (no process group).

A DCP directory alone cannot tell a parameter from a buffer, nor name the optimizer's class,
both of which shardwise's index records. The model the checkpoint belongs to (built on the meta
device: no memory) says the first; the param groups' hyper-parameter names say the second when
one torch.optim class has exactly them, else the caller names it. Nothing is guessed: every
ambiguity is a CheckpointError naming the fix.

The output is one file holding every tensor whole, each read from the DCP chunks only as the
writer reaches it (memory: the largest tensor). It records no RNG states (DCP holds none).
"""

from __future__ import annotations

import functools
import json
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from . import commit, dcp, files
from .dcp_loading import model_names, optimizer_prefix, per_element_keys, saved_groups
from .index import CheckpointError, Index, Piece, TensorRecord, is_dcp, rank_file, storable_hyper
from .state import persistent_buffers

_RENAMED = (
    "convert needs the model the checkpoint was saved from; for one whose modules were "
    "renamed, load the DCP directory with shardwise.load(path, model, opt, names=...) and "
    "shardwise.save it"
)


def from_dcp(ckpt: Path, out: Path, model: nn.Module, optimizer: str | None) -> list[Path]:
    """Write the DCP directory ``ckpt`` as the shardwise checkpoint ``out`` for ``model`` (its
    names, parameters and buffers; any device, meta included). ``optimizer``: the class name
    (e.g. ``"AdamW"``) where the saved hyper-parameters fit several; return the files written."""
    if not is_dcp(ckpt):
        raise CheckpointError(
            f"{ckpt} is not a torch.distributed.checkpoint directory (no .metadata)"
        )
    if out.exists():
        raise CheckpointError(f"{out} exists: convert writes a new directory")
    reading = dcp.Reading(ckpt)
    md = reading.metadata.state_dict_metadata
    params = _parameters(model)
    buffers = {n: tuple(b.shape) for n, b in persistent_buffers(model).items()}
    aliases = {a for _, names in params.values() for a in names}
    under, stored = model_names(md, list(params) + list(buffers), aliases, lambda n: n, _RENAMED)
    for name, (shape, _) in {**params, **{b: (s, ()) for b, s in buffers.items()}}.items():
        if tuple(md[stored[name]].size) != shape:
            raise CheckpointError(
                f"tensor '{stored[name]}' has shape {list(md[stored[name]].size)} in {ckpt}; the "
                f"model's '{name}' has {list(shape)}: is it the model this checkpoint belongs to?"
            )
    records: list[tuple[TensorRecord, str]] = []  # and the DCP key its bytes come from
    for name, (_, names) in params.items():
        records.append((_record(name, "param", md[stored[name]], aliases=names), stored[name]))
    for name in buffers:
        records.append((_record(name, "buffer", md[stored[name]]), stored[name]))
    bare = {n: k[len(under) :] for n, k in stored.items() if n in params}
    prefix = optimizer_prefix(md, list(bare.values()))
    for key in [dcp.SHARDWISE, "train_state.step"] + [
        k for k in md if prefix is not None and k.startswith(prefix)
    ]:
        if isinstance(md.get(key), BytesStorageMetadata):
            reading.value(key)
    values = reading.run()
    meta = json.loads(values[dcp.SHARDWISE]) if dcp.SHARDWISE in values else {}
    saved_opt = None
    if prefix is not None:
        recorded = meta.get("optimizer")  # shardwise's own DCP saves name it
        if recorded and optimizer not in (None, recorded):
            raise CheckpointError(
                f"{ckpt} was saved by shardwise from a {recorded}: drop --optimizer {optimizer}"
            )
        saved_opt = _optimizer(md, prefix, values, params, bare, recorded, optimizer, records)
    elif optimizer is not None:
        raise CheckpointError(f"{ckpt} holds no optimizer state: drop --optimizer {optimizer}")
    step = meta.get("step")
    if step is None and "train_state.step" in md:  # torchtitan's: a 0-dim tensor or a number
        v = values.get("train_state.step")
        step = int(v if v is not None else _read(reading, "train_state.step", md))
    return _write(ckpt, out, reading, md, records, saved_opt, step, meta)


def _parameters(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """First qualified name -> (shape, the parameter's other names), in model order."""
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shape, names = out[first[id(p)]]
            out[first[id(p)]] = (shape, (*names, name))
        else:
            first[id(p)] = name
            out[name] = (tuple(p.shape), ())
    return out


def _record(name: str, kind: str, entry: TensorStorageMetadata, **kw: Any) -> TensorRecord:
    shape = tuple(entry.size)
    return TensorRecord(name, kind, entry.properties.dtype, shape, **kw)


def _read(reading: dcp.Reading, key: str, md: dict) -> torch.Tensor:
    """The whole tensor ``key``, read from every chunk that holds part of it."""
    entry = md[key]
    t = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    rows = t.shape[0] if t.dim() else 1
    reading.rows(key, 0, rows, t.view(rows, *t.shape[1:]) if t.dim() else t)
    reading.run()
    return t


def _optimizer(md, prefix, values, params, bare, recorded, optimizer, records) -> dict:
    """The index's optimizer entry (class: as ``recorded`` by shardwise, else inferred or as
    named by ``optimizer``; param groups by model name; plain values); adds the state tensors'
    records to ``records``."""
    model_of = {b: n for n, b in bare.items()}
    groups = _groups(prefix, values, model_of, list(params))
    hypers = set().union(*(set(g) - {"params"} for g in groups))
    cls = recorded or _optimizer_class(hypers, optimizer)
    per_element = per_element_keys(md, prefix, {bare[n]: params[n][0] for n in bare})
    head = prefix + "state."
    opt_values: dict[str, dict] = {}
    for key, entry in md.items():
        if not key.startswith(head):
            continue
        owner, _, k = key[len(head) :].rpartition(".")
        if owner not in model_of:
            raise CheckpointError(
                f"optimizer state '{key}' belongs to no parameter of the model (nor is '{k}' a "
                "state key under a parameter's name)"
            )
        name = model_of[owner]
        shape = params[name][0]
        if isinstance(entry, BytesStorageMetadata):
            v = values[key]
            if v is not None and not isinstance(v, (bool, int, float)):
                raise CheckpointError(
                    f"optimizer state '{key}' is a {type(v).__name__}: only tensors and numbers convert"
                )
            opt_values.setdefault(name, {})[k] = v
            continue
        if k in per_element and tuple(entry.size) == shape:
            kind = "optim"
        elif not entry.size:
            kind = "optim_scalar"
        else:
            raise CheckpointError(
                f"optimizer state '{key}' has shape {list(entry.size)}; its parameter has "
                f"{list(shape)}: state tensors must be shaped like their parameter or 0-dim"
            )
        rec = _record(f"optim.{name}.{k}", kind, entry, param=name, key=k)
        records.append((rec, key))
    return {"class": cls, "param_groups": groups, "values": opt_values}


def _groups(prefix: str, values: dict, model_of: dict[str, str], order: list[str]) -> list[dict]:
    """The param groups as the index holds them (hyper-parameters and ``params``, model
    names): FSDP2's in their saved order; torchtitan's flattened ones (one per distinct set of
    hyper-parameters) in the model's order of their first parameter."""
    head = prefix + "param_groups."
    indexed: dict[int, dict] = {}
    for key, v in values.items():
        owner, _, hyper = key[len(head) :].rpartition(".")
        if key.startswith(head) and owner.isdigit():
            indexed.setdefault(int(owner), {})[hyper] = v
    if indexed and all("params" in g for g in indexed.values()):
        saved = [indexed[i] for i in sorted(indexed)]
    else:
        by_param = saved_groups(prefix, values)
        saved = []
        for b in sorted(by_param, key=lambda b: order.index(model_of.get(b, order[0]))):
            g = by_param[b]
            if not any(g is s for s in saved):
                saved.append(g)
        saved = [{**g, "params": [b for b, sg in by_param.items() if sg is g]} for g in saved]
    out = []
    for g in saved:
        unknown = [b for b in g["params"] if b not in model_of]
        if unknown:
            raise CheckpointError(f"param groups name parameters the model lacks: {unknown[:5]}")
        hyper = storable_hyper(g, "a param group")
        hyper["params"] = sorted((model_of[b] for b in g["params"]), key=order.index)
        out.append(hyper)
    return out


@functools.cache
def _torch_optimizers() -> dict[str, frozenset[str]]:
    """torch.optim's optimizer classes by name, with their param groups' hyper-parameter names."""
    out = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            continue
        if cls is torch.optim.Optimizer:
            continue
        try:
            opt = cls([nn.Parameter(torch.zeros(2, 2))])
        except Exception:  # needs arguments with no default: not named by its hyper-parameters
            continue
        out[name] = frozenset(opt.param_groups[0]) - {"params"}
    return out


def _optimizer_class(hypers: set[str], named: str | None) -> str:
    """The optimizer class whose param groups have exactly ``hypers``, or the one ``named``
    (checked to have at least them)."""
    known = _torch_optimizers()
    if named is not None:
        if named not in known:
            raise CheckpointError(
                f"--optimizer {named}: not an optimizer of torch.optim; one of {', '.join(sorted(known))}"
            )
        lacking = hypers - known[named]
        if lacking:
            raise CheckpointError(
                f"the checkpoint's optimizer is not a {named}: its param groups have "
                f"{sorted(lacking)}, which {named}'s lack"
            )
        return named
    fits = sorted(n for n, keys in known.items() if keys == hypers)
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise CheckpointError(
            f"the checkpoint's param groups fit several optimizers ({', '.join(fits)}): name "
            f"it, e.g. --optimizer {fits[-1]}"
        )
    raise CheckpointError(
        f"no torch.optim optimizer has exactly the checkpoint's hyper-parameters "
        f"{sorted(hypers)}: name it with --optimizer, one of {', '.join(sorted(known))}"
    )


def _write(ckpt, out, reading, md, records, saved_opt, step, meta) -> list[Path]:
    name = rank_file(0, 1)
    entries = [
        files.Entry(
            rec.name,
            rec.dtype,
            rec.shape,
            functools.partial(lambda k: (_read(reading, k, md),), key),
        )
        for rec, key in records
    ]
    tensors = {}
    for rec, _ in records:
        rec.pieces = [Piece(name, 0, rec.rows)]
        tensors[rec.name] = rec
    tmp = commit.temp_dir(out, uuid.uuid4().hex[:12])
    try:
        tmp.mkdir(parents=True)
        size, crc = files.write(tmp / name, entries, metadata={"format": "pt"})
        index = Index(
            world_size=meta.get("world_size"),
            strategy=meta.get("strategy"),
            step=step,
            extra=meta.get("extra"),
            files={name: {"bytes": size, "crc32": crc}},
            tensors=tensors,
            optimizer=saved_opt,
            rng=[],
        )
        commit.write_marker(tmp, commit.write_index(tmp, index))
        commit.publish(tmp, out)
    finally:
        commit.discard(tmp)
    return sorted(out.iterdir())
