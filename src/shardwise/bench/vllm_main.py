"""``shardwise bench --vllm``'s entry: the one-engine comparison (``vllm_push``, whose
docstring describes the benchmark) or its modes, ``--engines K`` (``vllm_engines``) and
``--nodes 2`` (``vllm_link``), which reuse its parts."""

from __future__ import annotations

import os

import torch.distributed as dist

from . import vllm_engines, vllm_link, vllm_push


def main(argv: list[str]) -> None:
    """Run the benchmark: one engine on this machine (``vllm_push``), ``--engines K``
    (``vllm_engines``) or ``--nodes 2`` (``vllm_link``); under torchrun in its ranks, else in
    ``--nproc`` local ranks (or the servers' parent process)."""
    cfg = vllm_push.parse_args(argv)
    if cfg.engines > 1:
        if "RANK" not in os.environ:
            return vllm_engines.run(vllm_push.build_model(cfg), cfg, argv)
        result = vllm_engines.run_rank(cfg)
        if dist.get_rank() == 0:
            vllm_engines.report(cfg, result)
        return
    if "RANK" in os.environ:
        result = vllm_push.run_rank(cfg)
        if dist.get_rank() == 0:
            vllm_push.report(cfg, result)
        return
    if cfg.nodes == 2:
        return vllm_link.run(vllm_push.build_model(cfg), cfg, argv)
    from ..core.groups import launch_local

    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    vllm_push.report(cfg, launch_local(cfg.nproc, vllm_push.run_rank, cfg)[0])
