"""The real-model recipes of the newer families (configs/diffusion/flow_grpo_wan21_t2v.yaml,
flow_grpo_wan21_videoalign.yaml, flow_grpo_wan22_t2v_a14b.yaml, flow_grpo_z_image_pickscore.yaml, flow_grpo_flux2_dev.yaml,
flow_grpo_flux2_klein_pickscore.yaml,
flow_grpo_qwen_image_ocr.yaml, flow_grpo_qwen_image_edit_pickscore.yaml): their
published settings as written, their model / LoRA / guidance settings on a tiny pipeline directory of the same layout,
and each one run for a step on a tiny checkpoint of the same layout (same pipeline, scheduler and component classes)
with tiny reward models, only the paths and sizes changed (the real weights never ran here)."""

from pathlib import Path

import pytest
import torch
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


def test_wan21_videoalign_is_the_wan21_recipe_with_dancegrpo_videoalign_reward():
    """DanceGRPO (XueZeyue/DanceGRPO@15cc71d finetune_hunyuan_grpo.sh --vq_coef 1.0 --mq_coef 0.0,
    train_grpo_hunyuan.py reward(..., use_norm=True) in bf16): VideoReward's normalised VQ head; every other setting
    is the Flow-Factory Wan 2.1 file's (flow_grpo_wan21_t2v.yaml)."""
    wan, va = (yaml.safe_load((CONFIGS / f).read_text()) for f in ("flow_grpo_wan21_t2v.yaml",
                                                                  "flow_grpo_wan21_videoalign.yaml"))
    comps = va["reward"]["components"]
    assert list(comps) == ["videoalign"] and comps["videoalign"]["weight"] == 1.0
    assert (comps["videoalign"]["reward"], comps["videoalign"]["head"], comps["videoalign"]["dtype"]) == \
        ("videoalign", "vq", "bfloat16")
    assert comps["videoalign"].get("normalize", True)  # use_norm=True
    for d in (wan, va):
        d.pop("output_dir"), d["reward"].pop("components")
    assert wan == va


def test_z_image_pickscore_published_settings():
    """Flow-Factory examples/grpo/lora/z_image/default.yaml: 512 px, 10 steps, guidance 4 (Z-Image's scale), noise
    0.7 on one step of {1, 2, 3}, 48 x 16 per epoch with 2 updates, LoRA 64/128, lr 3e-4, clip 1e-4, PickScore."""
    cfg = load_config(CONFIGS / "flow_grpo_z_image_pickscore.yaml")
    s, lora = cfg.rollout, cfg.model.lora
    assert (s.height, s.num_steps, s.guidance_scale, s.noise_level, s.window_size, s.window_range) == \
        (512, 10, 4.0, 0.7, 1, [1, 4])
    assert cfg.update.updates_per_epoch(s.batch) == 2 and (lora.rank, lora.alpha, cfg.optim.lr) == (64, 128, 3e-4)
    assert list(cfg.reward.components) == ["pickscore"] and cfg.algo.kl.coef == 0.0


def test_flux2_klein_pickscore_published_settings(tmp_path):
    """Flow-Factory examples/grpo/lora/flux2_klein/default.yaml: 384 px, the distilled 4 steps, guidance 1 (no CFG),
    noise 0.5 on one step of {1, 2}, 48 x 16 per epoch with 2 updates, LoRA 64/128, lr 3e-4, clip 1e-4, PickScore;
    on a tiny step-distilled klein directory: bf16, every default LoRA target matched, no CFG."""
    from mmrl.pipelines.data import PromptItem
    from mmrl.tiny.family_models import build_tiny_flux2_klein

    cfg = load_config(CONFIGS / "flow_grpo_flux2_klein_pickscore.yaml")
    s, lora = cfg.rollout, cfg.model.lora
    assert (s.height, s.width, s.num_steps, s.guidance_scale, s.noise_level) == (384, 384, 4, 1.0, 0.5)
    assert (s.window_size, list(s.window_range), s.prompts_per_step, s.group_size) == (1, [1, 3], 48, 16)
    assert cfg.update.updates_per_epoch(s.batch) == 2 and (lora.rank, lora.alpha, cfg.optim.lr) == (64, 128, 3e-4)
    assert (cfg.algo.clip_range, cfg.algo.kl.coef, list(cfg.reward.components)) == (1e-4, 0.0, ["pickscore"])
    model = _loads_on_a_tiny_directory(cfg, build_tiny_flux2_klein(tmp_path / "klein", distilled=True),
                                       [PromptItem("a red cube")])
    assert model.dtype == torch.bfloat16 and not model.cfg_enabled(cfg.rollout.guidance_scale)


def test_flux2_dev_published_settings(tmp_path):
    """Flow-Factory examples/grpo/lora/flux2/t2i.yaml: 512 px, 8 steps, guidance 4 into the guidance embedding (no
    CFG), noise 1.0 on one step of {1, 2, 3}, 48 x 16 per epoch with 2 updates, LoRA 64/128, lr 3e-4, clip 1e-4, CLIP
    1.0 + PickScore 0.5; on a tiny [dev] directory: the guidance embedding is used, every default LoRA target matched."""
    from mmrl.pipelines.data import PromptItem
    from mmrl.tiny.family_models import build_tiny_flux2

    cfg = load_config(CONFIGS / "flow_grpo_flux2_dev.yaml")
    s, lora = cfg.rollout, cfg.model.lora
    assert (s.height, s.num_steps, s.guidance_scale, s.noise_level, s.window_size, list(s.window_range)) == \
        (512, 8, 4.0, 1.0, 1, [1, 4])
    assert cfg.update.updates_per_epoch(s.batch) == 2 and (lora.rank, lora.alpha, cfg.optim.lr) == (64, 128, 3e-4)
    comps = cfg.reward.components
    assert [(c["reward"], c["weight"]) for c in comps.values()] == [("clip_score", 1.0), ("pickscore", 0.5)]
    model = _loads_on_a_tiny_directory(cfg, build_tiny_flux2(tmp_path / "flux2"), [PromptItem("a red cube")])
    assert model.has_guidance_embedding and not model.cfg_enabled(cfg.rollout.guidance_scale)


def test_wan22_t2v_a14b_published_settings(tmp_path):
    """Flow-Factory examples/grpo/lora/wan22/t2v.yaml: 480 px, 5 frames, 10 steps, CFG 4 (high-noise expert) / 3
    (low-noise, guidance_scale_2), noise 0.9 on one step of {1, 2, 3}, 48 x 16 per epoch with 2 updates, LoRA 64/128 on
    both experts, lr 1e-4, clip 1e-4, PickScore per frame; on a tiny two-expert directory: the option reaches the
    model and LoRA wraps both experts."""
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.models import load_flow_model
    from mmrl.tiny.family_models import build_tiny_wan

    cfg = load_config(CONFIGS / "flow_grpo_wan22_t2v_a14b.yaml")
    s, lora = cfg.rollout, cfg.model.lora
    assert (s.height, s.width, s.num_frames, s.num_steps, s.guidance_scale, s.noise_level) == \
        (480, 480, 5, 10, 4.0, 0.9)
    assert (s.window_size, list(s.window_range), cfg.model.family_options) == (1, [1, 4], {"guidance_scale_2": 3.0})
    assert cfg.update.updates_per_epoch(s.batch) == 2 and (lora.rank, lora.alpha, cfg.optim.lr) == (64, 128, 1e-4)
    comp = cfg.reward.components["pick_score"]
    assert (comp["reward"], comp["image_reward"], comp["aggregate"]) == ("video_frames", "pickscore", "mean")
    model = load_flow_model(build_tiny_wan(tmp_path / "wan22", variant="2.2_a14b", scheduler="unipc"), "cpu",
                            torch.bfloat16, 16, num_frames=s.num_frames, family_options=cfg.model.family_options)
    assert model.guidance_scale_2 == 3.0 and model.boundary is not None
    build_policy_states(model, cfg.model, old=False, ref=False)
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    for expert in ("high", "low"):
        assert any(n.startswith(f"{expert}.") and "lora_A" in n for n in trainable), expert


def _loads_on_a_tiny_directory(cfg, tiny_path, items):
    """The recipe's model section on a tiny directory of the same pipeline class: load in the recipe's dtype, wrap
    with its LoRA (the family's default targets: every one must match), one guided velocity."""
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.conditioning import encode_items
    from mmrl.diffusion.models import load_flow_model
    from mmrl.runtime import resolve_dtype

    model = load_flow_model(tiny_path, "cpu", resolve_dtype(cfg.dtype), cfg.model.max_sequence_length or None)
    build_policy_states(model, cfg.model, old=False, ref=False)
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    for target in model.lora_target_modules:
        assert any(f".{target}.lora_A" in n for n in trainable), target
    emb = encode_items(model, items, 64, 64)
    x = model.initial_noise(len(items), 64, 64, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(x, 0.5, emb, guidance_scale=cfg.rollout.guidance_scale)
    assert v.shape == x.shape and torch.isfinite(v).all()
    return model


def test_qwen_image_ocr_published_settings(tiny_family):
    from mmrl.pipelines.data import PromptItem

    cfg = load_config(CONFIGS / "flow_grpo_qwen_image_ocr.yaml")
    s, lora = cfg.rollout, cfg.model.lora
    # source: verl-omni run_qwen_image_ocr_lora.sh + its rollout / actor config defaults
    assert (s.prompts_per_step, s.group_size, s.height, s.num_steps, s.guidance_scale) == (32, 16, 512, 10, 4.0)
    assert (s.noise_level, s.window_size, list(s.window_range)) == (1.2, 2, [0, 5])
    assert (lora.rank, lora.alpha, cfg.optim.lr, cfg.optim.weight_decay) == (64, 128, 3e-4, 1e-4)
    assert (cfg.algo.clip_range, cfg.algo.kl.coef, cfg.update.updates_per_epoch(s.batch)) == (1e-4, 0.0, 2)
    assert cfg.model.max_sequence_length == 256 and list(cfg.reward.components) == ["ocr"]
    model = _loads_on_a_tiny_directory(cfg, tiny_family("QwenImagePipeline"), [PromptItem('a sign that says "HELLO"')])
    assert model.dtype == torch.bfloat16 and model.max_sequence_length == 256


def test_qwen_image_edit_published_settings(tiny_family, tmp_path):
    from mmrl.pipelines.data import load_prompts
    from mmrl.pipelines.edits import make_shapes_edit_file
    from mmrl.rewards import available

    cfg = load_config(CONFIGS / "flow_grpo_qwen_image_edit_pickscore.yaml")
    s = cfg.rollout
    # source: verl-omni run_qwen_image_edit_lora.sh
    assert (s.prompts_per_step, s.group_size, s.height, s.num_steps, s.guidance_scale) == (32, 16, 512, 12, 4.0)
    assert (s.noise_level, s.window_size, list(s.window_range), s.eval_num_steps) == (0.7, 3, [0, 6], 40)
    assert (cfg.model.lora.rank, cfg.optim.lr, cfg.algo.clip_range, cfg.reward.std_mode) == (64, 3e-4, 1e-4, "group")
    assert set(cfg.reward.components) <= set(available())
    items = load_prompts(make_shapes_edit_file(tmp_path, n=2))
    _loads_on_a_tiny_directory(cfg, tiny_family("QwenImageEditPlusPipeline"), items)


# recipe file -> (tiny pipeline: a registered pipeline class (its first tiny case) or a builder with its options, rollout size, model overrides,
# prompts: shapes text prompts, OCR prompts or shapes edit rows)
STEP_CASES = {
    "flow_grpo_wan21_t2v.yaml": (("build_tiny_wan", {"scheduler": "unipc"}), {"num_steps": 4},
                                 {"max_sequence_length": 16}, "shapes"),
    "flow_grpo_wan21_videoalign.yaml": (("build_tiny_wan", {"scheduler": "unipc"}), {"num_steps": 4},
                                        {"max_sequence_length": 16}, "shapes"),
    "flow_grpo_z_image_pickscore.yaml": (("build_tiny_z_image", {}), {"num_steps": 4}, {"max_sequence_length": 16},
                                         "shapes"),
    "flow_grpo_wan22_t2v_a14b.yaml": (("build_tiny_wan", {"variant": "2.2_a14b", "scheduler": "unipc"}),
                                      {}, {"max_sequence_length": 16}, "shapes"),
    "flow_grpo_flux2_dev.yaml": (("build_tiny_flux2", {}), {"height": 64, "width": 64}, {"max_sequence_length": 16},
                                 "shapes"),
    "flow_grpo_flux2_klein_pickscore.yaml": (("build_tiny_flux2_klein", {"distilled": True}),
                                             {"height": 64, "width": 64}, {"max_sequence_length": 16}, "shapes"),
    "flow_grpo_qwen_image_ocr.yaml": ("QwenImagePipeline", {}, {}, "ocr"),
    # 4 of its 16 steps (its 10-step SDE window shrunk with them), 5 frames of the tiny 2x-temporal VAE
    "flow_grpo_hunyuan15_t2v.yaml": ("HunyuanVideo15Pipeline", {"num_steps": 4, "window_size": 3,
                                                                "window_range": [0, 4], "num_frames": 5},
                                     {"max_sequence_length": 16}, "shapes"),
    "flow_grpo_qwen_image_edit_pickscore.yaml": ("QwenImageEditPlusPipeline", {}, {}, "edits"),
}


def _prompts(kind: str, tmp_path: Path) -> Path:
    if kind == "edits":
        from mmrl.pipelines.edits import make_shapes_edit_file

        return make_shapes_edit_file(tmp_path / "edits", n=4)
    if kind == "ocr":
        path = tmp_path / "ocr.jsonl"
        path.write_text('{"prompt": "a sign that says \\"OPEN\\""}\n{"prompt": "a mug with \\"MMRL\\" on it"}\n')
        return path
    return REPO / "assets" / "prompts" / "shapes_train.txt"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STEP_CASES))
def test_real_recipe_runs_on_a_tiny_model_of_the_same_layout(name, tiny_family, tmp_path):
    """The recipe file as written, only paths and sizes changed (tiny CLIP for CLIP / PickScore, the real PP-OCRv4 for
    the OCR reward): one Flow-GRPO step with its CFG, SDE window and LoRA on a tiny directory of the same layout."""
    import mmrl.tiny.family_models as family_models
    from mmrl.tiny import build_tiny_clip, build_tiny_videoalign

    pipe, rollout, model, prompts = STEP_CASES[name]
    if isinstance(pipe, str):
        model_path = tiny_family(pipe)
    else:
        model_path = getattr(family_models, pipe[0])(tmp_path / "pipe", **pipe[1])
    clip = str(build_tiny_clip(tmp_path / "clip"))
    d = yaml.safe_load((CONFIGS / name).read_text())
    for comp in d["reward"]["components"].values():  # every reward model path -> the tiny CLIP
        if isinstance(comp, dict) and comp.get("reward") == "videoalign":  # -> a tiny VideoReward (its base inside)
            comp.pop("base", None)
            comp.update(weights=str(build_tiny_videoalign(tmp_path / "videoalign")), dtype="float32")
        elif isinstance(comp, dict):
            comp.update({k: clip for k in ("weights", "processor") if k in comp})
    d.update(output_dir=str(tmp_path / "run"), device="cpu", dtype="float32")
    d["model"].update(path=str(model_path), **model)
    d["data"] = {"train_prompts": str(_prompts(prompts, tmp_path))}
    d["rollout"].update({**dict(prompts_per_step=2, group_size=2, height=32, width=32, eval_num_steps=2), **rollout})
    d["update"].update(mini_batch_size=0, micro_batch_size=2)
    d["train"].update(max_steps=1, save_every=1)
    d["log"].update(eval_every=0, sample_every=1, num_samples=4)
    d["dist"] = {"strategy": "none"}
    cfg = load_config(d)
    if name == "flow_grpo_wan22_t2v_a14b.yaml":  # as published, the SDE window (steps 1-3 of 10) is all at t >= 875
        with pytest.warns(UserWarning, match=r"transformer_2 get\(s\) no gradient: no SDE step in "
                                             r"rollout.window_range=\[1, 4\] of 10 steps"):
            train(cfg)
    else:
        train(cfg)
    row = metrics_rows(cfg.output_dir)[0]
    assert row["diag/logprob_drift"] < 1e-4
    # random tiny images: the real OCR reads nothing in any of them (all rewards 0, every advantage 0) -> no update
    assert row["train/updates"] == (1 if prompts != "ocr" or row["train/kept_fraction"] > 0 else 0)
    assert set(k.split("/")[1] for k in row if k.startswith("reward/") and k.count("/") == 1) >= \
        set(d["reward"]["components"]) | {"mean", "std"}
    video = d["rollout"].get("num_frames", 1) > 1
    assert (Path(cfg.output_dir) / "samples" / f"step_000001.{'mp4' if video else 'png'}").is_file()
