"""Z-Image (`ZImagePipeline`) against diffusers' own pipeline: a tiny real-architecture checkpoint (Qwen3 text
encoder, ZImageTransformer2DModel, AutoencoderKL) saved in the diffusers layout and loaded back."""

import json

import pytest
import torch

from mmrl.diffusion.common import TransformerEvalCounter
from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo
from mmrl.diffusion.models import load_flow_model
from mmrl.diffusion.models.z_image import ZImageModel
from mmrl.diffusion.sampling import sample_groups

P = ["a red circle on a blue background", "a green square"]
SEQ = 32


@pytest.mark.parametrize("guidance_scale", [4.0, 0.0])
def test_z_image_ode_rollout_equals_diffusers_pipeline(tiny_z_image_path, guidance_scale):
    """With Z-Image's CFG (pos + s (pos - neg), on for s > 0) and without it (s = 0, Turbo's setting): latents and
    decoded images equal ZImagePipeline's for the same initial noise."""
    assert json.loads((tiny_z_image_path / "model_index.json").read_text())["_class_name"] == "ZImagePipeline"
    m = load_flow_model(tiny_z_image_path, max_sequence_length=SEQ)
    assert isinstance(m, ZImageModel) and m.cfg_enabled(guidance_scale) == (guidance_scale > 0)
    traj = sample_groups(m, m.encode_prompts(P), 2, num_steps=4, height=64, width=64, guidance_scale=guidance_scale,
                         noise_level=0.0, generator=torch.Generator().manual_seed(0))
    def pipe(output_type):  # a fresh prompt list per call: the pipeline writes the chat template into it
        return m.pipe(prompt=[P[0]] * 2 + [P[1]] * 2, latents=traj.latents[:, 0].clone(), num_inference_steps=4,
                      guidance_scale=guidance_scale, height=64, width=64, max_sequence_length=SEQ,
                      output_type=output_type).images

    ref = pipe("latent")
    assert traj.latents.shape[2:] == (16, 16, 16)
    assert torch.allclose(traj.latents[:, -1], ref, atol=1e-5), (traj.latents[:, -1] - ref).abs().max()
    assert torch.allclose(traj.images, pipe("pt"), atol=1e-5)


def test_z_image_timestep_convention_and_negated_output(tiny_z_image_path):
    """The transformer sees t = 1 - sigma (0 at pure noise), per-sample [C, 1, h, w] latents and unpadded caption
    embeddings; the family's velocity is the negated output."""
    m = load_flow_model(tiny_z_image_path, max_sequence_length=SEQ)
    emb = m.encode_prompts(P)
    assert emb["prompt_embeds"].shape[:2] == emb["prompt_mask"].shape == (2, SEQ)
    seen = {}

    def grab(module, args, kwargs):
        seen["x"], seen["t"], seen["caps"] = args[0], args[1], args[2]

    handle = m.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    x = torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = m.velocity(x, torch.tensor([1.0, 0.25]), emb, guidance_scale=0.0)
        out = m.transformer(list(x.unsqueeze(2).unbind(0)), torch.tensor([0.0, 0.75]),
                            [emb["prompt_embeds"][i][emb["prompt_mask"][i]] for i in range(2)], return_dict=False)[0]
    handle.remove()
    assert torch.equal(seen["t"], torch.tensor([0.0, 0.75]))
    assert [c.shape[0] for c in seen["caps"]] == emb["prompt_mask"].sum(1).tolist()
    assert seen["x"][0].shape == (16, 1, 16, 16)
    assert torch.allclose(v, -torch.stack(out).squeeze(2).float(), atol=1e-6)


def test_z_image_sde_log_probs_follow_flow_grpo(tiny_z_image_path):
    m = load_flow_model(tiny_z_image_path, max_sequence_length=SEQ)
    assert_sde_log_probs_follow_flow_grpo(m, m.encode_prompts(P), guidance_scale=4.0)


def test_transformer_eval_counter_counts_list_inputs(tiny_z_image_path):
    """Z-Image's transformer takes a list of latents: each list entry is one evaluation (a CFG batch two)."""
    m = load_flow_model(tiny_z_image_path, max_sequence_length=SEQ)
    counter = TransformerEvalCounter(m.transformer)
    with torch.no_grad():
        m.velocity(torch.randn(3, 16, 16, 16), 0.5, m.encode_prompts(["a", "b", "c"]), guidance_scale=4.0)
    counter.remove()
    assert counter.count == 6


def test_z_image_lora_targets_exist(tiny_z_image_path):
    """Flow-Factory's Z-Image targets: attention.{to_q,to_k,to_v,to_out.0}, feed_forward.{w1,w2,w3}."""
    assert_lora_targets_exist(load_flow_model(tiny_z_image_path))
