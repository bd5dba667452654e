"""Reading the pickled ``.metadata`` of a torch.distributed.checkpoint (DCP) directory safely.

DCP's own reader opens ``.metadata`` with plain ``pickle.load``, so a checkpoint from elsewhere
can run code when it is opened. This unpickler admits only the classes DCP writes there (its
metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) and refuses any other global
before it is imported or called, so nothing a crafted file names can run.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from .index import CheckpointError

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a lookup of a layout by its name
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's pickled metadata names something other than DCP's metadata classes."""


def _is_torch_constant(name: str) -> bool:
    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


class _Restricted(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and _is_torch_constant(name)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source} asks to load {module}.{name}, which is not part of "
            "torch.distributed.checkpoint's metadata: refusing to open it (it could run code). "
            "Only open checkpoints from sources you trust with plain pickle."
        )


def read_metadata(path: Path):
    """The ``Metadata`` of the DCP checkpoint in directory ``path``, unpickled safely."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = path / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _Restricted(f, file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a truncated or garbled pickle raises many kinds of error
        raise CheckpointError(
            f"{file} is not readable DCP metadata ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata
