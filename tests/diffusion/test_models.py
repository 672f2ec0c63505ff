"""Model wrappers against the diffusers pipelines they wrap (tiny SD3 / FLUX saved in diffusers format)."""

import json
import sys

import pytest
import torch

from mmrl.diffusion.models import (
    MODEL_FAMILIES, FluxModel, PromptEmbeds, SD3Model, available_families, load_flow_model, register_family,
)
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


def test_unknown_pipeline_class_names_the_valid_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline"}))
    with pytest.raises(ValueError) as err:
        load_flow_model(tmp_path)
    assert "'HunyuanVideoPipeline' is not supported" in str(err.value)
    assert f"supported: {available_families()}" in str(err.value)
    assert available_families() == sorted(MODEL_FAMILIES)
    assert {"FluxPipeline", "StableDiffusion3Pipeline", "WanPipeline", "ZImagePipeline", "Flux2Pipeline",
            "Flux2KleinPipeline", "QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline",
            "FluxKontextPipeline"} <= set(available_families())


@pytest.mark.parametrize("class_name, fixture, family", [("StableDiffusion3Pipeline", "tiny_sd3_path", SD3Model),
                                                         ("FluxPipeline", "tiny_flux_path", FluxModel)])
def test_each_family_loads_through_the_registry(class_name, fixture, family, request):
    path = request.getfixturevalue(fixture)
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == class_name
    assert MODEL_FAMILIES[class_name] is family and family.__module__ == f"mmrl.diffusion.models.{family.family}"
    m = load_flow_model(path)
    assert type(m) is family and m.max_sequence_length == family.default_max_sequence_length
    assert type(m.pipe).__name__ == class_name


def test_registered_family_is_what_load_builds(tiny_sd3_path, monkeypatch):
    """register_family decides the class load_flow_model builds; re-registering a name to another class fails."""
    with pytest.raises(ValueError, match="'StableDiffusion3Pipeline' is already registered to .*sd3.SD3Model"):
        register_family("StableDiffusion3Pipeline")(type("Other", (SD3Model,), {}))
    with pytest.raises(TypeError, match="not a FlowModel subclass"):
        register_family("SomePipeline")(dict)
    monkeypatch.delitem(MODEL_FAMILIES, "StableDiffusion3Pipeline")

    @register_family("StableDiffusion3Pipeline")
    class ShortTextSD3(SD3Model):
        default_max_sequence_length = 32

    m = load_flow_model(tiny_sd3_path)
    assert type(m) is ShortTextSD3 and m.max_sequence_length == 32


def test_a_new_family_file_registers_itself(tmp_path, monkeypatch):
    """Adding a family = one new module in the package: the package imports it and it registers itself."""
    import mmrl.diffusion.models as models

    (tmp_path / "sana_example.py").write_text(
        "from mmrl.diffusion.models.base import FlowModel, register_family\n\n\n"
        "@register_family('SanaPipeline')\n"
        "class SanaModel(FlowModel):\n"
        "    family = 'sana'\n")
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    assert "SanaPipeline" not in MODEL_FAMILIES
    try:
        assert "sana_example" in models.import_family_modules()
        assert MODEL_FAMILIES["SanaPipeline"].family == "sana"
        assert "SanaPipeline" in available_families()
    finally:
        MODEL_FAMILIES.pop("SanaPipeline", None)
        sys.modules.pop("mmrl.diffusion.models.sana_example", None)


def test_family_files_import_only_public_names():
    """A family file needs nothing private from another module (what a new family may use is public: FlowModel's
    methods, register_family, PromptEmbeds, mmrl.perf's registries)."""
    import ast
    from pathlib import Path

    import mmrl.diffusion.models as models

    private = []
    for path in sorted(Path(models.__path__[0]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmrl"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


def test_a_text_family_refuses_source_images_in_one_line(tiny_sd3):
    with pytest.raises(ValueError, match=r"^StableDiffusion3Pipeline generates from text only: it takes no source "
                                         r"images \(edit pipelines: \['FluxKontextPipeline', 'QwenImageEditPipeline'"):
        tiny_sd3.encode_prompts(["a red circle"], images=torch.zeros(1, 3, 64, 64))


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
