"""The Qwen-VL reward models of issue 30 (HPSv3, EditReward) inside a recipe: one Flow-GRPO step on the tiny SD3 /
the tiny FLUX.1 Kontext edit model, with the reward built from its tiny authors'-format checkpoint (mmrl.tiny.hpsv3)."""

from pathlib import Path

import pytest

from mmrl import cli
from mmrl.config import recipe_module
from mmrl.testing import metrics_rows
from mmrl.tiny.hpsv3 import build_tiny_edit_reward, build_tiny_hpsv3

from .test_editing import EDIT_CONFIG, SMALL
from .test_guard import _cfg


def test_hpsv3_in_flow_grpo(tmp_path, tiny_sd3_path):
    tiny = build_tiny_hpsv3(tmp_path / "hpsv3")
    reward = {"hpsv3": {"weight": 1.0, "weights": str(tiny), "processor": str(tiny / "base"), "dtype": "float32"}}
    cfg = _cfg("flow_grpo", tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"], reward={"components": reward})
    recipe_module(cfg.algorithm).train(cfg)
    row = metrics_rows(tmp_path / "run")[0]
    # the tiny random HPSv3 scores around -0.18 (mu); every image was scored
    assert -1.0 < row["reward/hpsv3"] < 1.0 and row["reward/mean"] == pytest.approx(row["reward/hpsv3"])


def test_edit_reward_in_the_edit_recipe(tmp_path, tiny_family):
    """The edit recipe hands each rollout's source image to the reward through the row's metadata."""
    tiny = build_tiny_edit_reward(tmp_path / "edit_reward")
    out = tmp_path / "run"
    reward = (f"reward.components={{edit_reward: {{weight: 1.0, weights: {tiny / 'checkpoint'}, "
              f"processor: {tiny / 'base'}, dtype: float32}}}}")
    assert cli.main(["train", EDIT_CONFIG, f"output_dir={out}", f"model.path={tiny_family('FluxKontextPipeline')}",
                     "train.max_steps=1", "log.eval_every=0", *SMALL, reward]) == 0
    row = metrics_rows(out)[0]
    assert -1.0 < row["reward/edit_reward"] < 1.0 and row["reward/mean"] == pytest.approx(row["reward/edit_reward"])


# the real configs: the published settings of the PickScore recipe they name, only the reward swapped
REAL = {"flow_grpo_sd35_hpsv3.yaml": ("flow_grpo_sd35_pickscore.yaml", "hpsv3"),
        "flow_grpo_qwen_image_edit_editreward.yaml": ("flow_grpo_qwen_image_edit_pickscore.yaml", "edit_reward")}


@pytest.mark.parametrize("name", list(REAL))
def test_real_configs_are_their_published_recipes_with_the_reward_swapped(name):
    import yaml

    from mmrl.config import load_config

    configs = Path(__file__).resolve().parents[2] / "configs" / "diffusion"
    ours, published = (yaml.safe_load((configs / n).read_text()) for n in (name, REAL[name][0]))
    for d in (ours, published):
        d.pop("output_dir")
        d["reward"]["components"].pop("pickscore", None)
    reward = ours["reward"]["components"].pop(REAL[name][1])
    assert ours == published and reward["weight"] == 1.0 and "dtype" not in reward  # the authors' bf16 backbone
    load_config(configs / name)  # validates, reward arguments included


@pytest.mark.parametrize("name", list(REAL))
def test_real_config_runs_one_step_on_tiny_models(name, tiny_family, tmp_path):
    """The real config as written, only paths and sizes changed: one Flow-GRPO step with the tiny reward checkpoint."""
    import yaml

    from mmrl.config import load_config
    from mmrl.pipelines.edits import make_shapes_edit_file

    d = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "diffusion" / name).read_text())
    key = REAL[name][1]
    if key == "hpsv3":
        tiny, model, prompts = build_tiny_hpsv3(tmp_path / "r"), tiny_family("StableDiffusion3Pipeline"), None
        d["reward"]["components"][key].update(weights=str(tiny), processor=str(tiny / "base"))
    else:
        tiny, model = build_tiny_edit_reward(tmp_path / "r"), tiny_family("QwenImageEditPlusPipeline")
        prompts = str(make_shapes_edit_file(tmp_path / "edits", n=4))
        d["reward"]["components"][key].update(weights=str(tiny / "checkpoint"), processor=str(tiny / "base"))
    d.update(output_dir=str(tmp_path / "run"), device="cpu", dtype="float32")
    d["model"].update(path=str(model), max_sequence_length=16 if key == "hpsv3" else d["model"]["max_sequence_length"])
    d["data"] = {"train_prompts": prompts or str(Path(__file__).resolve().parents[2] / "assets/prompts/shapes_train.txt")}
    d["rollout"].update(prompts_per_step=2, group_size=2, height=32, width=32, eval_num_steps=2, micro_batch_size=2)
    d["update"].update(mini_batch_size=0, micro_batch_size=2)
    d["train"].update(max_steps=1, save_every=1)
    d["log"].update(eval_every=0, sample_every=0)
    d["dist"] = {"strategy": "none"}
    cfg = load_config(d)
    recipe_module(cfg.algorithm).train(cfg)
    row = metrics_rows(cfg.output_dir)[0]
    assert f"reward/{key}" in row and row["train/updates"] == 1
