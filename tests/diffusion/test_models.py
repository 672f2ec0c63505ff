"""Model wrappers against the diffusers pipelines they wrap (tiny SD3 / FLUX saved in diffusers format)."""

import json

import pytest
import torch

from mmrl.diffusion.models import FluxModel, PromptEmbeds, SD3Model, load_flow_model
from mmrl.diffusion.sampling import sample_groups


def test_bad_model_path_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"model.path '.*nope' does not exist.*model_index.json"):
        load_flow_model(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no model_index.json"):
        load_flow_model(empty)
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ValueError, match="'StableDiffusionPipeline' is not supported; supported: .*FluxPipeline"):
        load_flow_model(other)


def test_prompt_embeds_select_repeats_rows():
    e = PromptEmbeds(prompt_embeds=torch.arange(6.0).view(2, 3, 1), pooled_prompt_embeds=torch.tensor([[1.0], [2.0]]))
    r = e.select([0, 0, 1])
    assert len(e) == 2 and len(r) == 3
    assert r["pooled_prompt_embeds"].flatten().tolist() == [1.0, 1.0, 2.0]
    assert torch.equal(r["prompt_embeds"][2], e["prompt_embeds"][1])


def test_sd3_ode_rollout_equals_diffusers_pipeline(tiny_sd3):
    """Deterministic sampling through our wrapper = StableDiffusion3Pipeline with the same initial latents,
    with classifier-free guidance (negative prompt "")."""
    m = tiny_sd3
    assert isinstance(m, SD3Model)
    emb = m.encode_prompts(["a red circle on a blue background", "a green square on a white background"])
    g = torch.Generator().manual_seed(0)
    traj = sample_groups(m, emb, 2, num_steps=4, height=64, width=64, guidance_scale=4.5, noise_level=0.0,
                         generator=g)
    assert traj.sde_mask.sum() == 0 and traj.train_steps.numel() == 0
    ref = m.pipe(prompt=["a red circle on a blue background"] * 2 + ["a green square on a white background"] * 2,
                 negative_prompt=[""] * 4, latents=traj.latents[:, 0].clone(), num_inference_steps=4,
                 guidance_scale=4.5, height=64, width=64, output_type="latent", max_sequence_length=128).images
    assert torch.allclose(traj.latents[:, -1], ref, atol=1e-5), (traj.latents[:, -1] - ref).abs().max()
    assert traj.images.shape == (4, 3, 64, 64) and 0 <= traj.images.min() and traj.images.max() <= 1


def test_cfg_velocity_is_the_guided_combination(tiny_sd3):
    m = tiny_sd3
    emb = m.encode_prompts(["a red circle on a blue background"])
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v = m.velocity(x, 0.7, emb, guidance_scale=3.0)
        v_c = m.velocity(x, 0.7, emb, guidance_scale=1.0)
        v_u = m.velocity(x, 0.7, m.negative_embeds(1), guidance_scale=1.0)
    assert torch.allclose(v, v_u + 3.0 * (v_c - v_u), atol=1e-5)
    assert not torch.allclose(v, v_c)


def test_flux_matches_diffusers_pipeline(tiny_flux_path):
    """FLUX: packed latents, img/txt ids and the guidance embedding; our [B, C, h, w] layout packed by the
    wrapper gives the pipeline's result (the pipeline's latents are packed)."""
    m = load_flow_model(tiny_flux_path)
    assert isinstance(m, FluxModel) and m.has_guidance_embedding
    prompt = "a red circle on a blue background"
    emb = m.encode_prompts([prompt])
    traj = sample_groups(m, emb, 2, num_steps=3, height=64, width=64, guidance_scale=3.5, noise_level=0.0,
                         generator=torch.Generator().manual_seed(0))
    b, c, h, w = traj.latents[:, 0].shape
    packed = m.pipe._pack_latents(traj.latents[:, 0].clone(), b, c, h, w)
    ref = m.pipe(prompt=[prompt] * 2, latents=packed, num_inference_steps=3, guidance_scale=3.5, height=64, width=64,
                 output_type="latent", max_sequence_length=512).images
    ours = m.pipe._pack_latents(traj.latents[:, -1].clone(), b, c, h, w)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert m.sigmas(3, 64, 64)[-1] == 0 and traj.images.shape == (2, 3, 64, 64)


def test_image_size_must_fit_the_latent_grid(tiny_sd3):
    with pytest.raises(ValueError, match="multiple of 8"):
        tiny_sd3.initial_noise(1, 60, 64)


def test_encode_images_inverts_decode_scaling(tiny_sd3):
    m = tiny_sd3
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    z = m.encode_images(images)
    assert z.shape == (2, 4, 16, 16) and z.dtype == torch.float32
    cfg = m.vae.config
    with torch.no_grad():
        raw = m.vae.encode(images * 2 - 1).latent_dist.mean
        expected = m.vae.decode(raw, return_dict=False)[0] / 2 + 0.5
    assert torch.allclose(m.decode(z, 64, 64), expected.clamp(0, 1), atol=1e-5)
    assert torch.allclose(z, (raw - (cfg.shift_factor or 0.0)) * cfg.scaling_factor)
