"""Hugging Face layouts: a sharded model exported as a directory that transformers' (and
peft's) ``from_pretrained`` loads, and a checkpoint's names mapped as transformers maps them.

    shardwise.save_pretrained(model, "out")             # collective; rank 0 writes
    AutoModelForCausalLM.from_pretrained("out")          # anywhere, unsharded

The export streams: units are gathered one at a time, in the order their tensors go into the
files, and rank 0 writes each tensor when the writer reaches it (``files.write`` asks for a
tensor's bytes only then), so no rank holds more than one unit's full parameters at once.
transformers and peft are imported only inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import collectives as C
from ..core import flight
from ..core.errors import ShardwiseError
from ..core.runtime import Runtime
from ..core.unit import Unit
from . import files
from .handle import finish_pending
from .index import CheckpointError
from .state import idle_world_runtime, param_slots, persistent_buffers
from .weight_files import file_names, nbytes, split_files, write_weight_map

ADAPTER_FILE = "adapter_model.safetensors"  # peft's name for an adapter's weights
_PEFT_PREFIX = "base_model.model."  # where a peft model keeps the model it adapts


@dataclass(frozen=True)
class Exported:
    """One tensor of the export: where it comes from and how it is stored."""

    name: str  # as stored
    dtype: torch.dtype  # as stored
    shape: tuple[int, ...]
    unit: int | None  # the unit whose parameter it is (None: a buffer, whole on every rank)
    index: int  # the parameter's slot in its unit
    buffer: torch.Tensor | None = None


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write a sharded transformers model as a directory that ``from_pretrained`` loads.

    Collective: every rank (with hybrid sharding, every rank of rank 0's shard group) gathers
    one unit at a time and rank 0 writes, so rank 0's extra memory is about the largest unit.
    The directory holds the weights under the model's state-dict names (``model.safetensors``,
    or ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_bytes`` and
    ``model.safetensors.index.json``), a tied weight once, frozen parameters and persistent
    buffers included, in the parameters' dtype or in ``dtype`` (floating-point tensors only);
    and ``config.json`` (its dtype set to the one stored) and ``generation_config.json`` when
    the model generates.

    A peft model gets peft's adapter layout beside its base model: ``adapter_config.json``
    and ``adapter_model.safetensors`` (loadable with ``PeftModel.from_pretrained(base,
    path)``), and the base model's weights under the names of the model before peft, so
    ``AutoModelForCausalLM.from_pretrained(path)`` loads the base and attaches the adapter.
    Returns ``path``. A failure on rank 0 raises CheckpointError on every rank.
    """
    rt = idle_world_runtime(model, "save_pretrained")
    finish_pending(model)
    path = Path(path)
    if dtype is not None and not dtype.is_floating_point:
        raise ShardwiseError(f"save_pretrained(dtype={dtype}) must be a floating-point dtype")
    tensors = list(exported_tensors(model, rt, dtype))
    peft = is_peft(model)
    if peft:
        adapter_names, base_names = peft_names(model, tensors)
        adapter = [renamed(t, adapter_names[t.name]) for t in tensors if t.name in adapter_names]
        tensors = [renamed(t, base_names[t.name]) for t in tensors if t.name in base_names]
    groups = split_files([nbytes(t) for t in tensors], max_shard_bytes)
    layout = [(n, [tensors[i] for i in g]) for n, g in zip(file_names(len(groups)), groups)]
    if peft:
        layout.append((ADAPTER_FILE, adapter))
    # each file's tensors in the order the writer takes them: the units' gathering order
    layout = [(n, sorted(ts, key=lambda t: -t.dtype.itemsize)) for n, ts in layout]
    order = [t.unit for _, ts in layout for t in ts if t.unit is not None]
    feed = UnitFeed(rt.units, [u for i, u in enumerate(order) if i == 0 or order[i - 1] != u])
    problem = ""
    if rt.mesh.in_first_shard_group():  # hybrid sharding: the other replicas hold the same rows
        with flight.apart() if rt.mesh.replicate is not None else contextlib.nullcontext():
            if dist.get_rank() == 0:  # idle_world_runtime checked that the model's mesh spans the world
                problem = _write(model, path, layout, tensors, feed)
            feed.drain()
    C.agree(problem, "save_pretrained outcome", lambda m: CheckpointError(f"save_pretrained to {path} failed: {m}"))
    return path


def _write(model: nn.Module, path: Path, layout, tensors: list[Exported], feed: UnitFeed) -> str:
    """Rank 0: write the files, the weight map and the configs; return "" or what went wrong."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        for name, ts in layout:
            entries = [files.Entry(t.name, t.dtype, t.shape, _parts(t, feed)) for t in ts]
            files.write(path / name, entries, metadata={"format": "pt"})
        weights = [(n, ts) for n, ts in layout if n != ADAPTER_FILE]
        write_weight_map(path, [n for n, _ in weights], [ts for _, ts in weights])
        _write_configs(model, path, tensors)
    except Exception as e:  # reported to every rank once they have all finished
        return f"{type(e).__name__}: {e}"
    return ""


class UnitFeed:
    """Units' full parameters, one unit at a time, gathered in an order every rank shares
    (each gather is a collective): rank 0 asks for them as it writes, the others drain."""

    def __init__(self, units: list[Unit], order: list[int]):
        self.units = units
        self.order: Iterator[int] = iter(order)
        self.current: int | None = None
        self.full: list[torch.Tensor] = []

    def get(self, unit: int) -> list[torch.Tensor]:
        while self.current != unit:
            self.full = []  # dropped before the next gather
            self.current = next(self.order)
            self.full = self.units[self.current].gather_full()
        return self.full

    def drain(self) -> None:
        self.full = []
        for u in self.order:
            self.units[u].gather_full()


def _parts(t: Exported, feed: UnitFeed):
    def parts():
        src = t.buffer if t.unit is None else feed.get(t.unit)[t.index]
        yield src.detach().to("cpu", t.dtype)

    return parts


def exported_tensors(model: nn.Module, rt: Runtime, dtype: torch.dtype | None) -> Iterator[Exported]:
    """The parameters, unit by unit (a tied one once, under its first name), then the
    persistent buffers."""

    def stored(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    slots = {s.name: s for s in param_slots(rt)}
    for ui, unit in enumerate(rt.units):
        firsts: dict[int, str] = {}
        for r in unit.registrations:
            firsts.setdefault(r.index, r.fqn)
        for i in range(len(firsts)):
            s = slots[firsts[i]]
            yield Exported(s.name, stored(s.tensor.dtype), s.shape, ui, i)
    for name, b in persistent_buffers(model).items():
        yield Exported(name, stored(b.dtype), tuple(b.shape), None, 0, b)


def renamed(t: Exported, name: str) -> Exported:
    return Exported(name, t.dtype, t.shape, t.unit, t.index, t.buffer)


# --- peft
def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def peft_names(model: nn.Module, tensors: list[Exported]) -> tuple[dict[str, str], dict[str, str]]:
    """Each name of a peft model -> its name in peft's adapter file, or in the base model's
    files (the name it had before peft: no ``base_model.model.`` prefix, no ``base_layer``)."""
    adapter = _adapter_names(model, [t.name for t in tensors])
    base = {}
    for t in tensors:
        if t.name in adapter or ".modules_to_save." in t.name:
            continue
        if not t.name.startswith(_PEFT_PREFIX):
            raise NotImplementedError(
                f"peft model tensor '{t.name}' is not under '{_PEFT_PREFIX}': save_pretrained "
                "exports adapters of the LoRA family, which keep the model at that place"
            )
        name = t.name.removeprefix(_PEFT_PREFIX)
        base[t.name] = name.replace(".base_layer.", ".").replace(".original_module.", ".")
    return adapter, base


@dataclass(frozen=True)
class LoraMerge:
    """A LoRA layer folded into its base weight: ``W + scale * B @ A`` (transposed for a
    ``fan_in_fan_out`` layer), as peft's ``merge_and_unload`` computes it."""

    a: str  # the state-dict names of lora_A's and lora_B's weights
    b: str
    scale: float
    transpose: bool


def merged_names(
    model: nn.Module, tensors: list[Exported]
) -> tuple[dict[str, str], dict[str, LoraMerge]]:
    """What ``merge_and_unload()`` then ``save_pretrained`` would write for a peft model:
    each tensor's name -> its name in the merged model (the base model's names, as
    ``peft_names`` gives them, a trained ``modules_to_save`` copy in place of the original;
    adapters have none: they are folded in), and each merged base weight -> its ``LoraMerge``.
    LoRA on ``nn.Linear`` layers without DoRA or bias; other layers and tuners raise."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear as LoraLinear

    _, base = peft_names(model, tensors)
    (adapter,) = model.peft_config  # peft_names raised for several
    merges: dict[str, LoraMerge] = {}
    for mname, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if type(module) is not LoraLinear or module.use_dora.get(adapter) or module.lora_bias.get(adapter):
            raise NotImplementedError(
                f"'{mname}': merging a peft {type(module).__name__} layer (DoRA, LoRA bias or "
                "non-Linear LoRA) into its base weight is not supported; merge_and_unload() it first"
            )
        merges[f"{mname}.base_layer.weight"] = LoraMerge(
            f"{mname}.lora_A.{adapter}.weight",
            f"{mname}.lora_B.{adapter}.weight",
            float(module.scaling[adapter]),
            bool(module.fan_in_fan_out),
        )
    names = {}
    trained = f".modules_to_save.{adapter}."
    for t in tensors:
        if trained in t.name:
            names[t.name] = t.name.removeprefix(_PEFT_PREFIX).replace(trained, ".")
        elif t.name in base and ".original_module." not in t.name:
            names[t.name] = base[t.name]
    return names, merges


def _adapter_names(
    model: nn.Module, names: list[str], adapter: str | None = None
) -> dict[str, str]:
    """The tensors of one adapter (the only one, unless named) among ``names`` -> their names
    in peft's adapter file: peft's own mapping (``get_peft_model_state_dict``), asked of empty
    tensors on the meta device."""
    from peft.utils import get_peft_model_state_dict

    if adapter is None:
        adapters = list(model.peft_config)
        if len(adapters) != 1:
            raise NotImplementedError(
                f"save_pretrained writes one peft adapter; the model has {adapters}: delete "
                "the others first (model.delete_adapter(name))"
            )
        adapter = adapters[0]
    probes = {n: torch.empty(0, device="meta") for n in names}
    got = get_peft_model_state_dict(
        model, state_dict=probes, adapter_name=adapter, save_embedding_layers=False
    )
    back = {id(v): k for k, v in probes.items()}
    return {back[id(v)]: k for k, v in got.items()}


# --- configs
def _write_configs(model: nn.Module, path: Path, tensors: list[Exported]) -> None:
    """config.json with the dtype stored, generation_config.json when the model generates,
    and a peft model's adapter_config.json."""
    base = model.get_base_model() if is_peft(model) else model
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
        if floats:
            config.dtype = max(set(floats), key=floats.count)
        config.save_pretrained(path)
    generation = getattr(base, "generation_config", None)
    can_generate = getattr(base, "can_generate", None)
    if generation is not None and can_generate is not None and can_generate():
        generation.save_pretrained(path)
    if is_peft(model):
        (adapter,) = model.peft_config.values()
        adapter = copy.deepcopy(adapter)
        adapter.inference_mode = True
        adapter.save_pretrained(path)


# --- loading: checkpoint names as transformers maps them
def is_transformers(model: nn.Module) -> bool:
    """A transformers model (duck-typed: a config and a base-model prefix)."""
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


def model_names(model: nn.Module, stored: list[str]) -> dict[str, str]:
    """Each checkpoint name -> the model's name for it, as transformers' ``from_pretrained``
    maps them: its renamings for the model (legacy ``LayerNorm.gamma`` -> ``.weight`` and the
    model's own), and the base-model prefix added or removed (a ``LlamaModel`` checkpoint
    into a ``LlamaForCausalLM`` and back). For a peft model, the names of the model it adapts
    (a base checkpoint into a model whose layers peft wrapped). A name that needs one of
    transformers' tensor conversions (fused or split tensors) raises: those cannot be read
    row by row."""
    if is_peft(model):
        inner = model.get_base_model()
        before = {n.replace(".base_layer.", "."): n for n in inner.state_dict()}
        mapped = _transformers_names(inner, stored, before)
        return {s: _PEFT_PREFIX + before.get(m, m) for s, m in mapped.items()}
    return _transformers_names(model, stored, model.state_dict())


def adapter_only(model: nn.Module, names: list[str]) -> list[str]:
    """Which of ``names`` are a peft model's adapters, which no base checkpoint holds."""
    if not is_peft(model):
        return []
    return [n for a in model.peft_config for n in _adapter_names(model, names, a)]


def _transformers_names(model: nn.Module, stored: list[str], known) -> dict[str, str]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError as e:
        raise CheckpointError(
            f"loading a transformers checkpoint needs transformers>=5 ({e}): "
            'pip install "shardwise[hf]"'
        ) from e
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    known = dict.fromkeys(known, True)
    out, converted = {}, []
    for name in stored:
        renamed, pattern = rename_source_key(
            name, renamings, converters, model.base_model_prefix, known
        )
        if pattern is not None:
            converted.append(f"'{name}' ({pattern})")
        out[name] = renamed
    if converted:
        raise CheckpointError(
            "tensors that transformers converts on loading (fused or split), which cannot be "
            f"read row by row: {', '.join(converted[:5])}. Load the model once with "
            "from_pretrained and write it with its save_pretrained, then load that directory."
        )
    return out
