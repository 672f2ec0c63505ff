"""Wan 2.1 / 2.2 text-to-video (`WanPipeline`) against diffusers' own pipeline: tiny real-architecture checkpoints
(UMT5 encoder, AutoencoderKLWan, WanTransformer3DModel) saved in the diffusers layout and loaded back."""

import json

import pytest
import torch

from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo
from mmrl.diffusion.models import FlowModel, load_flow_model
from mmrl.diffusion.models.wan import WanExperts, WanModel
from mmrl.diffusion.sampling import sample_groups

P = ["a red circle on a blue background", "a green square"]
SEQ = 16  # text tokens: the tiny prompts are shorter


def _pipe_latents(m, x0, *, steps, size, frames, gs, output_type="latent", **kw):
    prompts = [P[0]] * 2 + [P[1]] * 2
    out = m.pipe(prompt=prompts, negative_prompt=[""] * 4, latents=x0.clone(), num_inference_steps=steps,
                 guidance_scale=gs, height=size, width=size, num_frames=frames, output_type=output_type,
                 max_sequence_length=SEQ, **kw)
    return out.frames


def test_wan21_ode_rollout_equals_diffusers_pipeline(tiny_wan_path):
    """Latents [B, 16, F', h, w] and decoded videos equal WanPipeline's with the same initial noise, under CFG with
    the empty negative prompt (UMT5 embeddings cut to the prompt and zero-padded, raw timesteps 1000 sigma)."""
    assert json.loads((tiny_wan_path / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    m = load_flow_model(tiny_wan_path, num_frames=5, max_sequence_length=SEQ)
    assert isinstance(m, WanModel) and m.is_video and m.num_frames == 5
    traj = sample_groups(m, m.encode_prompts(P), 2, num_steps=4, height=32, width=32, guidance_scale=5.0,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape == (4, 5, 16, 2, 4, 4)  # [B, T+1, C, (5 - 1) / 4 + 1, 32 / 8, 32 / 8]
    ref = _pipe_latents(m, traj.latents[:, 0], steps=4, size=32, frames=5, gs=5.0)
    assert torch.allclose(traj.latents[:, -1], ref, atol=1e-5), (traj.latents[:, -1] - ref).abs().max()
    video = _pipe_latents(m, traj.latents[:, 0], steps=4, size=32, frames=5, gs=5.0, output_type="pt")
    assert traj.images.shape == video.shape == (4, 5, 3, 32, 32)
    assert torch.allclose(traj.images, video, atol=1e-5)


def test_wan_sde_log_probs_follow_flow_grpo(tiny_wan_path):
    """Video latents [B, C, F, h, w]: the log-prob is the same Gaussian density averaged over every non-batch dim."""
    m = load_flow_model(tiny_wan_path, num_frames=5, max_sequence_length=SEQ)
    traj = assert_sde_log_probs_follow_flow_grpo(m, m.encode_prompts(P), guidance_scale=3.0, height=32, width=32)
    assert traj.latents.dim() == 6


def test_wan22_a14b_routes_by_boundary_with_guidance_scale_2(tiny_wan22_path):
    """Wan 2.2 A14B: high-noise steps (t >= 875) go through `transformer`, the rest through `transformer_2` with
    guidance_scale_2; the rollout equals WanPipeline(guidance_scale=5, guidance_scale_2=2) and both experts ran."""
    m = load_flow_model(tiny_wan22_path, num_frames=5, max_sequence_length=SEQ,
                        family_options={"guidance_scale_2": 2.0})
    assert isinstance(m.transformer, WanExperts) and m.boundary == 875.0
    calls = {"high": 0, "low": 0}
    hooks = [getattr(m.transformer, k).register_forward_pre_hook(lambda *a, k=k: calls.__setitem__(k, calls[k] + 1))
             for k in calls]
    traj = sample_groups(m, m.encode_prompts(P), 2, num_steps=4, height=32, width=32, guidance_scale=5.0,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))
    for h in hooks:
        h.remove()
    high_steps = int((m.sigmas(4, 32, 32)[:4] * 1000 >= 875).sum())
    assert calls == {"high": high_steps, "low": 4 - high_steps} and 0 < high_steps < 4
    ref = _pipe_latents(m, traj.latents[:, 0], steps=4, size=32, frames=5, gs=5.0, guidance_scale_2=2.0)
    assert torch.allclose(traj.latents[:, -1], ref, atol=1e-5), (traj.latents[:, -1] - ref).abs().max()
    same = _pipe_latents(m, traj.latents[:, 0], steps=4, size=32, frames=5, gs=5.0)  # guidance_scale_2 = 5
    assert not torch.allclose(same, ref, atol=1e-3)


def test_wan22_mixed_batch_goes_through_each_expert_per_sample(tiny_wan22_path):
    """A batch with noise levels on both sides of the boundary (DiffusionNFT draws one per sample) gives each
    sample what its own expert gives it alone."""
    m = load_flow_model(tiny_wan22_path, num_frames=5, max_sequence_length=SEQ)
    emb = m.encode_prompts(P)
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    sig = torch.tensor([0.95, 0.3])
    with torch.no_grad():
        both = m.velocity(x, sig, emb, guidance_scale=1.0)
        alone = [m.velocity(x[i:i + 1], sig[i:i + 1], emb.select([i]), guidance_scale=1.0) for i in range(2)]
    assert torch.allclose(both, torch.cat(alone), atol=1e-5)
    with torch.no_grad():  # and the two experts differ (else routing would be untestable)
        other = m.transformer.low(hidden_states=x[:1], timestep=torch.tensor([950.0]),
                                  encoder_hidden_states=emb["prompt_embeds"][:1], return_dict=False)[0]
    assert not torch.allclose(other.float(), alone[0], atol=1e-3)


def test_wan22_ti2v_expand_timesteps_equals_pipeline(tmp_path):
    """Wan2.2-TI2V-5B's layout (expand_timesteps, 48-channel residual VAE with 2x2 patching, x16 spatial): the
    per-token timestep and the 64 px x 5 frame rollout equal diffusers'."""
    from mmrl.tiny.family_models import build_tiny_wan

    m = load_flow_model(build_tiny_wan(tmp_path / "ti2v", variant="2.2_ti2v"), num_frames=5, max_sequence_length=SEQ)
    assert m.expand_timesteps and m.vae_scale_factor == 16
    traj = sample_groups(m, m.encode_prompts(P), 2, num_steps=3, height=64, width=64, guidance_scale=5.0,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape[2:] == (48, 2, 4, 4)
    ref = _pipe_latents(m, traj.latents[:, 0], steps=3, size=64, frames=5, gs=5.0)
    assert torch.allclose(traj.latents[:, -1], ref, atol=1e-5), (traj.latents[:, -1] - ref).abs().max()


def test_wan_unipc_checkpoint_uses_unipc_flow_sigmas(tmp_path):
    """The published Wan 2.1 scheduler (UniPCMultistepScheduler, flow sigmas, flow_shift 3): the rollout visits
    exactly UniPC's sigmas (solved with Euler / the SDE), and DPO's training shift is flow_shift."""
    from diffusers import UniPCMultistepScheduler

    from mmrl.tiny.family_models import build_tiny_wan

    m = load_flow_model(build_tiny_wan(tmp_path / "unipc", scheduler="unipc"), num_frames=1, max_sequence_length=SEQ)
    assert type(m.pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    ref = UniPCMultistepScheduler.from_config(m.pipe.scheduler.config)
    ref.set_timesteps(10)
    assert torch.equal(m.sigmas(10, 32, 32), ref.sigmas.float()) and m.sigmas(10, 32, 32)[-1] == 0
    assert m.sigma_shift == 3.0
    traj = sample_groups(m, m.encode_prompts(P[:1]), 2, num_steps=3, height=32, width=32, noise_level=0.7,
                         generator=torch.Generator().manual_seed(0))
    assert traj.images.shape == (2, 3, 32, 32)  # one frame: images [B, 3, H, W]


def test_wan22_idle_experts_of_an_sde_window(tmp_path):
    """Which A14B expert a step runs through follows t = 1000 sigma against boundary_ratio * 1000 = 875: with the
    published UniPC schedule (flow_shift 3) and 10 steps, step 3 is at 875.16 (high-noise) and step 4 at 818.4, so a
    window on steps 1-3 never reaches `transformer_2` (Flow-Factory's Wan 2.2 recipe), 6-9 never `transformer`."""
    from mmrl.tiny.family_models import build_tiny_wan

    m = load_flow_model(build_tiny_wan(tmp_path / "a14b", variant="2.2_a14b", scheduler="unipc"), num_frames=5,
                        max_sequence_length=SEQ)
    t = m.sigmas(10, 32, 32) * 1000
    assert m.boundary == 875.0 and t[3] >= 875.0 > t[4]
    assert m.idle_experts(10, 32, 32, (1, 4)) == ["transformer_2"]
    assert m.idle_experts(10, 32, 32, (6, 10)) == ["transformer"] and m.idle_experts(10, 32, 32, (1, 5)) == []
    assert load_flow_model(build_tiny_wan(tmp_path / "w21"), num_frames=5).idle_experts(10, 32, 32, (1, 4)) == []


def test_frame_counts_and_options_fail_in_one_line(tiny_wan_path, tiny_sd3_path):
    with pytest.raises(ValueError, match=r"^rollout.num_frames=6: the Wan VAE takes 4k\+1 frames .*use 5 or 9$"):
        load_flow_model(tiny_wan_path, num_frames=6)
    with pytest.raises(ValueError, match=r"rollout.num_frames=5: StableDiffusion3Pipeline generates images.*"
                                         r"'WanPipeline'"):
        load_flow_model(tiny_sd3_path, num_frames=5)
    with pytest.raises(ValueError, match="guidance_scale_2 applies to Wan 2.2 A14B"):
        load_flow_model(tiny_wan_path, family_options={"guidance_scale_2": 3.0})
    with pytest.raises(ValueError, match=r"family_options: \['shift'\] not known to WanPipeline \(valid: "
                                         r"\['guidance_scale_2'\]\)"):
        load_flow_model(tiny_wan_path, family_options={"shift": 3.0})
    with pytest.raises(ValueError, match=r"family_options: \['shift'\] not known to StableDiffusion3Pipeline"):
        load_flow_model(tiny_sd3_path, family_options={"shift": 3.0})


def test_more_frames_than_the_rotary_table_takes_is_one_line(tiny_wan_path):
    """Latent frames beyond the transformer's rope_max_seq_len (64 in the tiny Wan) are refused at load (issue 27:
    `RuntimeError: shape '[25001, 1, 1, -1]' is invalid` from diffusers' rotary embedding at the first step); the
    largest count allowed runs."""
    with pytest.raises(ValueError, match=r"^rollout.num_frames=257: 65 latent frames \(\(257 - 1\) / 4 \+ 1\), "
                                         r"more than the Wan transformer's rotary positions take \(64: "
                                         r"rope_max_seq_len 64 in its config.json\); use at most 253 frames$"):
        load_flow_model(tiny_wan_path, num_frames=257)
    m = load_flow_model(tiny_wan_path, num_frames=253, max_sequence_length=SEQ)
    traj = sample_groups(m, m.encode_prompts(P[:1]), 1, num_steps=1, height=16, width=16, guidance_scale=1.0,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape == (1, 2, 16, 64, 2, 2) and traj.images.shape == (1, 253, 3, 16, 16)


def test_video_encode_is_the_inverse_of_decode_scaling(tiny_wan_path):
    """encode_images: VAE posterior mean, then (z - latents_mean) / latents_std; decode undoes it (as the pipeline)."""
    m = load_flow_model(tiny_wan_path, num_frames=5, max_sequence_length=SEQ)
    video = torch.rand(2, 5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    z = m.encode_images(video)
    assert z.shape == (2, 16, 2, 4, 4)
    c = m.vae.config
    with torch.no_grad():
        raw = m.vae.encode(video.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mean
        expected = (m.vae.decode(raw, return_dict=False)[0] / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    mean, std = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1), torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    assert torch.allclose(z, (raw - mean) / std, atol=1e-5)
    assert torch.allclose(m.decode(z, 32, 32), expected, atol=1e-5)


def test_wan_lora_targets_exist(tiny_wan_path, tiny_wan22_path):
    """Flow-Factory's Wan targets (attn1/attn2 projections, ffn.net.0.proj, ffn.net.2) name real modules; with two
    experts LoRA reaches both."""
    for path in (tiny_wan_path, tiny_wan22_path):
        assert_lora_targets_exist(load_flow_model(path))
    m = load_flow_model(tiny_wan22_path)
    names = [n for n, _ in m.transformer.named_modules()]
    assert any(n.startswith("high.") and n.endswith("attn1.to_q") for n in names)
    assert any(n.startswith("low.") and n.endswith("attn1.to_q") for n in names)
    assert FlowModel.lora_target_modules != WanModel.lora_target_modules
