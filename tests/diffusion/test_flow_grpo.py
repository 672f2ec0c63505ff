"""Flow-GRPO recipe: advantages, configs, clear errors, short runs, exact resume, checkpoints, LoRA export."""

import glob
import json
import os
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.diffusion.flow_grpo import Config, PerPromptStatTracker, train

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_eval.jsonl")


def _cfg(out, model_path, overrides=(), **sections) -> Config:
    d = {
        "algorithm": "flow_grpo", "output_dir": str(out), "seed": 3,
        "model": {"path": str(model_path), "lora_rank": 4, "lora_alpha": 8},
        "data": {"train_prompts": PROMPTS, "prompts_per_step": 2},
        "sample": {"height": 64, "width": 64, "num_steps": 3, "group_size": 3, "guidance_scale": 1.0,
                   "eval_num_steps": 2, "timestep_fraction": 0.99},
        "train": {"max_steps": 2, "save_every": 0, "micro_batch_size": 4, "updates_per_step": 2, "beta": 0.0,
                  "ema": False, "lr": 1e-3},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))


def _rows(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _no_time(row):
    return {k: v for k, v in row.items() if not k.startswith("time/")}


# ---------------------------------------------------------------------------------------- advantages


def test_stat_tracker_hand_values_and_state():
    tr = PerPromptStatTracker("group")
    # prompt a: rewards 1, 3 -> mean 2, population std 1 (+1e-4); prompt b: 5, 5 -> constant -> 0
    adv = tr.update(["a", "a", "b", "b"], torch.tensor([1.0, 3.0, 5.0, 5.0]))
    assert adv.tolist() == pytest.approx([-1 / 1.0001, 1 / 1.0001, 0.0, 0.0], abs=1e-6)
    assert tr.state_dict() == {"buffers": {}}  # history 0 keeps nothing (Flow-GRPO clears every epoch)
    # global std: std of all 4 rewards = sqrt(mean((r - 3.5)^2)) = sqrt((6.25 + 0.25 + 2.25 * 2) / 4)
    g = PerPromptStatTracker("global").update(["a", "a", "b", "b"], torch.tensor([1.0, 3.0, 5.0, 5.0]))
    std = (11.0 / 4) ** 0.5 + 1e-4
    assert g.tolist() == pytest.approx([-1 / std, 1 / std, 0.0, 0.0], abs=1e-6)
    # history: the second batch of "a" is normalised with the previous rewards too
    h = PerPromptStatTracker("group", history=4)
    h.update(["a", "a"], torch.tensor([0.0, 2.0]))
    state = h.state_dict()
    adv2 = h.update(["a", "a"], torch.tensor([4.0, 6.0]))  # stats of [0, 2, 4, 6]: mean 3, std sqrt(5)
    assert adv2.tolist() == pytest.approx([1 / (5**0.5 + 1e-4), 3 / (5**0.5 + 1e-4)], abs=1e-6)
    h2 = PerPromptStatTracker("group", history=4)
    h2.load_state_dict(state)
    assert torch.equal(h2.update(["a", "a"], torch.tensor([4.0, 6.0])), adv2)
    with pytest.raises(ValueError, match="std_mode"):
        PerPromptStatTracker("batch")


# ---------------------------------------------------------------------------------------- configs, errors


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "configs" / "diffusion" / "flow_grpo_*.yaml"))))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.algorithm == "flow_grpo" and cfg.sample.group_size >= 2


def test_published_hyperparameters():
    cfg = load_config(REPO / "configs" / "diffusion" / "flow_grpo_sd35_pickscore.yaml")
    s, t = cfg.sample, cfg.train
    assert (s.height, s.num_steps, s.group_size, s.noise_level, s.guidance_scale) == (512, 10, 24, 0.7, 4.5)
    assert (t.lr, t.clip_range, t.beta, cfg.model.lora_rank, cfg.model.lora_alpha) == (3e-4, 1e-4, 0.01, 32, 64)
    assert s.timestep_fraction == 0.99 and cfg.reward.std_mode == "global"
    assert load_config(REPO / "configs" / "diffusion" / "flow_grpo_sd35_ocr.yaml").train.beta == 0.04


def test_clear_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(FileNotFoundError, match="model.path '.*missing_model' does not exist"):
        train(_cfg(tmp_path / "a", tmp_path / "missing_model"))
    with pytest.raises(ValueError, match="unknown reward 'no_such_reward'; available: .*jpeg_compressibility"):
        train(_cfg(tmp_path / "b", tiny_sd3_path, reward={"components": {"no_such_reward": 1.0}}))
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*nowhere.txt"):
        train(_cfg(tmp_path / "c", tiny_sd3_path, data={"train_prompts": str(tmp_path / "nowhere.txt")}))
    with pytest.raises(ValueError, match="sde_type"):
        train(_cfg(tmp_path / "d", tiny_sd3_path, sample={"sde_type": "ddpm"}))
    with pytest.raises(Exception, match="unknown config key 'sample.group'"):
        _cfg(tmp_path / "e", tiny_sd3_path, ["sample.group=3"])


# ---------------------------------------------------------------------------------------- runs


def test_short_run_logs_drift_and_writes_checkpoint(tmp_path, tiny_sd3_path):
    out = tmp_path / "run"
    summary = train(_cfg(out, tiny_sd3_path, sample={"guidance_scale": 2.0, "window_size": 2, "num_steps": 4},
                         train={"beta": 0.04, "ema": True}, data={"eval_prompts": EVAL_PROMPTS},
                         log={"sample_every": 1, "eval_every": 2, "eval_max_prompts": 2}))
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("reward/mean", "reward/std", "reward/jpeg_compressibility", "policy/clipfrac", "policy/kl",
                    "policy/approx_kl", "diag/logprob_drift", "time/rollout_s", "time/reward_s", "time/train_s",
                    "time/step_s"):
            assert key in r, key
        assert r["diag/logprob_drift"] < 1e-4
    assert "eval/reward/mean" in rows[1]
    ckpt = out / "checkpoints" / "step_2"
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "state.pt").is_file()
    assert (ckpt / "adapters" / "default" / "pytorch_lora_weights.safetensors").is_file()
    assert (ckpt / "adapters" / "old" / "adapter_model.safetensors").is_file()  # the EMA
    assert (out / "samples" / "step_000001.png").is_file() and (out / "samples" / "eval_step_000002.png").is_file()
    assert (out / "plots" / "reward_curve.png").is_file()
    assert summary["max_logprob_drift"] < 1e-4 and "reward_rose" in summary


def test_resume_reproduces_metrics_exactly(tmp_path, tiny_sd3_path):
    common = dict(train={"beta": 0.02, "ema": True, "save_every": 2, "num_inner_epochs": 2},
                  sample={"guidance_scale": 2.0}, reward={"history": 4})
    full = tmp_path / "full"
    train(_cfg(full, tiny_sd3_path, ["train.max_steps=4"], **common))
    split = tmp_path / "split"
    train(_cfg(split, tiny_sd3_path, ["train.max_steps=2"], **common))
    train(_cfg(split, tiny_sd3_path, ["train.max_steps=4"], **common))  # resume=auto picks step_2
    a, b = _rows(full), _rows(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [_no_time(r) for r in a] == [_no_time(r) for r in b]


def test_interrupted_checkpoint_is_not_used(tmp_path, tiny_sd3_path, monkeypatch):
    from mmrl.adapters import PolicyStates

    out = tmp_path / "run"
    train(_cfg(out, tiny_sd3_path, train={"save_every": 1, "max_steps": 1}))
    real_save = PolicyStates.save

    def failing_save(self, directory):
        real_save(self, directory)
        raise KeyboardInterrupt("killed while writing the checkpoint")

    monkeypatch.setattr(PolicyStates, "save", failing_save)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(out, tiny_sd3_path, train={"save_every": 1, "max_steps": 2}))
    names = sorted(os.listdir(out / "checkpoints"))
    assert names == ["step_1"]  # no half-written step_2, no temp dir left
    monkeypatch.setattr(PolicyStates, "save", real_save)
    train(_cfg(out, tiny_sd3_path, train={"save_every": 1, "max_steps": 2}))
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_saved_lora_loads_into_plain_diffusers_pipeline(tmp_path, tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    from mmrl.adapters import PolicyStates
    from mmrl.diffusion.common import lora_config
    from mmrl.diffusion.models import load_flow_model

    out = tmp_path / "run"
    cfg = _cfg(out, tiny_sd3_path, train={"max_steps": 1})
    train(cfg)
    lora_dir = out / "checkpoints" / "step_1" / "adapters" / "default"
    # our view: model + adapters restored from the checkpoint
    ours = load_flow_model(tiny_sd3_path)
    states = PolicyStates(ours.transformer, lora_config(cfg.model, ours))
    states.load(lora_dir.parent)
    # the README snippet: plain diffusers
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_path))
    base = pipe.transformer
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    emb = ours.encode_prompts(["a red circle on a blue background"] * 2)
    kw = dict(hidden_states=x, timestep=torch.tensor([500.0, 500.0]), encoder_hidden_states=emb["prompt_embeds"],
              pooled_projections=emb["pooled_prompt_embeds"], return_dict=False)
    with torch.no_grad():
        before = base(**kw)[0]
        pipe.load_lora_weights(str(lora_dir))
        theirs = pipe.transformer(**kw)[0]
        mine = states.model(**kw)[0]
    assert torch.allclose(theirs, mine, atol=1e-5)
    assert not torch.allclose(before, mine, atol=1e-5)


def test_full_finetuning_and_cps_window(tmp_path, tiny_sd3_path):
    out = tmp_path / "full_ft"
    train(_cfg(out, tiny_sd3_path, model={"lora": False},
               sample={"sde_type": "cps", "window_size": 2, "window_range": [0, 3]},
               train={"max_steps": 1, "beta": 0.01, "ema": True, "lr": 1e-5}))
    row = _rows(out)[0]
    assert row["diag/logprob_drift"] < 1e-4 and row["train/updates"] >= 1
    assert (out / "checkpoints" / "step_1" / "adapters" / "default" / "model.safetensors").is_file()


@pytest.mark.slow
def test_tiny_demo_reward_rises(tmp_path):
    """The `make demo` config end to end on the shapes-pretrained tiny SD3: the reward of the last 5 steps
    beats the first 5 steps' by more than 2 per-image stds, and the trainer's log-probs match the rollout's."""
    if not (REPO / "assets" / "tiny_sd3_shapes" / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built (python -m mmrl.diffusion.pretrain_tiny assets/tiny_sd3_shapes)")
    cfg = load_config(REPO / "configs" / "diffusion" / "flow_grpo_tiny.yaml",
                      [f"output_dir={tmp_path / 'demo'}", f"model.path={REPO / 'assets' / 'tiny_sd3_shapes'}",
                       f"data.train_prompts={PROMPTS}", f"data.eval_prompts={REPO / 'assets/prompts/shapes_eval.txt'}"])
    summary = train(cfg)
    assert summary["reward_rose"], summary
    assert summary["reward_rise_in_std"] > 2 and summary["max_logprob_drift"] < 1e-4
    rows = _rows(tmp_path / "demo")
    assert len(rows) == cfg.train.max_steps and all(r["diag/logprob_drift"] < 1e-4 for r in rows)


def test_flux_run_with_guidance_embedding(tmp_path, tiny_flux_path):
    """FLUX: LoRA on the joint/single-stream attention, packed latents inside the wrapper, guidance embedding."""
    out = tmp_path / "flux"
    summary = train(_cfg(out, tiny_flux_path, sample={"guidance_scale": 3.5}, train={"max_steps": 1, "beta": 0.01}))
    row = _rows(out)[0]
    assert row["diag/logprob_drift"] < 1e-4 and row["train/updates"] == 2 and "policy/kl" in row
    assert summary["steps_logged"] == 1
