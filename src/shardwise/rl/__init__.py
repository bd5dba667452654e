"""Weights into a running vLLM engine: the trainer's half of RL post-training
(``pip install "shardwise[vllm]"``). ``import shardwise`` reaches it as ``shardwise.rl``
without importing vLLM; ``VLLMSync`` imports vLLM when first asked for.

    sync = shardwise.rl.VLLMSync(model, llm if rank == 0 else None)   # or a vllm serve URL
    sync.push()                                                      # after opt.step()

Modules: sync (``VLLMSync``), source (the model in save_pretrained's names, unit by unit),
delta (changed values only), packing (the bucket format), transport (the transports by name:
shm, tcp, nccl, ipc), clients (the engine's control plane), sender and engine (the
"shardwise" backend on either side of vLLM's weight-transfer API; init_info, its settings),
plugin (vLLM's entry point). docs/rl.md.
"""

from .clients import EngineError

__all__ = ["VLLMSync", "EngineError"]


def __getattr__(name: str):
    if name == "VLLMSync":  # imports vLLM: only when asked for
        from .sync import VLLMSync

        return VLLMSync
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
