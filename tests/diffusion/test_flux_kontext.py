"""FLUX.1 Kontext (`FluxKontextPipeline`): a tiny real pipeline directory, rollouts equal to diffusers' pipeline for
equal noise and source image (guidance embedding), Flow-GRPO log-probs, the source latents in PromptEmbeds."""

import random

import pytest
import torch

from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo, packed
from mmrl.diffusion.models import load_flow_model
from mmrl.diffusion.models.flux_kontext import FluxKontextModel
from mmrl.diffusion.sampling import sample_groups
from mmrl.pipelines.edits import shapes_edit_example
from mmrl.pipelines.images import to_tensor01

CLASS = "FluxKontextPipeline"


def _sources(n, seed=0):
    rng = random.Random(seed)
    examples = [shapes_edit_example(rng, 64) for _ in range(n)]
    return [e["instruction"] for e in examples], to_tensor01([e["source"] for e in examples]), examples


def test_loads_and_carries_the_source_latents(tiny_family):
    m = load_flow_model(tiny_family(CLASS))
    assert type(m) is FluxKontextModel and m.needs_source_image and m.has_guidance_embedding
    assert_lora_targets_exist(m)
    prompts, images, _ = _sources(2)
    emb = m.encode_prompts(prompts, images=images)
    assert set(emb) == {"prompt_embeds", "pooled_prompt_embeds", "image_latents"}
    assert torch.allclose(emb["image_latents"], m.encode_images(images)) and emb["image_latents"].shape == (2, 4, 16, 16)
    neg = m.negative_rows(emb.select([1, 0]))
    assert torch.equal(neg["image_latents"], emb["image_latents"][[1, 0]])
    assert torch.equal(neg["prompt_embeds"][0], m.negative_embeds(1)["prompt_embeds"][0])
    with pytest.raises(ValueError, match="edits a source image"):
        m.encode_prompts(prompts)


def test_ode_rollout_equals_the_diffusers_pipeline(tiny_family):
    """Equal initial noise and source image; `max_area` = the target size and `_auto_resize=False` keep the
    pipeline at 64x64 with the source at its own size (its defaults resize both to ~1024^2)."""
    m = load_flow_model(tiny_family(CLASS))
    prompts, images, examples = _sources(2)
    emb = m.encode_prompts(prompts, images=images)
    traj = sample_groups(m, emb, 2, num_steps=3, height=64, width=64, guidance_scale=2.5, noise_level=0.0,
                         generator=torch.Generator().manual_seed(0))
    for i in range(2):  # the pipeline takes one source image per call
        rows = slice(2 * i, 2 * i + 2)
        ref = m.pipe(image=examples[i]["source"], prompt=prompts[i], num_images_per_prompt=2,
                     latents=packed(m, traj.latents[rows, 0]), num_inference_steps=3, height=64, width=64,
                     guidance_scale=2.5, max_area=64 * 64, _auto_resize=False, max_sequence_length=512,
                     output_type="latent").images
        diff = (packed(m, traj.latents[rows, -1]) - ref).abs().max().item()
        assert diff < 1e-4, diff


def test_sde_log_probs_follow_the_flow_grpo_formula(tiny_family):
    m = load_flow_model(tiny_family(CLASS))
    prompts, images, _ = _sources(2)
    assert_sde_log_probs_follow_flow_grpo(m, m.encode_prompts(prompts, images=images), guidance_scale=2.5)
