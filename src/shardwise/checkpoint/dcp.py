"""The torch.distributed.checkpoint (DCP) directory format, as FSDP2 and torchtitan write it.

A DCP directory holds ``.metadata`` (pickled: every tensor's global shape and the chunks,
offsets and sizes, that the saving ranks wrote) and ``__<rank>_<i>.distcp`` files (each chunk
a ``torch.save``'d tensor, each plain value a ``torch.save``'d object). Keys are the state
dict's nested names joined with dots: FSDP2's ``{"model": ..., "optimizer": ...}`` gives
``model.<param>``, ``optimizer.state.<param>.<key>`` and ``optimizer.param_groups.<i>.<hyper>``;
torchtitan puts the model's names at the top level, flattens the optimizer's param groups per
parameter (``optimizer.param_groups.<param>.<hyper>``) and keeps ``train_state.step``.

Here: reading the metadata safely (unpickling.py), reading chunks and values with
``weights_only`` loads, and the names shardwise writes.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .index import CheckpointError
from .unpickling import read_metadata

MODEL = "model."  # what shardwise writes: FSDP2's {"model": ..., "optimizer": ...}
OPTIMIZER = "optimizer."
SHARDWISE = "shardwise"  # step, extra, world size and strategy of a shardwise save (JSON text)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(Path(self.path))


class _Targets(LoadPlanner):
    """A load planner that puts each read item's rows into a given tensor, and keeps each
    plain value as its ``weights_only`` unpickling (never plain pickle)."""

    def __init__(self) -> None:
        self.dests: dict[ReadItem, torch.Tensor] = {}
        self.values: dict[str, Any] = {}

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("used directly, not through dcp.load")

    create_local_plan = create_global_plan = finish_plan = set_up_planner

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.values[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0]
            raise CheckpointError(
                f"value '{key}' holds more than plain data, refused by weights_only "
                f"unpickling ({first}): not loading a checkpoint that could run code"
            ) from e

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.dests[read_item]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the rows were copied straight into their destination


class Reading:
    """Reads planned on one rank: chunk rows into tensors, and plain values by key."""

    def __init__(self, path: Path):
        self.reader = SafeReader(path)
        self.metadata = self.reader.read_metadata()
        for info in self.metadata.storage_data.values():  # files of this directory only
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise CheckpointError(
                    f"{path}/.metadata points at the data file {name!r}, outside the "
                    "checkpoint's directory: refusing to read it"
                )
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=False)
        self._planner = _Targets()
        self._items: list[ReadItem] = []

    def rows(self, key: str, lo: int, hi: int, dest: torch.Tensor) -> None:
        """Plan to copy rows ``[lo, hi)`` of tensor ``key`` into ``dest`` (shaped like those
        rows), from every saved chunk that holds some of them."""
        chunks = self.metadata.state_dict_metadata[key].chunks
        for chunk in chunks:
            if not chunk.sizes:  # a 0-dim tensor: one chunk, one "row"
                self._add(key, chunk.offsets, (), (), (), dest)
                continue
            a, b = max(lo, chunk.offsets[0]), min(hi, chunk.offsets[0] + chunk.sizes[0])
            if a >= b:
                continue
            dest_offsets = (a - lo, *chunk.offsets[1:])
            storage_offsets = (a - chunk.offsets[0], *[0] * (len(chunk.sizes) - 1))
            lengths = (b - a, *chunk.sizes[1:])
            self._add(key, chunk.offsets, dest_offsets, storage_offsets, lengths, dest)

    def _add(self, key, offsets, dest_offsets, storage_offsets, lengths, dest) -> None:
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(key, torch.Size(dest_offsets), len(self._items)),
            dest_offsets=torch.Size(dest_offsets),
            storage_index=MetadataIndex(key, torch.Size(offsets)),
            storage_offsets=torch.Size(storage_offsets),
            lengths=torch.Size(lengths),
        )
        self._planner.dests[item] = dest
        self._items.append(item)

    def value(self, key: str) -> None:
        """Plan to read the plain value saved under ``key``."""
        self._items.append(
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(key),
                dest_offsets=torch.Size(()),
                storage_index=MetadataIndex(key),
                storage_offsets=torch.Size(()),
                lengths=torch.Size(()),
            )
        )

    def run(self) -> dict[str, Any]:
        """Do the planned reads; return the plain values read, by key."""
        items, self._items = self._items, []
        self.reader.read_data(LoadPlan(items), self._planner).wait()
        return self._planner.values
