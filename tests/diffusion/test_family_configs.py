"""The real-model recipes of the new families: they load and validate with the anchors' published settings, and their
model / LoRA / guidance settings load a tiny pipeline directory of the same layout (the real weights never ran here)."""

from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.diffusion.common import build_policy_states
from mmrl.diffusion.conditioning import encode_items
from mmrl.diffusion.models import load_flow_model
from mmrl.pipelines.data import PromptItem
from mmrl.rewards import available
from mmrl.runtime import resolve_dtype

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "diffusion"


def _loads_on_a_tiny_directory(cfg, tiny_path, items):
    """The recipe's model section on a tiny directory of the same pipeline class: load in the recipe's dtype, wrap
    with its LoRA (the family's default targets: every one must match), one guided velocity."""
    model = load_flow_model(tiny_path, "cpu", resolve_dtype(cfg.dtype), cfg.model.max_sequence_length or None)
    states = build_policy_states(model, cfg.model, old=False, ref=False)
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    for target in model.lora_target_modules:
        assert any(f".{target}.lora_A" in n for n in trainable), target
    emb = encode_items(model, items, 64, 64)
    x = model.initial_noise(len(items), 64, 64, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(x, 0.5, emb, guidance_scale=cfg.rollout.guidance_scale)
    assert v.shape == x.shape and torch.isfinite(v).all()
    return model, states


def test_qwen_image_ocr_recipe(tiny_family):
    cfg = load_config(CONFIGS / "flow_grpo_qwen_image_ocr.yaml")
    s, lora = cfg.rollout, cfg.model.lora
    # source: verl-omni run_qwen_image_ocr_lora.sh + its rollout / actor config defaults
    assert (s.prompts_per_step, s.group_size, s.height, s.num_steps, s.guidance_scale) == (32, 16, 512, 10, 4.0)
    assert (s.noise_level, s.window_size, list(s.window_range)) == (1.2, 2, [0, 5])
    assert (lora.rank, lora.alpha, cfg.optim.lr, cfg.optim.weight_decay) == (64, 128, 3e-4, 1e-4)
    assert (cfg.algo.clip_range, cfg.algo.kl.coef, cfg.update.updates_per_epoch(s.batch)) == (1e-4, 0.0, 2)
    assert cfg.model.max_sequence_length == 256 and list(cfg.reward.components) == ["ocr"]
    model, _ = _loads_on_a_tiny_directory(cfg, tiny_family("QwenImagePipeline"),
                                          [PromptItem('a sign that says "HELLO"')])
    assert model.dtype == torch.bfloat16 and model.max_sequence_length == 256


def test_qwen_image_edit_recipe(tiny_family, tmp_path):
    from mmrl.pipelines.data import load_prompts
    from mmrl.pipelines.edits import make_shapes_edit_file

    cfg = load_config(CONFIGS / "flow_grpo_qwen_image_edit_pickscore.yaml")
    s = cfg.rollout
    # source: verl-omni run_qwen_image_edit_lora.sh
    assert (s.prompts_per_step, s.group_size, s.height, s.num_steps, s.guidance_scale) == (32, 16, 512, 12, 4.0)
    assert (s.noise_level, s.window_size, list(s.window_range), s.eval_num_steps) == (0.7, 3, [0, 6], 40)
    assert (cfg.model.lora.rank, cfg.optim.lr, cfg.algo.clip_range, cfg.reward.std_mode) == (64, 3e-4, 1e-4, "group")
    assert set(cfg.reward.components) <= set(available())
    items = load_prompts(make_shapes_edit_file(tmp_path, n=2))
    _loads_on_a_tiny_directory(cfg, tiny_family("QwenImageEditPlusPipeline"), items)


@pytest.mark.slow
@pytest.mark.parametrize("name, family", [("flow_grpo_qwen_image_ocr.yaml", "QwenImagePipeline"),
                                          ("flow_grpo_qwen_image_edit_pickscore.yaml", "QwenImageEditPlusPipeline")])
def test_real_recipe_runs_a_step_on_a_tiny_model_of_the_same_layout(name, family, tiny_family, tmp_path):
    """The recipe file as written, only paths and sizes changed (tiny CLIP for PickScore, the real PP-OCRv4 for the
    OCR reward): one Flow-GRPO step with its CFG, SDE window and LoRA on a tiny directory of the same pipeline class."""
    import yaml

    from mmrl.diffusion.flow_grpo import train
    from mmrl.pipelines.edits import make_shapes_edit_file
    from mmrl.testing import metrics_rows
    from mmrl.tiny import build_tiny_clip

    d = yaml.safe_load((CONFIGS / name).read_text())
    clip = str(build_tiny_clip(tmp_path / "clip"))
    for comp in d["reward"]["components"].values():
        if isinstance(comp, dict):
            comp.update({k: clip for k in ("weights", "processor") if k in comp})
    if "edit" in name:
        prompts = make_shapes_edit_file(tmp_path / "edits", n=4)
    else:
        prompts = tmp_path / "ocr.jsonl"
        prompts.write_text('{"prompt": "a sign that says \\"OPEN\\""}\n{"prompt": "a mug with \\"MMRL\\" on it"}\n')
    d.update(output_dir=str(tmp_path / "run"), device="cpu", dtype="float32")
    d["model"].update(path=str(tiny_family(family)))
    d["data"] = {"train_prompts": str(prompts)}
    d["rollout"].update(prompts_per_step=2, group_size=2, height=32, width=32, eval_num_steps=2)
    d["update"].update(mini_batch_size=0, micro_batch_size=2)
    d["train"].update(max_steps=1, save_every=1)
    d["log"].update(eval_every=0, sample_every=1, num_samples=4)
    d["dist"] = {"strategy": "none"}
    cfg = load_config(d)
    train(cfg)
    row = metrics_rows(cfg.output_dir)[0]
    assert row["diag/logprob_drift"] < 1e-4
    # random tiny images: the real OCR reads nothing in any of them (all rewards 0, every advantage 0) -> no update
    assert row["train/updates"] == (1 if row["train/kept_fraction"] > 0 else 0)
    assert {k.split("/")[1] for k in row if k.startswith("reward/") and k.count("/") == 1} >= set(d["reward"]["components"])
    assert (Path(cfg.output_dir) / "samples" / "step_000001.png").is_file()
