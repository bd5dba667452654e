"""The ``shardwise`` command: ``shardwise train|...``; each subcommand lives with its tool."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": ("shardwise.job.train", "train the built-in GPT with shardwise and report memory and bytes sent"),
    "plan": ("shardwise.planner.cli", "predict per-rank memory and bytes sent before launch, any model (no GPU needed)"),
    "report": ("shardwise.observer.report", "an HTML page of one traced step: timeline, memory, mechanism, figures"),
    "bench": ("shardwise.bench.cli", "benchmark shardwise against FSDP2, DDP and the compute floor"),
    "convert": ("shardwise.checkpoint.cli", "a checkpoint as a safetensors model or DCP, or DCP as a checkpoint (offline)"),
    "explore": ("shardwise.explore.server", "drive a real sharded training run from a web page (the [explore] extra)"),
    "lighthouse": ("shardwise.ft.lighthouse", "run torchft's lighthouse for fault-tolerant training across jobs (the [ft] extra)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: shardwise COMMAND [options]   (shardwise COMMAND --help for its options)\n")
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<10} {doc}")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    import importlib

    importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
