"""FLUX.2 [dev] (`Flux2Pipeline`, Mistral3 + PixtralProcessor) and FLUX.2 [klein] (`Flux2KleinPipeline`, Qwen3)
against diffusers' own pipelines: tiny real-architecture checkpoints saved in the diffusers layout and loaded back."""

import json

import pytest
import torch

from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo
from mmrl.diffusion.models import load_flow_model
from mmrl.diffusion.models.flux2 import Flux2KleinModel, Flux2Model
from mmrl.diffusion.sampling import sample_groups

P = ["a red circle on a blue background", "a green square"]
SEQ = 64


def _rollout(m, gs):
    return sample_groups(m, m.encode_prompts(P), 2, num_steps=4, height=64, width=64, guidance_scale=gs,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))


def _pipe(m, x0, gs, output_type):
    return m.pipe(prompt=[P[0]] * 2 + [P[1]] * 2, latents=x0.clone(), num_inference_steps=4, guidance_scale=gs,
                  height=64, width=64, output_type=output_type, max_sequence_length=SEQ).images


def test_flux2_dev_ode_rollout_equals_diffusers_pipeline(tiny_flux2_path):
    """[dev]: guidance embedding (no CFG), Mistral3 layers (10, 20, 30) of the chat-templated prompt, the empirical
    mu schedule; latents [B, 128, H/16, W/16] (the pipeline's noise space; its latent output is packed tokens)."""
    index = json.loads((tiny_flux2_path / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline" and index["tokenizer"] == ["transformers", "PixtralProcessor"]
    m = load_flow_model(tiny_flux2_path, max_sequence_length=SEQ)
    assert isinstance(m, Flux2Model) and m.has_guidance_embedding and not m.cfg_enabled(4.0)
    traj = _rollout(m, 4.0)
    assert traj.latents.shape[2:] == (128, 4, 4)
    ref = _pipe(m, traj.latents[:, 0], 4.0, "latent")
    ours = m.pipe._pack_latents(traj.latents[:, -1])
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert torch.allclose(traj.images, _pipe(m, traj.latents[:, 0], 4.0, "pt"), atol=1e-5)


def test_flux2_klein_true_cfg_equals_diffusers_pipeline(tiny_flux2_klein_path):
    """[klein]: no guidance embedding, true CFG with the empty prompt (cond and uncond in separate calls in diffusers,
    one doubled batch here), Qwen3 layers (9, 18, 27); its latent output is unpacked and de-normalised."""
    m = load_flow_model(tiny_flux2_klein_path, max_sequence_length=SEQ)
    assert isinstance(m, Flux2KleinModel) and not m.has_guidance_embedding and m.cfg_enabled(4.0)
    traj = _rollout(m, 4.0)
    ref = _pipe(m, traj.latents[:, 0], 4.0, "latent")
    mean, std = m._bn_stats(traj.latents[:, -1])
    ours = m.pipe._unpatchify_latents(traj.latents[:, -1] * std + mean)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert torch.allclose(traj.images, _pipe(m, traj.latents[:, 0], 4.0, "pt"), atol=1e-5)


def test_flux2_klein_distilled_ignores_guidance_as_diffusers(tmp_path):
    """A step-distilled [klein] (`is_distilled: true`) runs without CFG whatever the scale (diffusers' rule; Flow-
    Factory's distilled configs set guidance 1.0 for the same reason), with a warning."""
    from mmrl.tiny.family_models import build_tiny_flux2_klein

    m = load_flow_model(build_tiny_flux2_klein(tmp_path / "klein", distilled=True), max_sequence_length=SEQ)
    with pytest.warns(UserWarning, match="ignored: this FLUX.2 \\[klein\\] checkpoint is step-distilled"):
        traj = _rollout(m, 4.0)
    ref = _pipe(m, traj.latents[:, 0], 4.0, "pt")
    assert torch.allclose(traj.images, ref, atol=1e-5)
    assert torch.equal(traj.latents, _rollout(m, 1.0).latents)


@pytest.mark.parametrize("fixture, gs", [("tiny_flux2_path", 4.0), ("tiny_flux2_klein_path", 3.0)])
def test_flux2_sde_log_probs_follow_flow_grpo(fixture, gs, request):
    m = load_flow_model(request.getfixturevalue(fixture), max_sequence_length=SEQ)
    assert_sde_log_probs_follow_flow_grpo(m, m.encode_prompts(P), guidance_scale=gs)


def test_flux2_encode_images_inverts_decode_scaling(tiny_flux2_klein_path):
    """encode_images: posterior mode, 2x2 patchify, batch-norm statistics; decode undoes the scaling."""
    m = load_flow_model(tiny_flux2_klein_path, max_sequence_length=SEQ)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    z = m.encode_images(images)
    assert z.shape == (2, 128, 4, 4)
    with torch.no_grad():
        raw = m.vae.encode(images * 2 - 1).latent_dist.mode()
        expected = (m.vae.decode(raw, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
    bn = m.vae.bn
    norm = (m.pipe._patchify_latents(raw) - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(
        bn.running_var.view(1, -1, 1, 1) + m.vae.config.batch_norm_eps)
    assert torch.allclose(z, norm, atol=1e-5)
    assert torch.allclose(m.decode(z, 64, 64), expected, atol=1e-5)


def test_flux2_lora_targets_exist(tiny_flux2_path):
    """Flow-Factory's FLUX.2 targets name real modules; the single-stream output projection is not among them."""
    m = load_flow_model(tiny_flux2_path)
    assert_lora_targets_exist(m)
    single_out = [n for n, _ in m.transformer.named_modules() if n.startswith("single_transformer_blocks")
                  and n.endswith("attn.to_out")]
    assert single_out and not any(n.endswith("." + t) for n in single_out for t in m.lora_target_modules)
