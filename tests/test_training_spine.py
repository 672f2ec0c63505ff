"""The shared training spine (mmrl.training): schedule, optimizer, config sections, one checkpoint
layout, run start, summary."""

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
import torch

from mmrl.adapters import PolicyStates
from mmrl.config import RunConfig, TrainConfig, from_dict
from mmrl.distributed import DistConfig, DistContext
from mmrl.run.checkpoint import checkpoint_due, restore_checkpoint, save_checkpoint
from mmrl.run.directory import Run
from mmrl.run.files import RunError
from mmrl.run.start import start_run
from mmrl.runtime import get_rng_state
from mmrl.training import LoRAConfig, OptimConfig, UpdateConfig, build_optimizer, lr_factor, peft_lora_config, summarise


@pytest.mark.parametrize("warmup, end, total", [(0, 1.0, 10), (4, 1.0, 10), (0, 0.1, 8), (3, 0.5, 6)])
def test_lr_factor_reproduces_the_recipes_schedules_exactly(warmup, end, total):
    # the three schedules the recipes had (diffusion, vlm_grpo, vlm_multiturn), written out as they were
    diffusion = lambda i: min(1.0, (i + 1) / warmup) if warmup > 0 else 1.0  # noqa: E731
    vlm_grpo = lambda s: min(1.0, (s + 1) / max(1, warmup))  # noqa: E731
    multiturn = lambda k: 1.0 - (1.0 - end) * min(k, total) / total  # noqa: E731
    for i in range(total + 5):
        got = lr_factor(i, warmup, end, total)
        if end == 1.0:
            assert got == diffusion(i) == vlm_grpo(i)
        if warmup == 0:
            assert got == multiturn(i)
    # by hand: warm-up 3 of 6 steps, decay to 0.5: i=1 -> 2/3 * (1 - 0.5 * 1/6)
    assert lr_factor(1, 3, 0.5, 6) == pytest.approx(2 / 3 * (1 - 0.5 / 6))


def test_build_optimizer_uses_the_section():
    p = torch.nn.Parameter(torch.ones(3))
    opt, sched = build_optimizer([p], OptimConfig(lr=0.1, weight_decay=0.01, betas=[0.8, 0.9], eps=1e-6,
                                                  warmup_steps=2), total_steps=10)
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["betas"], g["eps"]) == (0.05, 0.01, (0.8, 0.9), 1e-6)
    opt.step(), sched.step()
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([], OptimConfig())


def test_sections_check_their_values():
    assert UpdateConfig(mini_batch_size=8).updates_per_epoch(32) == 4 and UpdateConfig().updates_per_epoch(7) == 1
    with pytest.raises(ValueError, match=r"update.mini_batch_size=5 must divide the rollout batch .* = 32"):
        UpdateConfig(mini_batch_size=5).updates_per_epoch(32)
    for bad, msg in [(dict(epochs=0), "update.epochs: expected >= 1"),
                     (dict(max_grad_norm=-1.0), "update.max_grad_norm"),
                     (dict(max_skipped_updates=0), "update.max_skipped_updates")]:
        with pytest.raises(ValueError, match=msg):
            UpdateConfig(**bad)
    with pytest.raises(ValueError, match="optim.lr_end_factor"):
        OptimConfig(lr_end_factor=2.0)
    with pytest.raises(ValueError, match="model.lora.rank: expected >= 0"):
        LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match="model.lora.init_path needs model.lora.rank > 0"):
        LoRAConfig(rank=0, init_path="x")
    assert peft_lora_config(LoRAConfig(rank=0)) is None
    cfg = peft_lora_config(LoRAConfig(rank=4, alpha=8, init="gaussian"), default_targets=["to_q"])
    assert (cfg.r, cfg.lora_alpha, cfg.init_lora_weights, sorted(cfg.target_modules)) == (4, 8, "gaussian", ["to_q"])


# ---------------------------------------------------------------------------------------------- checkpoints


@dataclass
class _RunCfg(RunConfig):
    dist: DistConfig = field(default_factory=DistConfig)


def _setup(tmp_path, **train):
    cfg = _RunCfg(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig(**train))
    ctx, run = start_run(cfg, {"rollout.prompts_per_step": 4})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    states = PolicyStates(model, None, old=True)
    opt, sched = build_optimizer(states.trainable_parameters(), OptimConfig(lr=0.1, warmup_steps=3), 10)
    return cfg, ctx, run, states, opt, sched


def _train_step(states, opt, sched):
    loss = states.model(torch.ones(2, 3)).pow(2).sum()
    loss.backward()
    opt.step(), sched.step(), opt.zero_grad()
    states.ema("default", "old", 0.5)


def test_one_layout_saves_and_restores_everything(tmp_path):
    cfg, ctx, run, states, opt, sched = _setup(tmp_path)
    assert isinstance(ctx, DistContext) and not ctx.enabled and run.dir.is_dir()
    _train_step(states, opt, sched)
    save_checkpoint(ctx, run, 1, states, {"optimizer": opt, "lr_scheduler": sched}, extra={"cursor": 7})
    d = run.ckpt_dir / "step_1"
    assert sorted(p.name for p in d.iterdir()) == ["COMPLETE", "MANIFEST.json", "adapters", "config.yaml", "state.pt"]
    expected = {k: v.clone() for k, v in states.model.state_dict().items()}
    _train_step(states, opt, sched)  # moves on; the restore must bring step 1 back
    cfg2, ctx2, run2, states2, opt2, sched2 = _setup(tmp_path)
    step, extra = restore_checkpoint(ctx2, run2, states2, {"optimizer": opt2, "lr_scheduler": sched2})
    assert (step, extra) == (1, {"cursor": 7})
    assert all(torch.equal(v, expected[k]) for k, v in states2.model.state_dict().items())
    assert sched2.last_epoch == 1 and opt2.state_dict()["state"][0]["step"] == 1
    with pytest.raises(RunError, match=r"state.pt lacks \['tracker'\]"):
        restore_checkpoint(ctx2, run2, states2, {"tracker": sched2})
    cfg.train.save_every, cfg.train.max_steps = 5, 12
    assert [s for s in range(1, 13) if checkpoint_due(cfg, s)] == [5, 10, 12]


def test_a_directory_of_another_layout_is_not_a_checkpoint(tmp_path):
    cfg, ctx, run, states, opt, sched = _setup(tmp_path)
    with run.checkpoint(4) as d:  # weights under policy/ and a flat state.pt: not a checkpoint of any recipe
        states.save(d / "policy")
        run.save_state(d, optimizer=opt.state_dict(), rng=get_rng_state(), step=4)
    cfg2, ctx2, run2, states2, opt2, sched2 = _setup(tmp_path)
    with pytest.raises(RunError, match=r"step_4 has no adapters/ \+ state.pt\['stateful'\]"):
        restore_checkpoint(ctx2, run2, states2, {"optimizer": opt2, "lr_scheduler": sched2})


def test_nan_weights_are_never_saved(tmp_path):
    cfg, ctx, run, states, opt, sched = _setup(tmp_path)
    with torch.no_grad():
        states.model[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"policy tensor\(s\) hold NaN/inf .*checkpoint step_2 was not written"):
        save_checkpoint(ctx, run, 2, states, {"optimizer": opt})
    assert not (run.ckpt_dir / "step_2").exists()


def test_start_run_checks_global_sizes_and_summary_skips_nulls(tmp_path, capsys):
    cfg, ctx, run, states, opt, sched = _setup(tmp_path)
    for s, r in enumerate([1.0, None, 2.0, 3.0], start=1):
        run.log(s, {"reward/mean": r if r is None else r, "reward/std": 0.5})
    out = summarise(run, "toy")
    assert out["reward_first5"] == pytest.approx(2.0) and out["reward_rise_in_std"] == 0.0
    assert "[toy] reward/mean" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["reward/mean"] is None
    assert dataclasses.is_dataclass(cfg)


@dataclass
class _WithDefaults:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, warmup_steps=5))


def test_partial_section_keeps_the_fields_defaults():
    cfg = from_dict(_WithDefaults, {"optim": {"weight_decay": 0.1}})
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay) == (1e-6, 5, 0.1)
    assert from_dict(_WithDefaults, {}).optim.lr == 1e-6
    assert from_dict(_WithDefaults, {"optim": {"lr": 0.5}}).optim.lr == 0.5


def test_every_recipe_log_has_the_trackers():
    from mmrl.config import load_config

    for algo in ("flow_grpo", "dpo", "nft", "vlm_grpo", "vlm_multiturn"):  # every recipe's log has the trackers
        assert load_config({"algorithm": algo}, ["log.trackers=[jsonl, tensorboard]"]).log.trackers == [
            "jsonl", "tensorboard"]
