"""`learned_pref`: a reward model trained by `mmrl reward train` (the `reward_bt` recipe), loaded from the directory
it exported (`<output_dir>/reward/`). That directory holds the model in the format of the zoo reward it was trained
as (`pickscore` for the CLIP backbone, `hpsv3` for the VLM-with-head backbone) and `mmrl_reward.json` naming that
reward and its arguments; this entry builds it:

    mmrl.rewards.load("learned_pref", weights="runs/reward_bt/reward")
    reward.components: {learned_pref: {weight: 1.0, weights: runs/reward_bt/reward}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmrl.rewards.base import register
from mmrl.rewards.registry import create

SPEC_FILE = "mmrl_reward.json"


@register("learned_pref")
def learned_pref(weights: Any = None, **kwargs: Any):
    """The zoo reward named in `weights`/mmrl_reward.json, with the arguments recorded there (`kwargs` override
    them: device, batch_size, ...)."""
    from mmrl.rewards.image._common import read_json, require_path

    root = require_path(weights, "learned_pref", "nothing: train one with `mmrl reward train CONFIG.yaml` and pass its "
                        "<output_dir>/reward directory", kind="dir")
    spec = read_json(root / SPEC_FILE, "learned_pref", f"'{root}' has no {SPEC_FILE}: not a directory written by "
                     f"`mmrl reward train` (its <output_dir>/reward)")
    if not isinstance(spec, dict) or not isinstance(spec.get("reward"), str) or "weights" not in spec:
        raise ValueError(f"learned_pref: {root / SPEC_FILE} needs 'reward' (a zoo name) and 'weights'; got "
                         f"{sorted(spec) if isinstance(spec, dict) else type(spec).__name__}")
    args = dict(spec.get("kwargs") or {}) | kwargs
    return create(spec["reward"], weights=str(Path(root) / spec["weights"]), **args)
