"""Tiny SD3 pretraining on synthetic shapes, and the shipped asset it produced."""

import json
from pathlib import Path

import pytest
import torch

from mmrl.diffusion.pretrain_tiny import EVAL_PROMPTS, _lr_factor, make_shape_pool, pretrain_tiny_sd3, sample_images
from mmrl.pipelines.shapes import COLORS, color_fraction, parse_caption

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny_sd3_shapes"


def _load(path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_shape_pool_matches_captions():
    x, caps = make_shape_pool(6, seed=3, size=32)
    assert x.shape == (6, 3, 32, 32) and x.min() >= -1 and x.max() <= 1
    assert make_shape_pool(6, seed=3, size=32)[1] == caps
    for img, cap in zip(x, caps):
        bg = parse_caption(cap)["background"]
        # corner pixel is the caption's background colour (shapes stay off the corners' first pixel)
        assert torch.allclose((img[:, 0, 0] + 1) * 127.5, torch.tensor(COLORS[bg], dtype=torch.float32), atol=1e-3)


def test_lr_schedule_warmup_then_cosine_to_ten_percent():
    assert _lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert _lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert _lr_factor(10, 100, 10) == pytest.approx(1.0)
    assert _lr_factor(100, 100, 10) == pytest.approx(0.1)


def test_short_pretraining_runs_end_to_end_and_saves_a_loadable_pipeline(tmp_path):
    torch.manual_seed(123)
    summary = pretrain_tiny_sd3(tmp_path / "p", steps=3, vae_steps=3, pool_size=32, batch_size=4,
                                vae_batch_size=2, max_sequence_lengths=(16,), progress=False)
    out = Path(summary["path"])
    saved = json.loads((out / "pretraining.json").read_text())
    assert "_name_or_path" not in json.loads((out / "model_index.json").read_text())
    assert saved["steps"] == 3 and saved["vae_steps"] == 3
    for key in ("vae/l1", "transformer/loss", "vae/shift_factor", "vae/scaling_factor"):
        assert torch.isfinite(torch.tensor(saved[key])), key
    pipe = _load(out)
    # latent normalisation measured on the data is stored in the VAE config the pipeline decodes with
    assert pipe.vae.config.scaling_factor == pytest.approx(saved["vae/scaling_factor"])
    assert pipe.vae.config.shift_factor == pytest.approx(saved["vae/shift_factor"])
    img = pipe("a red circle on a blue background", num_inference_steps=2, height=64, width=64,
               guidance_scale=1.0, max_sequence_length=16, output_type="pt").images
    assert img.shape == (1, 3, 64, 64) and torch.isfinite(img).all()
    # same seed -> same weights (all randomness comes from the seeded generators)
    again = pretrain_tiny_sd3(tmp_path / "q", steps=3, vae_steps=3, pool_size=32, batch_size=4,
                              vae_batch_size=2, max_sequence_lengths=(16,), progress=False)
    assert again["transformer/loss"] == summary["transformer/loss"] and again["vae/l1"] == summary["vae/l1"]
    a, b = pipe.transformer.state_dict(), _load(again["path"]).transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_shipped_asset_is_small_and_loads_offline():
    assert (ASSET / "model_index.json").is_file(), f"missing shipped asset {ASSET}"
    total = sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file())
    assert total < 5 * 2**20, f"assets/tiny_sd3_shapes is {total / 2**20:.1f} MB (limit 5 MB)"
    pipe = _load(ASSET)
    img = pipe(EVAL_PROMPTS[0], num_inference_steps=8, height=64, width=64, guidance_scale=1.0,
               generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert img.shape == (1, 3, 64, 64) and 0 <= img.min() and img.max() <= 1


def test_shipped_asset_follows_the_prompted_background_colour():
    """The point of the pretraining: the prompt's background colour covers most of the image, and the
    other prompt's background colour almost none of it (measured: 0.94 vs 0.01 over seeds 0-3)."""
    pipe = _load(ASSET)
    prompts = ["a red circle on a blue background", "a black triangle on a red background"]
    imgs = sample_images(pipe, prompts, seeds=range(4), num_inference_steps=8).view(2, 4, 3, 64, 64)
    blue = [color_fraction(imgs[i], "blue", tol=0.3).mean().item() for i in range(2)]
    red = [color_fraction(imgs[i], "red", tol=0.3).mean().item() for i in range(2)]
    assert blue[0] > 0.7 and red[1] > 0.7
    assert blue[1] < 0.1 and red[0] < 0.15


def test_refuses_to_overwrite_a_directory_that_is_not_a_pipeline(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="model_index.json"):
        pretrain_tiny_sd3(tmp_path, steps=1, vae_steps=0, pool_size=4, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
