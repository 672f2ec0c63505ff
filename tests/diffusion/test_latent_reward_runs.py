"""Recipes with a latent reward (mmrl.rewards.latent): the rollout skips the VAE decode when every reward component
scores latents and decodes when one needs pixels; evaluations still decode what they show; another family's latent
reward is refused before any model loads."""

import pytest

from mmrl.diffusion.flow_grpo import train
from mmrl.diffusion.models.sd3 import SD3Model
from mmrl.testing import metrics_rows

from .test_flow_grpo import EVAL_PROMPTS, _cfg


@pytest.fixture(scope="module")
def dina_path(tmp_path_factory):
    from mmrl.tiny.latent_rewards import build_tiny_dina_lrm

    return build_tiny_dina_lrm(tmp_path_factory.mktemp("dina") / "lrm")


@pytest.fixture
def decoded_rows(monkeypatch):
    """Rows passed to the tiny SD3's VAE decode, one entry per call."""
    rows, decode = [], SD3Model.decode

    def counted(self, latents, height, width):
        rows.append(len(latents))
        return decode(self, latents, height, width)

    monkeypatch.setattr(SD3Model, "decode", counted)
    return rows


def _run(out, model, components):
    # 1 step: 2 prompts x 3 samples rolled out; evaluation after step 1 on 2 held-out prompts (ODE, decoded: shown)
    train(_cfg(out, model, ["train.max_steps=1"], reward={"components": components},
               data={"eval_prompts": EVAL_PROMPTS}, log={"eval_every": 1, "eval_max_prompts": 2}))
    return metrics_rows(out)


def test_flow_grpo_with_dina_lrm_skips_the_decode(tmp_path, tiny_sd3_path, dina_path, decoded_rows):
    """dina_lrm alone: the 6 rollout samples are never decoded (only the 2 evaluation images are), the reward and its
    evaluation are logged; with a pixel component beside it the rollout decodes its 6 samples as before."""
    dina = {"reward": "dina_lrm", "weights": str(dina_path), "weight": 1.0}
    rows = _run(tmp_path / "latent", tiny_sd3_path, {"dina_lrm": dina})
    assert decoded_rows == [2]
    row = rows[-1]
    for key in ("reward/mean", "reward/dina_lrm", "eval/reward/mean", "eval/reward/dina_lrm", "policy/loss"):
        assert key in row, key
    assert "diag/sample/brightness" not in row and "diag/sample/latent_rms" in row  # no rollout pixels
    decoded_rows.clear()
    rows = _run(tmp_path / "mixed", tiny_sd3_path, {"dina_lrm": dina, "jpeg_compressibility": 0.1})
    assert decoded_rows == [6, 2]
    assert "reward/dina_lrm" in rows[-1] and "reward/jpeg_compressibility" in rows[-1]


def test_latent_reward_of_another_family_is_refused_before_loading(tmp_path, tiny_flux_path, dina_path):
    with pytest.raises(ValueError, match=r"^reward\.components\.dina_lrm: reward 'dina_lrm' scores sd3 latents with 4 "
                                         r"channels, but model\.path '.*' makes flux latents with 4 channels; "):
        train(_cfg(tmp_path / "run", tiny_flux_path, ["train.max_steps=1"],
                   reward={"components": {"dina_lrm": {"weights": str(dina_path)}}}))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_mmrl_eval_scores_a_latent_reward_from_the_final_latents(tmp_path, tiny_sd3_path, dina_path, decoded_rows):
    """`mmrl eval` saves decoded images (shown) and scores a latent reward from each sample's final latents: the
    report's scores are dina_lrm's on the latents sampled with the same seeds."""
    import json

    import torch
    import yaml

    from mmrl.cli import main
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.pipelines.data import load_prompts
    from mmrl.rewards import load

    dina = {"reward": "dina_lrm", "weights": str(dina_path), "weight": 1.0}
    cfg = {"algorithm": "flow_grpo", "output_dir": str(tmp_path / "run"), "seed": 3, "model": {"path": str(tiny_sd3_path)},
           "data": {"train_prompts": EVAL_PROMPTS, "eval_prompts": EVAL_PROMPTS},
           "rollout": {"height": 64, "width": 64, "eval_num_steps": 2, "eval_guidance_scale": 1.0},
           "reward": {"components": {"dina_lrm": dina}}}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["eval", str(path), "--out", str(tmp_path / "out"), "--max-prompts", "2",
                 "--samples-per-prompt", "1"]) == 0
    assert sum(decoded_rows) == 2  # the two saved images
    report = json.loads((tmp_path / "out" / "eval_report.json").read_text())
    got = [v for row in report["per_prompt"] for v in row["components"]["dina_lrm"]]
    model, items = load_flow_model(tiny_sd3_path), load_prompts(EVAL_PROMPTS)[:2]
    finals = [sample_groups(model, model.encode_prompts([it.prompt]), 1, num_steps=2, height=64, width=64,
                            noise_level=0.0, generator=torch.Generator().manual_seed(3 * 1000003 + i)).latents[:, -1]
              for i, it in enumerate(items)]
    want = load({"dina_lrm": dina})(latents=torch.cat(finals), prompts=[it.prompt for it in items]).scores
    assert got == pytest.approx(want.tolist(), abs=1e-5)
