"""mmrl: reinforcement-learning fine-tuning of generative multimodal models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`mmrl.Trainer` (the Python trainer API, `mmrl.trainer`; `mmrl.GRPOTrainer` is TRL's name for it) and the
    recipe configs (`mmrl.config.CONFIG_NAMES`: `mmrl.FlowGRPOConfig`, ...), imported on first use so `import mmrl`
    stays light."""
    if name in ("Trainer", "GRPOTrainer"):
        from mmrl.trainer import Trainer

        return Trainer
    if name[:1].isupper() and name.endswith("Config"):
        from mmrl.config import CONFIG_NAMES, recipe_module

        if name in CONFIG_NAMES:
            return recipe_module(CONFIG_NAMES[name]).Config
    raise AttributeError(f"module 'mmrl' has no attribute {name!r}")
