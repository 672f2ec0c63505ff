"""A reward trained by `mmrl reward train` (reward_bt) drives a Flow-GRPO run as `reward.components: {learned_pref:
...}`, with a different zoo reward watching it as a `log.judges` judge (the hacking alarm of a learned reward)."""

import warnings

from mmrl.reward_train.bt import make_color_preference_file, train
from mmrl.testing import metrics_rows

from .test_guard import REPO, _cfg, _train


def test_learned_reward_in_reward_components_with_a_zoo_judge(tmp_path, tiny_sd3_path):
    from mmrl.config import load_config
    from mmrl.tiny import build_tiny_clip

    clip = build_tiny_clip(tmp_path / "clip", seed=0)
    pairs = make_color_preference_file(tmp_path / "prefs", n_pairs=10, ties=0)
    train(load_config({"algorithm": "reward_bt", "output_dir": str(tmp_path / "bt"), "device": "cpu",
                       "model": {"path": str(clip)}, "data": {"pairs": str(pairs)}, "train": {"max_steps": 1},
                       "update": {"pairs_per_step": 4, "micro_batch_size": 4}}))
    learned = tmp_path / "bt" / "reward"
    cfg = _cfg("flow_grpo", tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"],
               data={"eval_prompts": str(REPO / "assets" / "prompts" / "shapes_eval.txt")},
               reward={"components": {"learned_pref": {"weight": 1.0, "weights": str(learned)}}},
               log={"eval_every": 1, "eval_max_prompts": 2, "judges": {"pickscore": {"weights": str(clip)}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two held-out prompts: too few for the alarm's verdict, enough to score
        _train(cfg)
    row = metrics_rows(tmp_path / "run")[-1]
    assert row["reward/mean"] == row["reward/learned_pref"]
    assert row["eval/judge/pickscore"] is not None and row["eval/reward/mean"] is not None
