"""Qwen-Image (`QwenImagePipeline`): a tiny real pipeline directory loaded by `load_flow_model`, rollouts equal to
diffusers' pipeline for equal noise (with and without true CFG), Flow-GRPO log-probs, LoRA targets, text padding.

This file is the one to copy for a new text-to-image family (docs/adding-a-family.md)."""

import json

import torch

from mmrl.diffusion.models import MODEL_FAMILIES, PromptEmbeds, load_flow_model
from mmrl.diffusion.models.qwen_image import QwenImageModel
from mmrl.diffusion.sampling import sample_groups

from mmrl.diffusion.family_checks import assert_lora_targets_exist, assert_sde_log_probs_follow_flow_grpo, packed

CLASS = "QwenImagePipeline"
PROMPTS = ["a red circle on a blue background", "a green square"]


def _model(tiny_family):
    return load_flow_model(tiny_family(CLASS))


def test_loads_from_a_pipeline_directory_through_the_registry(tiny_family):
    path = tiny_family(CLASS)
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == CLASS and index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    m = load_flow_model(path)
    assert MODEL_FAMILIES[CLASS] is QwenImageModel and type(m) is QwenImageModel and not m.needs_source_image
    assert m.vae_scale_factor == 8 and m.initial_noise(3, 64, 64).shape == (3, 16, 8, 8)
    assert_lora_targets_exist(m)


def test_ode_rollout_equals_the_diffusers_pipeline(tiny_family):
    """Equal initial noise -> the pipeline's final latents (packed), with true CFG (negative "", rescaled) and
    without; decoded images equal the pipeline's output too."""
    m = _model(tiny_family)
    emb = m.encode_prompts(PROMPTS)
    for scale in (1.0, 4.0):
        traj = sample_groups(m, emb, 2, num_steps=3, height=64, width=64, guidance_scale=scale, noise_level=0.0,
                             generator=torch.Generator().manual_seed(0))
        cfg = {"negative_prompt": [""] * 4, "true_cfg_scale": scale} if scale > 1 else {"true_cfg_scale": 1.0}
        call = dict(prompt=[p for p in PROMPTS for _ in range(2)], latents=packed(m, traj.latents[:, 0]),
                    num_inference_steps=3, height=64, width=64, **cfg)
        ref = m.pipe(output_type="latent", **call).images
        diff = (packed(m, traj.latents[:, -1]) - ref).abs().max().item()
        assert diff < 1e-4, (scale, diff)
        images = m.pipe(output_type="pt", **call).images
        assert (traj.images - images).abs().max() < 1e-4


def test_cfg_is_the_pipelines_rescaled_true_cfg(tiny_family):
    """combine_cfg = diffusers' comb * ||cond|| / ||comb|| over each packed token (computed here on packed tensors)."""
    m = _model(tiny_family)
    g = torch.Generator().manual_seed(1)
    v_u, v_c = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    comb = packed(m, v_u) + 4.0 * (packed(m, v_c) - packed(m, v_u))
    ref = comb * (packed(m, v_c).norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
    assert torch.allclose(packed(m, m.combine_cfg(v_u, v_c, 4.0)), ref, atol=1e-5)


def test_sde_log_probs_follow_the_flow_grpo_formula(tiny_family):
    m = _model(tiny_family)
    assert_sde_log_probs_follow_flow_grpo(m, m.encode_prompts(PROMPTS), guidance_scale=4.0)


def test_prompts_of_different_lengths_pad_with_their_mask(tiny_family):
    """Rows encoded one at a time (the prompt cache) stack with zero padding and mask 0; the velocity of a padded
    row equals the unpadded one (the transformer masks the padding)."""
    m = _model(tiny_family)
    long, short = m.encode_prompts([PROMPTS[0]]), m.encode_prompts([PROMPTS[1]])
    assert long["prompt_embeds"].shape[1] > short["prompt_embeds"].shape[1]
    both = PromptEmbeds.cat([long, short])
    n = long["prompt_embeds"].shape[1]
    assert both["prompt_embeds"].shape[1] == n and both["prompt_embeds_mask"][1].sum() == short["prompt_embeds"].shape[1]
    assert torch.all(both["prompt_embeds"][1, short["prompt_embeds"].shape[1]:] == 0)
    x = m.initial_noise(2, 64, 64, torch.Generator().manual_seed(0))
    with torch.no_grad():
        v_both = m.velocity(x, 0.6, both)
        v_short = m.velocity(x[1:], 0.6, short)
    assert torch.allclose(v_both[1:], v_short, atol=1e-5)


def test_template_tokens_are_dropped_exactly(tiny_family):
    """The pipeline drops the first 34 tokens (the template's system turn): the tiny tokenizer makes exactly 34 of
    it, so no template token reaches the prompt embeddings (a plain tiny BPE gives 58)."""
    m = _model(tiny_family)
    prefix = m.pipe.prompt_template_encode.split("{}")[0]
    assert len(m.pipe.tokenizer(prefix).input_ids) == m.pipe.prompt_template_encode_start_idx == 34


def test_unused_parameters_are_the_last_blocks_text_stream(tiny_family):
    """One backward through the velocity: the parameters without a gradient are exactly parameters of the last
    block's text stream (its output is discarded), so the family must set `has_unused_parameters` (DDP then looks for
    them); every other parameter gets a gradient."""
    m = _model(tiny_family)
    assert m.has_unused_parameters
    m.transformer.requires_grad_(True)  # loaded frozen (the recipes' LoRA / full fine-tuning set what trains)
    x = m.initial_noise(2, 64, 64, torch.Generator().manual_seed(0))
    m.velocity(x, 0.6, m.encode_prompts(PROMPTS)).square().sum().backward()
    unused = [n for n, p in m.transformer.named_parameters() if p.grad is None]
    last = f"transformer_blocks.{len(m.transformer.transformer_blocks) - 1}."
    assert unused and all(n.startswith(last) and ("txt_" in n or "add_" in n) for n in unused), unused
