"""shardwise in Hugging Face's ``transformers.Trainer``: ``shardwise.hf.Trainer``.

    trainer = shardwise.hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    trainer.train()                 # under torchrun; resume_from_checkpoint at any world size
    trainer.save_model("out")       # a from_pretrained directory

Needs ``pip install "shardwise[hf]"``; ``import shardwise`` alone never imports transformers.
What maps to what, and where transformers has no public hook: docs/frameworks.md.
"""

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("shardwise.hf needs transformers and accelerate: pip install 'shardwise[hf]'") from e

from .accelerator import ShardwiseAccelerator
from .trainer import Trainer

__all__ = ["Trainer", "ShardwiseAccelerator"]
