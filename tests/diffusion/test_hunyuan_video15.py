"""HunyuanVideo 1.5 text-to-video (`HunyuanVideo15Pipeline`) against diffusers' own pipeline: a tiny
real-architecture checkpoint (Qwen2.5-VL text model, ByT5 glyph encoder, AutoencoderKLHunyuanVideo15,
HunyuanVideo15Transformer3DModel, ClassifierFreeGuidance guider) saved in the diffusers layout and loaded back, at a
size the diffusers tests do not use (16 x 24, 7 frames; theirs: 16 x 16, 9 frames)."""

import json

import pytest
import torch

from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo
from mmrl.diffusion.models import load_flow_model
from mmrl.diffusion.models.hunyuan_video15 import HunyuanVideo15Model
from mmrl.diffusion.sampling import sample_groups

P = ["a red circle on a blue background", 'a sign saying "mmrl"']  # the second quotes glyph text (ByT5)
H, W, F = 16, 24, 7


@pytest.fixture(scope="module")
def hy_path(tiny_family):
    return tiny_family("HunyuanVideo15Pipeline")


def _pipe(m, x0, gs, output_type="latent", rows=None):
    """The pipeline on the same noise; its guider holds the scale (it takes no guidance argument)."""
    from diffusers.guiders import ClassifierFreeGuidance

    m.pipe.guider = ClassifierFreeGuidance(guidance_scale=gs)
    rows = list(range(x0.shape[0])) if rows is None else rows
    prompts = [P[0], P[0], P[1], P[1]]
    return m.pipe(prompt=[prompts[i] for i in rows], latents=x0[rows].clone(), num_inference_steps=3, height=H,
                  width=W, num_frames=F, output_type=output_type).frames


@pytest.mark.parametrize("gs", [1.0, 6.0])
def test_ode_rollout_equals_diffusers_pipeline(hy_path, gs):
    """Latents [B, 4, F', h, w] equal HunyuanVideo15Pipeline's for equal initial noise, with and without CFG (the
    empty negative prompt), 1000-token Qwen text and the ByT5 glyph branch; decoded videos equal its per sample."""
    assert json.loads((hy_path / "model_index.json").read_text())["_class_name"] == "HunyuanVideo15Pipeline"
    m = load_flow_model(hy_path, num_frames=F)
    assert isinstance(m, HunyuanVideo15Model) and m.is_video and m.max_sequence_length == 1000
    traj = sample_groups(m, m.encode_prompts(P), 2, num_steps=3, height=H, width=W, guidance_scale=gs,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape == (4, 4, 4, 4, 4, 6)  # [B, T+1, C, (7 - 1) / 2 + 1, 16 / 4, 24 / 4]
    ref = _pipe(m, traj.latents[:, 0], gs)
    assert torch.allclose(traj.latents[:, -1], ref, atol=1e-6), (traj.latents[:, -1] - ref).abs().max()
    video = _pipe(m, traj.latents[:, 0], gs, output_type="pt", rows=[2])  # its VAE decodes one sample at a time
    assert traj.images.shape == (4, F, 3, H, W) and video.shape == (1, F, 3, H, W)
    assert torch.allclose(traj.images[2:3], video, atol=1e-5)


def test_template_is_cropped_to_the_prompt_and_glyph_text_reaches_byt5(hy_path):
    """The tiny tokenizer splits the pipeline's system turn into exactly the 108 tokens it drops: the kept mask
    counts the prompt's own tokens (+ the closing turn); only a quoted prompt gets ByT5 tokens."""
    m = load_flow_model(hy_path, num_frames=F)
    emb = m.encode_prompts(P)
    tok = m.pipe.tokenizer
    own = len(tok(P[0] + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids)
    assert emb["prompt_embeds"].shape == (2, 1000, 16) and int(emb["prompt_embeds_mask"][0].sum()) == own
    assert emb["glyph_embeds"].shape == (2, 256, 32)
    assert emb["glyph_embeds_mask"][0].sum() == 0 and emb["glyph_embeds_mask"][1].sum() > 0


def test_short_text_budget_gives_the_same_velocity(hy_path):
    """Padding is masked out of every attention: max_sequence_length 16 (what the recipe tests use) gives the
    1000-token velocity for prompts that fit."""
    long, short = load_flow_model(hy_path, num_frames=F), load_flow_model(hy_path, num_frames=F, max_sequence_length=16)
    x = torch.randn(2, 4, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = long.velocity(x, torch.tensor([0.9, 0.4]), long.encode_prompts(P), guidance_scale=3.0)
        b = short.velocity(x, torch.tensor([0.9, 0.4]), short.encode_prompts(P), guidance_scale=3.0)
    assert short.encode_prompts(P)["prompt_embeds"].shape[1] == 16
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_sde_log_probs_and_lora_targets(hy_path):
    m = load_flow_model(hy_path, num_frames=5, max_sequence_length=16)
    traj = assert_sde_log_probs_follow_flow_grpo(m, m.encode_prompts(P), guidance_scale=3.0, height=16, width=16)
    assert traj.latents.dim() == 6
    assert_lora_targets_exist(m)


def test_bad_frames_and_guider_fail_in_one_line(hy_path, tmp_path):
    import shutil

    with pytest.raises(ValueError, match=r"^rollout.num_frames=6: the HunyuanVideo 1.5 VAE takes 2k\+1 frames; "
                                         r"use 5 or 7$"):
        load_flow_model(hy_path, num_frames=6)
    other = shutil.copytree(hy_path, tmp_path / "pipe")
    cfg = other / "guider" / "guider_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "guidance_rescale": 0.7}))
    with pytest.raises(ValueError, match=r"^HunyuanVideo15Pipeline: guider/guider_config.json guidance_rescale=0.7 "
                                         r"is not supported \(expected 0.0: "):
        load_flow_model(other)
