"""Flow-GRPO recipe: advantages, configs, clear errors, short runs, exact resume, checkpoints, LoRA export."""

import glob
import math
import os
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.core.prompt_stats import PerPromptStatTracker
from mmrl.diffusion.flow_grpo import Config, train
from mmrl.testing import (RESUMED_RUN, assert_close_across_paths, assert_same_path, child_env, metrics_rows,
                          run_torchrun, spawn_ranks, without_time)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
EVAL_PROMPTS = str(REPO / "assets" / "prompts" / "shapes_eval.jsonl")


def _cfg(out, model_path, overrides=(), **sections) -> Config:
    d = {
        "algorithm": "flow_grpo", "output_dir": str(out), "seed": 3,
        "model": {"path": str(model_path), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train_prompts": PROMPTS},
        "rollout": {"prompts_per_step": 2, "height": 64, "width": 64, "num_steps": 3, "group_size": 3,
                    "guidance_scale": 1.0, "eval_num_steps": 2, "timestep_fraction": 0.99},
        "train": {"max_steps": 2, "save_every": 0},
        "optim": {"lr": 1e-3},
        "update": {"micro_batch_size": 4, "mini_batch_size": 3},  # 2 updates per epoch over 2 x 3 samples
        "algo": {"kl": {"coef": 0.0}, "ema": False},
        "reward": {"components": {"jpeg_compressibility": 1.0}},
        "log": {"sample_every": 0},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return load_config(d, list(overrides))




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
    assert cfg.algorithm == "flow_grpo" and cfg.rollout.group_size >= 2


def test_published_hyperparameters():
    cfg = load_config(REPO / "configs" / "diffusion" / "flow_grpo_sd35_pickscore.yaml")
    s, a = cfg.rollout, cfg.algo
    assert (s.height, s.num_steps, s.group_size, s.noise_level, s.guidance_scale) == (512, 10, 24, 0.7, 4.5)
    lora = cfg.model.lora
    assert (cfg.optim.lr, a.clip_range, a.kl.coef, lora.rank, lora.alpha) == (3e-4, 1e-4, 0.01, 32, 64)
    assert s.timestep_fraction == 0.99 and cfg.reward.std_mode == "global"
    assert load_config(REPO / "configs" / "diffusion" / "flow_grpo_sd35_ocr.yaml").algo.kl.coef == 0.04


def test_clear_errors(tmp_path, tiny_sd3_path):
    with pytest.raises(FileNotFoundError, match="model.path '.*missing_model' does not exist"):
        train(_cfg(tmp_path / "a", tmp_path / "missing_model"))
    with pytest.raises(ValueError, match="unknown reward 'no_such_reward'; available: .*jpeg_compressibility"):
        train(_cfg(tmp_path / "b", tiny_sd3_path, reward={"components": {"no_such_reward": 1.0}}))
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*nowhere.txt"):
        train(_cfg(tmp_path / "c", tiny_sd3_path, data={"train_prompts": str(tmp_path / "nowhere.txt")}))
    with pytest.raises(ValueError, match="sde_type"):
        train(_cfg(tmp_path / "d", tiny_sd3_path, rollout={"sde_type": "ddpm"}))
    with pytest.raises(Exception, match="unknown config key 'rollout.group'"):
        _cfg(tmp_path / "e", tiny_sd3_path, ["rollout.group=3"])


def test_mini_batch_must_divide_the_batch(tmp_path, tiny_sd3_path):
    with pytest.raises(ValueError, match=r"update.mini_batch_size=4 must divide the rollout batch .* = 6\)"):
        train(_cfg(tmp_path / "mb", tiny_sd3_path, ["update.mini_batch_size=4"]))


@pytest.mark.parametrize("algo, optim, update, kl", [("flow_grpo", (3e-4, 1e-4), (48, 8), 0.04),
                                                      ("nft", (3e-4, 1e-4), (0, 9), 1e-4), ("dpo", (1e-5, 1e-2), (0, 4), None)])
def test_partial_sections_keep_the_recipe_defaults(algo, optim, update, kl):
    """A YAML that gives one key of optim/update/algo.kl keeps the recipe's defaults for the others (the sections
    are recipe subclasses, not shared classes built with other values)."""
    d = {"algorithm": algo, "optim": {"eps": 1e-6}, "update": {"max_grad_norm": 2.0}}
    if kl is not None:
        d["algo"] = {"kl": {"in_reward": False}}
    cfg = load_config(d)
    assert (cfg.optim.lr, cfg.optim.weight_decay) == optim and cfg.optim.eps == 1e-6
    assert (cfg.update.mini_batch_size, cfg.update.micro_batch_size) == update and cfg.update.max_grad_norm == 2.0
    assert kl is None or cfg.algo.kl.coef == kl


def test_metric_names(tmp_path, tiny_sd3_path, check_metric_names):
    """Every key Flow-GRPO logs (KL, EMA, evaluation, dropped samples included) is in the naming scheme."""
    out = tmp_path / "run"
    train(_cfg(out, tiny_sd3_path, ["train.max_steps=1", "reward.on_nonfinite=drop_sample"],
               algo={"kl": {"coef": 0.04}, "ema": True}, data={"eval_prompts": EVAL_PROMPTS},
               log={"eval_every": 1, "eval_max_prompts": 2}))
    keys = check_metric_names(metrics_rows(out))
    for key in ("policy/loss", "policy/grad_norm", "policy/lr", "kl/ref", "train/updates", "eval/reward/mean",
                "reward/nonfinite_samples", "diag/logprob_drift", "cost/transformer_evals"):
        assert key in keys, key


# ---------------------------------------------------------------------------------------- runs


def test_short_run_logs_drift_and_writes_checkpoint(tmp_path, tiny_sd3_path):
    out = tmp_path / "run"
    summary = train(_cfg(out, tiny_sd3_path, rollout={"guidance_scale": 2.0, "window_size": 2, "num_steps": 4},
                         algo={"kl": {"coef": 0.04}, "ema": True}, data={"eval_prompts": EVAL_PROMPTS},
                         log={"sample_every": 1, "eval_every": 2, "eval_max_prompts": 2}))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("reward/mean", "reward/std", "reward/jpeg_compressibility", "policy/clipfrac", "kl/ref",
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
    assert summary["max_logprob_drift"] < 1e-4 and "reward_rose" not in summary  # the demo's check, not the recipe's


def test_resume_reproduces_metrics_exactly(tmp_path, tiny_sd3_path):
    common = dict(train={"save_every": 2}, algo={"kl": {"coef": 0.02}, "ema": True}, update={"epochs": 2},
                  rollout={"guidance_scale": 2.0}, reward={"history": 4})
    full = tmp_path / "full"
    train(_cfg(full, tiny_sd3_path, ["train.max_steps=4"], **common))
    split = tmp_path / "split"
    train(_cfg(split, tiny_sd3_path, ["train.max_steps=2"], **common))
    train(_cfg(split, tiny_sd3_path, ["train.max_steps=4"], **common))  # resume=auto picks step_2
    a, b = metrics_rows(full), metrics_rows(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)


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
    assert [r["step"] for r in metrics_rows(out)] == [1, 2]


def test_saved_lora_loads_into_plain_diffusers_pipeline(tmp_path, tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    from mmrl.adapters import PolicyStates
    from mmrl.diffusion.models import load_flow_model
    from mmrl.training import peft_lora_config

    out = tmp_path / "run"
    cfg = _cfg(out, tiny_sd3_path, train={"max_steps": 1})
    train(cfg)
    lora_dir = out / "checkpoints" / "step_1" / "adapters" / "default"
    # our view: model + adapters restored from the checkpoint
    ours = load_flow_model(tiny_sd3_path)
    states = PolicyStates(ours.transformer, peft_lora_config(cfg.model.lora, ours.lora_target_modules))
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


def test_cfg_grad_changes_only_the_update(tmp_path, tiny_sd3_path):
    """rollout.cfg_grad reaches the trainer: at CFG 4.5 the rollout, rewards and log-probs (drift 0) of step 1
    are the same in both modes, the gradient is not. The default is flow_grpo's today (`cond_only`: its
    scripts/train_sd3.py detaches the unconditional branch since commit 2d76907)."""
    assert Config().rollout.cfg_grad == "cond_only"
    rows = {}
    for mode in ("both", "cond_only"):
        out = tmp_path / mode
        train(_cfg(out, tiny_sd3_path, [f"rollout.cfg_grad={mode}"], rollout={"guidance_scale": 4.5},
                   train={"max_steps": 1}, update={"mini_batch_size": 0}))
        rows[mode] = metrics_rows(out)[0]
    a, c = rows["both"], rows["cond_only"]
    assert a["reward/mean"] == c["reward/mean"] and a["reward/std"] == c["reward/std"]
    assert a["diag/logprob_drift"] < 1e-6 and c["diag/logprob_drift"] < 1e-6
    assert abs(a["policy/grad_norm"] - c["policy/grad_norm"]) > 1e-3 * a["policy/grad_norm"]
    with pytest.raises(Exception, match=r"rollout.cfg_grad: expected one of \['both', 'cond_only'\], got 'uncond'"):
        _cfg(tmp_path / "bad", tiny_sd3_path, ["rollout.cfg_grad=uncond"])


def test_full_finetuning_and_cps_window(tmp_path, tiny_sd3_path):
    out = tmp_path / "full_ft"
    train(_cfg(out, tiny_sd3_path, model={"lora": {"rank": 0}},
               rollout={"sde_type": "cps", "window_size": 2, "window_range": [0, 3]},
               train={"max_steps": 1}, algo={"kl": {"coef": 0.01}, "ema": True}, optim={"lr": 1e-5}))
    row = metrics_rows(out)[0]
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
    assert summary["reward_rise_in_std"] > 2 and summary["max_logprob_drift"] < 1e-4
    rows = metrics_rows(tmp_path / "demo")
    assert len(rows) == cfg.train.max_steps and all(r["diag/logprob_drift"] < 1e-4 for r in rows)


def test_flux_run_with_guidance_embedding(tmp_path, tiny_flux_path):
    """FLUX: LoRA on the joint/single-stream attention, packed latents inside the wrapper, guidance embedding."""
    out = tmp_path / "flux"
    summary = train(_cfg(out, tiny_flux_path, rollout={"guidance_scale": 3.5}, train={"max_steps": 1},
                         algo={"kl": {"coef": 0.01}}))
    row = metrics_rows(out)[0]
    assert row["diag/logprob_drift"] < 1e-4 and row["train/updates"] == 2 and "kl/ref" in row
    assert summary["steps_logged"] == 1


# ---------------------------------------------------------------------------------------- efficiency


def test_prompt_embed_cache_is_batch_independent_and_lru(tiny_sd3):
    from mmrl.diffusion.models import PromptEmbedCache, PromptEmbeds

    cache = PromptEmbedCache(tiny_sd3, max_size=2)
    a, b, c = "a red circle on a blue background", "a green square", "two yellow triangles"
    first = cache([a, b, a])
    assert (cache.misses, cache.hits, len(cache)) == (2, 1, 2)
    alone = tiny_sd3.encode_prompts([b])
    for k in alone:  # a row is the prompt encoded alone, whatever shared its step
        assert torch.equal(first[k][1], alone[k][0]) and torch.equal(first[k][0], first[k][2])
    cache([c])  # evicts the least recently used (b: a was used after it)
    assert len(cache) == 2 and b not in cache._rows and a in cache._rows
    # the CFG batch [empty prompt; embeds] is built once per embeds object
    e = PromptEmbeds({k: v[:2] for k, v in first.items()})
    both = tiny_sd3._with_negative(e)
    assert tiny_sd3._with_negative(e) is both
    for k in both:
        assert torch.equal(both[k], torch.cat([tiny_sd3.negative_embeds(2)[k], e[k]]))


def test_reference_forward_once_per_sample_and_step(tmp_path, tiny_sd3_path):
    """With 2 inner epochs the frozen reference runs once per (sample, trained step), not once per epoch:
    transformer evaluations per step = rollout B * num_steps + policy epochs * kept * K + reference kept * K."""
    out = tmp_path / "run"
    train(_cfg(out, tiny_sd3_path, rollout={"num_steps": 3},
               train={"max_steps": 2}, algo={"kl": {"coef": 0.04}}, update={"epochs": 2}))
    rows, total = metrics_rows(out), 0
    for r in rows:
        kept = round(r["train/kept_fraction"] * 6)  # 2 prompts x 3 images; K = int(3 * 0.99) = 2 trained steps
        total += 6 * 3 + 2 * kept * 2 + kept * 2
        assert r["cost/transformer_evals"] == total and r["diag/logprob_drift"] < 1e-4


def test_restore_checkpoint_truncate_flag(tmp_path):
    """Ranks != 0 (ctx.is_main False) never rewrite rank 0's metrics.jsonl when restoring."""
    from types import SimpleNamespace

    from mmrl.config import RunConfig
    from mmrl.run.checkpoint import restore_checkpoint
    from mmrl.run.directory import Run

    run = Run(RunConfig(algorithm="flow_grpo", output_dir=str(tmp_path)))
    run.log(1, {"reward/mean": 1.0})
    other, main = SimpleNamespace(is_main=False), SimpleNamespace(is_main=True)
    assert restore_checkpoint(other, run, None, {}) == (0, {}) and len(run.read_metrics()) == 1
    assert restore_checkpoint(main, run, None, {}) == (0, {}) and run.read_metrics() == []  # fresh run: cleared


def test_checkpoint_of_the_earlier_version_resumes(tmp_path, tiny_sd3_path):
    """A checkpoint written before the training spine (state.pt without "step"; stateful names optimizer,
    lr_scheduler, tracker {"buffers": {prompt: [rewards]}}, data, transformer_evals) resumes to the same metrics."""
    common = dict(train={"save_every": 1}, reward={"history": 4}, algo={"kl": {"coef": 0.02}})
    full = tmp_path / "full"
    train(_cfg(full, tiny_sd3_path, ["train.max_steps=2"], **common))
    old = tmp_path / "old"
    train(_cfg(old, tiny_sd3_path, ["train.max_steps=1"], **common))
    state_file = old / "checkpoints" / "step_1" / "state.pt"
    state = torch.load(state_file, weights_only=False)
    assert sorted(state["stateful"]) == ["data", "lr_scheduler", "optimizer", "tracker", "transformer_evals"]
    assert all(isinstance(v, list) for v in state["stateful"]["tracker"]["buffers"].values())
    torch.save({k: v for k, v in state.items() if k != "step"}, state_file)  # the earlier save_state call
    from mmrl.run.files import write_manifest

    write_manifest(old / "checkpoints" / "step_1")  # state.pt changed: its size and crc32 as the run records them
    train(_cfg(old, tiny_sd3_path, ["train.max_steps=2"], **common))
    assert_same_path([without_time(r) for r in metrics_rows(old)], [without_time(r) for r in metrics_rows(full)],
                     why=RESUMED_RUN)


# ---------------------------------------------------------------------------------------- several processes
#
# Both tests start real processes (gloo on CPU). The first runs the CLI under torchrun and resumes with one
# process; the second runs this file as a script: 2 ranks (torch.multiprocessing.spawn) each run ONE optimizer
# step of the recipe's `_train_on_rollout` on their share of a fixed rollout batch, which must give the same
# LoRA weights as one process on the whole batch.

P, G = 4, 3  # prompts, images per prompt: global batch of 12; ranks hold prompts 0-1 and 2-3
# scenario -> per-prompt rewards; a constant group has advantage 0 and is dropped (drop_zero_advantage)
SCENARIOS = {
    "uneven": [[0.1, 0.9, 0.4], [2.0, -1.0, 0.5], [0.3, 1.7, 1.1], [0.5, 0.5, 0.5]],  # ranks keep 5 and 3 rows
    "idle": [[0.1, 0.9, 0.4], [2.0, -1.0, 0.5], [0.7, 0.7, 0.7], [0.5, 0.5, 0.5]],  # 5 and 0: rank 1 idles
}
# recomputed pi_old + step-level MIS: these (sample, step) pairs get ratio pi_old / pi_rollout = e^1 > 2 and leave
# the loss, so the ranks keep different numbers of pairs (the global mean must still match one process)
SCENARIOS["uneven_mis"] = SCENARIOS["uneven"]
SCENARIOS["idle_mis"] = SCENARIOS["idle"]  # rank 1 keeps nothing: it runs the pi_old forwards on padding rows only
MIS_REJECT = [(0, 0), (1, 1), (3, 0), (6, 1), (7, 0), (7, 1)]


def _equality_cfg(model_path):
    return _cfg("/tmp/unused", model_path,
                rollout={"num_steps": 3, "group_size": G, "guidance_scale": 2.0, "prompts_per_step": P},
                update={"micro_batch_size": 2, "mini_batch_size": 0}, algo={"kl": {"coef": 0.04}, "ema": True},
                optim={"lr": 1e-3})


def _scenario_cfg(model_path, scenario):
    """The equality config; `*_mis` scenarios recompute pi_old and mask (sample, step) pairs by token-level MIS."""
    cfg = _equality_cfg(model_path)
    if scenario.endswith("_mis"):
        cfg.algo = type(cfg.algo)(**{**vars(cfg.algo), "old_logprobs": "recompute", "rollout_correction": type(
            cfg.algo.rollout_correction)(rs_level="token", rs_threshold=2.0)})
    return cfg


def _scenario_rollout(full, scenario) -> None:
    """`*_mis` scenarios: lower the recorded rollout log-probs of the MIS_REJECT pairs by 1 (ratio e > 2)."""
    if scenario.endswith("_mis"):
        for i, j in MIS_REJECT:
            full.log_probs[i, j] -= 1.0


def _one_update(model_path, scenario, ctx):
    """One Flow-GRPO optimizer update on this rank's share of a fixed global rollout batch; returns the
    trainable weights after it (by name), this rank's advantages, the tracker state and the loss metrics."""
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.grpo_update import train_on_rollout
    from mmrl.diffusion.loop import TrainingParts
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import Trajectory, sample_groups
    from mmrl.diffusion.scoring import global_advantages
    from mmrl.runtime import seed_everything

    cfg = _scenario_cfg(model_path, scenario)
    s, t = cfg.rollout, cfg.optim
    model = load_flow_model(model_path)
    seed_everything(0)  # identical LoRA init everywhere
    states = build_policy_states(model, cfg.model, old=True, ref=True)
    params = states.trainable_parameters()
    model.transformer = ctx.wrap_model(states.model, "ddp")
    # eps 1e-6: Adam's first step is lr * g / (|g| + eps), which would blow fp32 summation-order noise of the
    # near-zero gradient entries up to ~lr * 1e-12 / eps; 1e-6 keeps that far below the 1e-6 tolerance
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    prompts_all = [x.strip() for x in open(PROMPTS).read().splitlines()[:P]]
    # the fixed rollout: every process computes the global batch with the same noise, then keeps its rows
    full = sample_groups(model, model.encode_prompts(prompts_all), G, num_steps=s.num_steps, height=s.height,
                         width=s.width, guidance_scale=s.guidance_scale, noise_level=s.noise_level,
                         timestep_fraction=s.timestep_fraction, generator=torch.Generator().manual_seed(7))
    _scenario_rollout(full, scenario)
    k = P // ctx.world_size
    pi = torch.arange(ctx.rank * k, (ctx.rank + 1) * k)
    rows = torch.arange(ctx.rank * k * G, (ctx.rank + 1) * k * G)
    traj = Trajectory(latents=full.latents[rows], log_probs=full.log_probs[rows], sigmas=full.sigmas,
                      sde_mask=full.sde_mask, train_steps=full.train_steps,
                      prompt_index=full.prompt_index[rows] - ctx.rank * k, embeds=full.embeds.select(pi))
    scores = torch.tensor(SCENARIOS[scenario]).flatten()[rows]
    prompts = [prompts_all[i] for i in full.prompt_index[rows].tolist()]
    tracker = PerPromptStatTracker("group", history=4)
    adv, keep, adv_metrics = global_advantages(ctx, tracker, prompts, scores, cfg.algo.adv_clip_max, True)
    torch.manual_seed(100 + ctx.rank)  # the order inside a chunk does not matter for one update
    out = train_on_rollout(TrainingParts(cfg, ctx, model, states, opt, sched, params), 0, traj, adv, keep)
    names = {id(p): n for n, p in states.model.named_parameters()}
    return {"params": {names[id(p)]: p.detach().clone() for p in params}, "adv": adv, "n_keep": len(keep),
            "tracker": tracker.state_dict(), "metrics": {**out, **adv_metrics}}


def _equality_worker(ctx, model_path, out_dir):
    res = {name: _one_update(model_path, name, ctx) for name in SCENARIOS}
    torch.save(res, Path(out_dir) / f"rank{ctx.rank}.pt")


@pytest.mark.slow
def test_two_ranks_one_update_equals_one_process(tmp_path, tiny_sd3_path):
    import subprocess
    import sys

    from mmrl.distributed import DistContext

    env = child_env()
    proc = subprocess.run([sys.executable, __file__, str(tiny_sd3_path), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"2-rank run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    initial = _initial_params(tiny_sd3_path)
    for name in SCENARIOS:
        torch.manual_seed(100)
        one = _one_update(tiny_sd3_path, name, DistContext())
        r0, r1 = ranks[0][name], ranks[1][name]
        # advantages from the all-gathered rewards = one process's; tracker identical on both ranks
        assert_close_across_paths(torch.cat([r0["adv"], r1["adv"]]), one["adv"], what="2 processes vs 1")
        assert r0["tracker"] == r1["tracker"] == one["tracker"]
        assert r0["metrics"]["train/kept_fraction"] == one["metrics"]["train/kept_fraction"]
        # the 0.5 of [2.0, -1.0, 0.5] equals its group mean: advantage 0, dropped too
        assert (r0["n_keep"], r1["n_keep"]) == ((5, 3) if name.startswith("uneven") else (5, 0))
        if name.endswith("_mis"):  # uneven: 6 of the 16 kept (sample, step) pairs rejected: 3 of 10 on rank 0, 3 of 6
            # on 1; idle: rank 0's 3 of 10 are all there are
            assert one["metrics"]["rollout/correction/rollout_rs_masked_fraction"] == pytest.approx(
                6 / 16 if name.startswith("uneven") else 3 / 10)
            assert r0["metrics"]["rollout/correction/rollout_rs_masked_fraction"] == pytest.approx(3 / 10)
        assert r0["metrics"]["diag/logprob_drift"] < 1e-4 and one["metrics"]["diag/logprob_drift"] < 1e-4
        moved = max((one["params"][k] - p0).abs().max().item() for k, p0 in initial.items())
        assert moved > 1e-4  # the update is not trivially zero
        for r in (r0, r1):
            diff = max((r["params"][k] - v).abs().max().item() for k, v in one["params"].items())
            print(f"[{name}] max |LoRA param diff| 2 ranks vs 1 process: {diff:.2e} (update size {moved:.2e})")
            assert diff < 1e-6


def _initial_params(model_path):
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.models import load_flow_model
    from mmrl.runtime import seed_everything

    cfg = _equality_cfg(model_path)
    model = load_flow_model(model_path)
    seed_everything(0)
    states = build_policy_states(model, cfg.model, old=True, ref=True)
    names = {id(p): n for n, p in states.model.named_parameters()}
    return {names[id(p)]: p.detach().clone() for p in states.trainable_parameters()}


@pytest.mark.slow
def test_torchrun_cli_two_processes_then_resume_with_one(tmp_path):
    import subprocess
    import sys

    if not (REPO / "assets" / "tiny_sd3_shapes" / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    out = tmp_path / "ddp"
    args = ["configs/diffusion/flow_grpo_tiny.yaml", f"output_dir={out}", "train.save_every=1",
            "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.num_steps=3", "update.micro_batch_size=2",
            "log.sample_every=1", "log.eval_every=0", "dist.backend=gloo"]
    env = child_env()
    two = run_torchrun(["-m", "mmrl.cli", "train", *args, "train.max_steps=2", "dist.strategy=ddp"], cwd=REPO, env=env)
    assert two.returncode == 0, f"torchrun failed:\n{two.stdout[-2000:]}\n{two.stderr[-5000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone logs
    assert all(r["diag/logprob_drift"] < 1e-4 and r["train/updates"] == 1 for r in rows)
    assert rows[1]["cost/transformer_evals"] > rows[0]["cost/transformer_evals"] > 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2"]
    assert (out / "samples" / "step_000001.png").is_file()
    one = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", *args, "train.max_steps=3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, f"resume failed:\n{one.stdout[-2000:]}\n{one.stderr[-5000:]}"
    assert "resumed from" in one.stdout and "step_2 (step 2)" in one.stdout
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["cost/transformer_evals"] > rows[1]["cost/transformer_evals"]
    assert (out / "checkpoints" / "step_3" / "COMPLETE").is_file()


# ---------------------------------------------------------------------------------------- non-finite rewards, updates
# `_test_nan_at_1` (tests/diffusion/conftest.py): NaN for image 1 of every batch.


def _strict_rows(out_dir):
    """metrics.jsonl parsed by a strict JSON parser (NaN / Infinity literals are an error)."""
    import json

    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=reject) for line in lines if line.strip()]


def test_nan_reward_is_an_error_naming_component_and_prompt(tmp_path, tiny_sd3_path):
    from mmrl.run.files import NonFiniteError

    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["train.max_steps=1"],
               reward={"components": {"jpeg_compressibility": 0.1, "_test_nan_at_1": 1.0}})
    with pytest.raises(NonFiniteError, match=r"reward component '_test_nan_at_1' \(of 'composite\(.*\)'\) returned a "
                                             r"non-finite score \(nan\) for sample 1 of 6 \(prompt '.+'\).*"
                                             r"reward.on_nonfinite=drop_sample"):
        train(cfg)
    # nothing trained, nothing saved: a run that failed before its first metrics row, checkpoint or sample leaves
    # nothing of its start behind (mmrl.run.closes_runs), so the new run directory is gone
    ckpts = tmp_path / "run" / "checkpoints"
    assert not ckpts.exists() or not list(ckpts.iterdir())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_nan_reward_drop_sample_trains_on(tmp_path, tiny_sd3_path):
    from safetensors.torch import load_file

    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["reward.on_nonfinite=drop_sample"],
               reward={"components": {"_test_nan_at_1": 1.0}})
    summary = train(cfg)  # (today's main: a TypeError on the None reward mean in the summary)
    rows = _strict_rows(tmp_path / "run")
    assert [r["reward/nonfinite_samples"] for r in rows] == [1, 1]
    for r in rows:  # the dropped sample leaves its group (2 of 3 left: still trained); statistics are finite
        assert 0 < r["train/kept_fraction"] <= 5 / 6 and r["train/updates"] == 2 and r["train/skipped_updates"] == 0
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["policy/loss"])
    assert math.isfinite(summary["reward_rise"])
    lora = load_file(tmp_path / "run/checkpoints/step_2/adapters/default/adapter_model.safetensors")
    assert all(bool(torch.isfinite(v).all()) for v in lora.values())


def _nan_policy_loss(monkeypatch):
    """Make every Flow-GRPO loss NaN (its gradients too), as a numerically broken update would be."""
    import mmrl.diffusion.grpo_update as fg

    real = fg.clipped_policy_loss

    def nan_loss(*args, **kwargs):
        loss, m = real(*args, **kwargs)
        return loss * float("nan"), m

    monkeypatch.setattr(fg, "clipped_policy_loss", nan_loss)


def test_nonfinite_gradient_skips_updates_then_stops(tmp_path, tiny_sd3_path, monkeypatch):
    import mmrl.training as fg
    from mmrl.run.files import NonFiniteError

    _nan_policy_loss(monkeypatch)
    seen = {}
    real_make = fg.build_optimizer

    def spy(params, optim, **kw):  # the trainable tensors and their values before any update
        seen["params"], seen["init"] = list(params), [p.detach().clone() for p in params]
        return real_make(seen["params"], optim, **kw)

    monkeypatch.setattr(fg, "build_optimizer", spy)
    # 2 updates per step, 3 skips in a row allowed: step 1 skips both and is saved; step 2's first skip stops
    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["train.save_every=1", "update.max_skipped_updates=3"])
    with pytest.raises(NonFiniteError, match=r"3 consecutive updates had a non-finite loss/gradient at step 2 .*"
                                             r"last complete checkpoint: .*step_1"):
        train(cfg)
    assert all(torch.equal(p.detach(), v) for p, v in zip(seen["params"], seen["init"]))  # bit-identical
    (row,) = _strict_rows(tmp_path / "run")
    assert row["train/skipped_updates"] == 2 and row["train/updates"] == 0 and row["policy/loss"] is None
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step_1"]


def test_no_checkpoint_with_nan_weights(tmp_path, tiny_sd3_path, monkeypatch):
    from mmrl.run.files import NonFiniteError
    from mmrl.training import UpdateGuard

    _nan_policy_loss(monkeypatch)
    monkeypatch.setattr(UpdateGuard, "update_ok", lambda self, losses, grad_norm: True)  # the guard switched off
    cfg = _cfg(tmp_path / "run", tiny_sd3_path, ["train.save_every=1", "train.max_steps=1"])
    with pytest.raises(NonFiniteError, match=r"step 1: \d+ policy tensor\(s\) hold NaN/inf .*checkpoint step_1 was "
                                             r"not written; last complete checkpoint: none"):
        train(cfg)
    assert not list((tmp_path / "run/checkpoints").iterdir())


if __name__ == "__main__":  # 2 ranks for test_two_ranks_one_update_equals_one_process
    import sys

    spawn_ranks(_equality_worker, sys.argv[1], sys.argv[2])


def test_async_reward_scoring_gives_the_synchronous_results(tmp_path, tiny_sd3_path):
    """`reward.score_while_sampling`: each rollout micro-batch is scored in a worker thread while the next one is sampled;
    a run writes exactly the metrics of the synchronous run (two components, so per-component details are joined
    too), and the scorer saw one chunk per micro-batch."""
    from mmrl.diffusion import scoring

    chunks = []
    submit = scoring.AsyncRewardScorer.submit

    def counted(self, images, prompts, metadata):
        chunks.append(len(images))
        return submit(self, images, prompts, metadata)

    comps = {"components": {"jpeg_compressibility": 1.0, "prompt_color": 0.5}}
    rows = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        scoring.AsyncRewardScorer.submit = counted
        try:
            train(_cfg(out, tiny_sd3_path, [f"reward.score_while_sampling={mode}", "rollout.micro_batch_size=2"],
                       reward=comps))
        finally:
            scoring.AsyncRewardScorer.submit = submit
        rows[mode] = [without_time(r) for r in metrics_rows(out)]
    assert len(rows["true"]) == 2
    assert_same_path(rows["true"], rows["false"], why="the scorer thread runs the same reward calls on the same chunks")
    assert chunks == [2, 2, 2] * 2  # 2 prompts x 3 images per step in micro-batches of 2, two steps
    with pytest.raises(ValueError, match="reward.score_while_sampling needs per-sample rewards"):
        from mmrl.rewards import load

        scoring.AsyncRewardScorer(load({"components": {"jpeg_compressibility": 1.0}, "normalize": "batch"}))
