"""``shardwise bench``: the comparison against FSDP2, DDP and the compute floor (harness), or, with
a mode flag, a benchmark of its own (``--vllm``, ``--diloco``, ``--overhead``), imported when run.

The modes reuse the harness's parts, so they are dispatched from here, above both.
"""

from __future__ import annotations

import importlib
import sys

MODES = {"--vllm": "vllm_main", "--diloco": "diloco", "--overhead": "overhead"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for flag, module in MODES.items():
        if flag in argv:
            return importlib.import_module(f"{__package__}.{module}").main([a for a in argv if a != flag])
    from . import harness

    return harness.main(argv)
