"""The real-model recipes of the newer families (configs/diffusion/flow_grpo_wan21_t2v.yaml,
flow_grpo_z_image_pickscore.yaml): their published settings as written, and each one run for a step on a tiny
checkpoint of the same layout (same pipeline, scheduler and component classes) with tiny reward models, only the
paths and sizes changed."""

from pathlib import Path

import pytest
import yaml

from mmrl.config import load_config
from mmrl.diffusion.flow_grpo import train
from mmrl.testing import metrics_rows

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "diffusion"


def test_wan21_t2v_published_settings():
    """Flow-Factory examples/grpo/lora/wan21/t2v.yaml: 256 px, 5 frames, 10 steps, CFG 5, noise 0.9 on one step of
    {1, 2, 3}, 48 x 16 per epoch with 2 updates, LoRA 64/128, lr 1e-4, clip 1e-4, no KL, CLIP 1.0 + PickScore 0.5."""
    cfg = load_config(CONFIGS / "flow_grpo_wan21_t2v.yaml")
    s, a, lora = cfg.rollout, cfg.algo, cfg.model.lora
    assert (s.height, s.width, s.num_frames, s.num_steps, s.guidance_scale, s.noise_level) == (256, 256, 5, 10, 5.0, 0.9)
    assert (s.window_size, s.window_range, s.prompts_per_step, s.group_size) == (1, [1, 4], 48, 16)
    assert cfg.update.updates_per_epoch(s.batch) == 2 and (lora.rank, lora.alpha) == (64, 128)
    assert (cfg.optim.lr, a.clip_range, a.kl.coef, a.adv_clip_max) == (1e-4, 1e-4, 0.0, 5.0)
    comps = cfg.reward.components
    assert (comps["text_alignment"]["image_reward"], comps["text_alignment"]["aggregate"]) == ("clip_score", "frame")
    assert (comps["pick_score"]["image_reward"], comps["pick_score"]["weight"]) == ("pickscore", 0.5)


def test_z_image_pickscore_published_settings():
    """Flow-Factory examples/grpo/lora/z_image/default.yaml: 512 px, 10 steps, guidance 4 (Z-Image's scale), noise
    0.7 on one step of {1, 2, 3}, 48 x 16 per epoch with 2 updates, LoRA 64/128, lr 3e-4, clip 1e-4, PickScore."""
    cfg = load_config(CONFIGS / "flow_grpo_z_image_pickscore.yaml")
    s, lora = cfg.rollout, cfg.model.lora
    assert (s.height, s.num_steps, s.guidance_scale, s.noise_level, s.window_size, s.window_range) == \
        (512, 10, 4.0, 0.7, 1, [1, 4])
    assert cfg.update.updates_per_epoch(s.batch) == 2 and (lora.rank, lora.alpha, cfg.optim.lr) == (64, 128, 3e-4)
    assert list(cfg.reward.components) == ["pickscore"] and cfg.algo.kl.coef == 0.0


def _tiny_wan(tmp_path):
    from mmrl.tiny.family_models import build_tiny_wan

    return build_tiny_wan(tmp_path / "wan", scheduler="unipc"), {"height": 32, "width": 32}


def _tiny_z_image(tmp_path):
    from mmrl.tiny.family_models import build_tiny_z_image

    return build_tiny_z_image(tmp_path / "z_image"), {"height": 32, "width": 32}


@pytest.mark.slow
@pytest.mark.parametrize("name, build", [("flow_grpo_wan21_t2v.yaml", _tiny_wan),
                                         ("flow_grpo_z_image_pickscore.yaml", _tiny_z_image)])
def test_real_recipe_runs_on_a_tiny_model_of_the_same_layout(name, build, tmp_path):
    from mmrl.tiny import build_tiny_clip

    model_path, size = build(tmp_path)
    clip = str(build_tiny_clip(tmp_path / "clip"))
    d = yaml.safe_load((CONFIGS / name).read_text())
    for comp in d["reward"]["components"].values():  # every reward model path -> the tiny CLIP
        comp.update({k: clip for k in ("weights", "processor") if k in comp})
    d.update(output_dir=str(tmp_path / "run"), device="cpu", dtype="float32")
    d["model"].update(path=str(model_path), max_sequence_length=16)
    d["data"] = {"train_prompts": str(REPO / "assets" / "prompts" / "shapes_train.txt")}
    d["rollout"].update(prompts_per_step=2, group_size=2, num_steps=4, eval_num_steps=2, **size)
    d["update"].update(mini_batch_size=0, micro_batch_size=2)
    d["train"].update(max_steps=1, save_every=1)
    d["log"].update(eval_every=0, sample_every=1, num_samples=4)
    d["dist"] = {"strategy": "none"}
    cfg = load_config(d)
    train(cfg)
    row = metrics_rows(cfg.output_dir)[0]
    assert row["diag/logprob_drift"] < 1e-4 and row["train/updates"] == 1
    assert set(k.split("/")[1] for k in row if k.startswith("reward/") and k.count("/") == 1) >= \
        set(d["reward"]["components"]) | {"mean", "std"}
    video = d["rollout"].get("num_frames", 1) > 1
    assert (Path(cfg.output_dir) / "samples" / f"step_000001.{'mp4' if video else 'png'}").is_file()
