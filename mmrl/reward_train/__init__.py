"""Reward-model training on human preference pairs (`algorithm: reward_bt`, `mmrl reward train`): the Bradley-Terry
recipe (`bt.py`), its backbones scored by the zoo's own code (`backbones.py`) and held-out pairwise accuracy with its
confidence interval (`accuracy.py`)."""
