"""Latent rewards (mmrl.rewards.latent): DiNa-LRM on its tiny checkpoint in the authors' layout, the protocol's
checks, composites of latent and pixel rewards, and the config-load check of the latent space."""

import json
import shutil

import pytest
import torch

from mmrl.rewards import load
from mmrl.rewards.latent import LatentSpace, check_latent_rewards, needs_pixels, takes_latents

PROMPTS = ["a red circle", "a blue square", "a red circle", "two yellow stars"]


@pytest.fixture(scope="module")
def dina_path(tmp_path_factory):
    from mmrl.tiny.latent_rewards import build_tiny_dina_lrm

    return build_tiny_dina_lrm(tmp_path_factory.mktemp("dina") / "lrm")


@pytest.fixture(scope="module")
def dina(dina_path):
    return load("dina_lrm", weights=str(dina_path), device="cpu")


def _latents(n=4, seed=0, hw=(16, 16)):
    return torch.randn(n, 4, *hw, generator=torch.Generator().manual_seed(seed))


def test_dina_lrm_scores_batched_as_one_by_one(dina):
    """Scores of a batch equal the scores of each latent alone (the noise is one seeded draw, not per batch row),
    depend on the prompt, and normalize = (raw + 10) / 10 with the raw score in details."""
    assert dina.kind == "latent" and dina.latent_space == LatentSpace("sd3", 4)
    x = _latents()
    out = dina(latents=x, prompts=PROMPTS)
    assert out.scores.shape == (4,) and torch.isfinite(out.scores).all()
    torch.testing.assert_close(out.scores, (out.details["raw"] + 10) / 10)
    one = torch.cat([dina(latents=x[i:i + 1], prompts=PROMPTS[i:i + 1]).scores for i in range(4)])
    torch.testing.assert_close(out.scores, one, atol=1e-5, rtol=0)
    other = dina(latents=x, prompts=["two yellow stars"] * 4).scores
    assert not torch.allclose(other, out.scores)


def test_dina_lrm_input_errors(dina):
    x = _latents()
    with pytest.raises(ValueError, match=r"^reward 'dina_lrm' scores sd3 latents with 4 channels \[B, C, h, w\], "
                                         r"not images: pass latents=\.\.\."):
        dina(images=torch.rand(4, 3, 64, 64), prompts=PROMPTS)
    with pytest.raises(ValueError, match=r"^reward 'dina_lrm' scores sd3 latents with 4 channels \[B, 4, h, w\], "
                                         r"got latents of shape \(4, 16, 16, 16\)$"):
        dina(latents=torch.randn(4, 16, 16, 16), prompts=PROMPTS)
    with pytest.raises(ValueError, match=r"^reward 'dina_lrm' needs prompts \(one per latent\)$"):
        dina(latents=x)
    with pytest.raises(ValueError, match=r"^reward 'dina_lrm': got 4 inputs but 2 prompts"):
        dina(latents=x, prompts=PROMPTS[:2])


def test_dina_lrm_checkpoint_errors(dina_path, tmp_path):
    """A missing file of the layout config.json asks for, or no local base, is one line naming it."""
    broken = tmp_path / "lrm"
    shutil.copytree(dina_path / "checkpoint", broken / "checkpoint")
    cfg = json.loads((dina_path / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(cfg))
    (broken / "checkpoint" / "rm_head.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"rm_head\.pt' not found; config\.json asks for the LoRA: "
                                                r"checkpoint/backbone_lora/ \+ checkpoint/rm_head\.pt layout$"):
        load("dina_lrm", weights=str(broken), device="cpu")
    cfg["model"]["backbone_model_id"] = "stabilityai/stable-diffusion-3.5-medium"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match=r"no base= given and the checkpoint's backbone_model_id "
                                                r"'stabilityai/stable-diffusion-3.5-medium' is not a local directory"):
        load("dina_lrm", weights=str(broken), device="cpu")
    with pytest.raises(FileNotFoundError, match=r"config\.json' not found; weights= must be a DiNa-LRM directory"):
        load("dina_lrm", weights=str(tmp_path), device="cpu")


def test_composite_of_latent_and_pixel_rewards(dina_path):
    """Only latent components: the composite is itself a latent reward (no pixels needed); mixed with a pixel reward
    it needs pixels and hands each component its own input."""
    spec = {"reward": "dina_lrm", "weights": str(dina_path), "weight": 1.0}
    only = load({"dina_lrm": spec})
    assert only.kind == "latent" and takes_latents(only) and not needs_pixels(only)
    mixed = load({"dina_lrm": {**spec, "weight": 2.0}, "jpeg_compressibility": 0.5})
    assert mixed.kind == "image" and takes_latents(mixed) and needs_pixels(mixed)
    x, images = _latents(), torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    out = mixed(images=images, latents=x, prompts=PROMPTS)
    alone = only(latents=x, prompts=PROMPTS)
    torch.testing.assert_close(out.details["dina_lrm"], alone.scores)
    torch.testing.assert_close(out.scores, 2.0 * alone.scores + 0.5 * out.details["jpeg_compressibility"])
    assert not takes_latents(load({"jpeg_compressibility": 1.0}))


def test_config_load_refuses_another_latent_space(dina_path, tmp_path):
    """A latent reward of another family, or another channel count, than model.path: one line at config load
    (config files only, no weights)."""
    from mmrl.diffusion.scoring import policy_latent_space

    comps = {"dina_lrm": {"weight": 1.0, "weights": str(dina_path)}}
    sd3 = dina_path / "base"
    check_latent_rewards(comps, lambda: policy_latent_space(sd3), sd3)  # same space: fine
    wide = tmp_path / "sd3_16ch"
    (wide / "vae").mkdir(parents=True)
    shutil.copy(sd3 / "model_index.json", wide / "model_index.json")
    vae = json.loads((sd3 / "vae" / "config.json").read_text())
    (wide / "vae" / "config.json").write_text(json.dumps({**vae, "latent_channels": 16}))
    with pytest.raises(ValueError, match=rf"^reward\.components\.dina_lrm: reward 'dina_lrm' scores sd3 latents with 4 "
                                         rf"channels, but model\.path '{wide}' makes sd3 latents with 16 channels; a "
                                         rf"latent reward scores only its own family's latents \(use a pixel reward, "
                                         rf"or a model of family sd3\)$"):
        check_latent_rewards(comps, lambda: policy_latent_space(wide), wide)
    flux = tmp_path / "flux"
    shutil.copytree(sd3, flux, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((flux / "model_index.json").read_text())
    (flux / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match=r"makes flux latents with 4 channels; a latent reward scores only"):
        check_latent_rewards(comps, lambda: policy_latent_space(flux), flux)


def test_reward_cli_refuses_a_latent_reward_in_one_line(dina_path, tmp_path, capsys):
    """`mmrl reward score|serve` take image files: a latent reward (by name, before loading, or inside a YAML
    composite, once loaded) is refused with one line saying where it can be used."""
    import argparse

    from PIL import Image

    from mmrl.rewards.cli import add_reward_subparsers

    Image.new("RGB", (16, 16)).save(tmp_path / "a.png")
    (tmp_path / "p.txt").write_text("a red circle\n")
    (tmp_path / "mix.yaml").write_text(json.dumps({"dina_lrm": {"weight": 1.0, "weights": str(dina_path)},
                                                   "jpeg_compressibility": 1.0}))
    msg = ("scores a diffusion model's latents, not images: `mmrl reward score|serve` take image files only; call it "
           "from Python (load(...)(latents=..., prompts=...)) or name it in a recipe's reward.components\n")
    for argv in (["score", "dina_lrm", "--weights", str(dina_path)], ["serve", "dina_lrm", "--port", "0"],
                 ["score", str(tmp_path / "mix.yaml")]):
        parser = argparse.ArgumentParser(prog="mmrl")
        add_reward_subparsers(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["reward", *argv, "--images", str(tmp_path / "a.png"), "--prompts",
                                  str(tmp_path / "p.txt")] if argv[0] == "score" else ["reward", *argv])
        with pytest.raises(SystemExit) as ei:
            args.func(args)
        err = capsys.readouterr().err
        last = err.splitlines()[-1]  # (a composite is refused once loaded: the loading bars come first)
        assert ei.value.code == 2 and "Traceback" not in err, err
        assert last.startswith("mmrl reward: error: reward '") and last.endswith(msg.strip()), last


@pytest.fixture(scope="module")
def lpo_path(tmp_path_factory):
    from mmrl.tiny.latent_rewards import build_tiny_lpo_lrm

    return build_tiny_lpo_lrm(tmp_path_factory.mktemp("lpo") / "lrm")


def test_lpo_lrm_scores_noisy_latents_at_their_timestep(lpo_path):
    """LPO's LRM-1.5 on its tiny checkpoint: SD1.5 latents, batched = one by one, the timestep (argument or per-sample
    metadata) changes the score, score = logit_scale.exp() * cosine; another family is refused at config load."""
    from mmrl.diffusion.scoring import policy_latent_space

    lrm = load("lpo_lrm", weights=str(lpo_path), base=str(lpo_path / "base"), device="cpu")
    assert lrm.kind == "latent" and lrm.latent_space == LatentSpace("sd15", 4)
    x = _latents(hw=(8, 8))
    meta = [{"timestep": t} for t in (0, 250, 999, 500)]
    out = lrm(latents=x, prompts=PROMPTS, metadata=meta)
    torch.testing.assert_close(out.scores, torch.tensor(2.6592).exp() * out.details["cosine"])
    assert out.details["timestep"].tolist() == [0, 250, 999, 500]
    lrm.batch_size = 1
    torch.testing.assert_close(lrm(latents=x, prompts=PROMPTS, metadata=meta).scores, out.scores, atol=1e-4, rtol=0)
    assert not torch.allclose(lrm(latents=x, prompts=PROMPTS).scores, out.scores)  # all at the default t = 0
    comps = {"lpo_lrm": {"weights": str(lpo_path), "base": str(lpo_path / "base")}}
    sd3 = _sd3_dir(lpo_path)
    with pytest.raises(ValueError, match=r"^reward\.components\.lpo_lrm: reward 'lpo_lrm' scores sd15 latents with 4 "
                                         r"channels, but model\.path '.*' makes sd3 latents with 4 channels; "):
        check_latent_rewards(comps, lambda: policy_latent_space(sd3), sd3)


def _sd3_dir(root):
    """A config-only SD3 pipeline directory (model_index.json + vae/config.json) next to `root`."""
    d = root.parent / "sd3_configs"
    (d / "vae").mkdir(parents=True, exist_ok=True)
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    (d / "vae" / "config.json").write_text(json.dumps({"latent_channels": 4}))
    return d


def test_dina_lrm_full_model_layout_scores_as_the_lora_layout(dina, dina_path, tmp_path):
    """The authors' other layout: `checkpoint/full_model.pt` (backbone + head state dict, no LoRA: use_lora false,
    freeze_backbone false) holding the merged weights scores as the LoRA layout does."""
    full = tmp_path / "full"
    (full / "checkpoint").mkdir(parents=True)
    cfg = json.loads((dina_path / "config.json").read_text())
    cfg["model"]["use_lora"] = False
    (full / "config.json").write_text(json.dumps(cfg))
    torch.save(dina.model.state_dict(), full / "checkpoint" / "full_model.pt")
    other = load("dina_lrm", weights=str(full), device="cpu")
    x = _latents()
    torch.testing.assert_close(other(latents=x, prompts=PROMPTS).scores, dina(latents=x, prompts=PROMPTS).scores)
    state = dict(dina.model.state_dict())
    state.pop("reward_head.head.bias")
    torch.save(state, full / "checkpoint" / "full_model.pt")
    with pytest.raises(ValueError, match=r"full_model\.pt' does not fit the model: 1 missing keys "
                                         r"\(e\.g\. \['reward_head\.head\.bias'\]\)"):
        load("dina_lrm", weights=str(full), device="cpu")
