"""mmrl: reinforcement-learning fine-tuning of generative multimodal models."""

__version__ = "0.1.0"
