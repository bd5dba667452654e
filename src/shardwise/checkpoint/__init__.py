"""Sharded checkpoints: every rank writes its own rows, any world size reads them back.

    shardwise.save("ckpt/step-00100", model, opt, step=100, extra={"data": pos})
    info = shardwise.load(shardwise.latest("ckpt"), model, opt)   # any world size, wrap, strategy

Modules: files (safetensors I/O, checksums), index (the directory format), commit (crash
safety), state (the live model and optimizer by name and rows), saving, loading, conversion,
pretrained (Hugging Face export, transformers' names), cli (``shardwise convert``); for
torch.distributed.checkpoint (DCP) directories, FSDP2's and torchtitan's: dcp (the format and
its reads), unpickling (the restricted unpickler for its ``.metadata``), dcp_loading,
dcp_saving (``save(format="dcp")``), dcp_conversion (``convert(to="dcp")``),
native_conversion (``convert(to="shardwise")``, a DCP directory in this format). The formats and
protocol: docs/checkpoints.md.
"""

from .commit import latest
from .conversion import convert
from .index import CheckpointError
from .loading import CheckpointInfo, load, load_full
from .pretrained import save_pretrained
from .saving import SaveHandle, save

__all__ = [
    "save",
    "load",
    "latest",
    "load_full",
    "convert",
    "save_pretrained",
    "SaveHandle",
    "CheckpointInfo",
    "CheckpointError",
]
