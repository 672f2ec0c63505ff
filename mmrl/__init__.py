"""mmrl: reinforcement-learning fine-tuning of generative multimodal models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`mmrl.Trainer` (the Python trainer API, `mmrl.trainer`), imported on first use so `import mmrl` stays light."""
    if name == "Trainer":
        from mmrl.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'mmrl' has no attribute {name!r}")
