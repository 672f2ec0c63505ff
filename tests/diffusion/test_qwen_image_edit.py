"""Qwen-Image-Edit (`QwenImageEditPipeline`) and Qwen-Image-Edit-2509/2511 (`QwenImageEditPlusPipeline`): tiny real
pipeline directories, rollouts equal to diffusers' pipelines for equal noise and source image (with true CFG, whose
negative keeps the source image), Flow-GRPO log-probs, the conditioning carried in PromptEmbeds, bad input.

Copy this file (or test_flux_kontext.py) for a new edit family (docs/adding-a-family.md)."""

import random

import pytest
import torch

from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo, packed
from mmrl.diffusion.models import PromptEmbeds, load_flow_model
from mmrl.diffusion.models.qwen_image_edit import QwenImageEditModel, QwenImageEditPlusModel
from mmrl.diffusion.sampling import sample_groups
from mmrl.pipelines.edits import shapes_edit_example
from mmrl.pipelines.images import to_tensor01

FAMILIES = [("QwenImageEditPipeline", QwenImageEditModel), ("QwenImageEditPlusPipeline", QwenImageEditPlusModel)]


def _sources(n, size=64, seed=0):
    rng = random.Random(seed)
    examples = [shapes_edit_example(rng, size) for _ in range(n)]
    return [e["instruction"] for e in examples], to_tensor01([e["source"] for e in examples]), examples


@pytest.mark.parametrize("class_name, cls", FAMILIES)
def test_loads_and_encodes_the_source_image_into_the_conditioning(class_name, cls, tiny_family):
    m = load_flow_model(tiny_family(class_name))
    assert type(m) is cls and m.needs_source_image and m.transformer.config.zero_cond_t == (cls is QwenImageEditPlusModel)
    assert_lora_targets_exist(m)
    prompts, images, _ = _sources(2)
    emb = m.encode_prompts(prompts, images=images)
    assert set(emb) == {"prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask",
                        "image_latents"}
    assert emb["image_latents"].shape == (2, 16, 8, 8) and len(emb) == 2
    assert torch.allclose(emb["image_latents"], m.encode_images(images))
    # the text encoder saw the image: another source changes the instruction's embedding
    other = m.encode_prompts(prompts[:1], images=images[1:])
    assert not torch.allclose(other["prompt_embeds"][0, :8], emb["prompt_embeds"][0, :8])
    # rows select / repeat with their image; the CFG negative keeps each row's source latents
    sel = emb.select([1, 1, 0])
    assert torch.equal(sel["image_latents"][2], emb["image_latents"][0])
    neg = m.negative_rows(sel)
    assert torch.equal(neg["image_latents"], sel["image_latents"])
    assert torch.equal(neg["prompt_embeds"], sel["negative_prompt_embeds"])


@pytest.mark.slow
@pytest.mark.parametrize("class_name, cls", FAMILIES)
def test_ode_rollout_equals_the_diffusers_pipeline(class_name, cls, tiny_family):
    """The pipeline always conditions on a ~1024^2 copy of the source: a 1024x1024 source (no resize) is given to
    both; equal initial noise, true CFG with the empty negative prompt -> equal final latents."""
    m = load_flow_model(tiny_family(class_name))
    prompts, images, examples = _sources(1, size=1024)
    emb = m.encode_prompts(prompts, images=images)
    assert emb["image_latents"].shape == (1, 16, 128, 128)
    traj = sample_groups(m, emb, 2, num_steps=2, height=64, width=64, guidance_scale=4.0, noise_level=0.0,
                         generator=torch.Generator().manual_seed(0))
    ref = m.pipe(image=examples[0]["source"], prompt=prompts[0], negative_prompt="", true_cfg_scale=4.0,
                 num_images_per_prompt=2, latents=packed(m, traj.latents[:, 0]), num_inference_steps=2, height=64,
                 width=64, output_type="latent").images
    diff = (packed(m, traj.latents[:, -1]) - ref).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("class_name, cls", FAMILIES)
def test_sde_log_probs_follow_the_flow_grpo_formula(class_name, cls, tiny_family):
    m = load_flow_model(tiny_family(class_name))
    prompts, images, _ = _sources(2)
    assert_sde_log_probs_follow_flow_grpo(m, m.encode_prompts(prompts, images=images), guidance_scale=4.0)


def test_bad_source_input_is_one_clear_error(tiny_family):
    m = load_flow_model(tiny_family("QwenImageEditPipeline"))
    prompts, images, _ = _sources(2)
    with pytest.raises(ValueError, match="edits a source image: encode_prompts needs images"):
        m.encode_prompts(prompts)
    with pytest.raises(ValueError, match="2 prompts but 1 source images"):
        m.encode_prompts(prompts, images=images[:1])
    # rows of different source sizes cannot share a batch
    small = m.encode_prompts(prompts[:1], images=torch.nn.functional.interpolate(images[:1], size=(32, 32)))
    with pytest.raises(ValueError, match="'image_latents' has different shapes .* source images of one batch must share"):
        PromptEmbeds.cat([small, m.encode_prompts(prompts[1:], images=images[1:])])
