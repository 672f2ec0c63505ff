"""A resume never says one thing and does another (`mmrl.run.resume`, `mmrl.training.optim.LRSchedule`): every
config change a resume reports takes effect from the resumed step on, or the resume is refused at start; a run whose
checkpoints are all unusable is never silently restarted."""

import io
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import mmrl.cli as cli
from mmrl.config import ConfigError, RunConfig, TrainConfig, default_config, to_dict
from mmrl.run.directory import Run
from mmrl.run.files import RunError
from mmrl.run.resume import config_changes, flatten, is_frozen_on_resume, mapping_fields, refused_changes
from mmrl.testing import metrics_rows
from mmrl.training import OptimConfig, build_optimizer, lr_factor

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(ROOT / "configs" / "diffusion" / "flow_grpo_tiny.yaml")
VLM = str(ROOT / "configs" / "vlm" / "grpo_tiny_shapes.yaml")
TINY = [f"model.path={ROOT / 'assets' / 'tiny_sd3_shapes'}",
        f"data.train_prompts={ROOT / 'assets' / 'prompts' / 'shapes_train.txt'}",
        f"data.eval_prompts={ROOT / 'assets' / 'prompts' / 'shapes_eval.txt'}",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "log.eval_every=0", "log.sample_every=0",
        "train.save_every=1"]


def _round_trip(sd: dict) -> dict:
    """A state dict as a checkpoint returns it (torch.save, then a weights_only load)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_optimizer_and_schedule_settings_come_from_the_config_after_a_resume():
    """torch restores param_groups (lr, betas, eps, weight_decay) and the scheduler's base_lrs from a checkpoint; a
    resumed run must use the config's. The state (AdamW moments, step counts, scheduler steps) is kept."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    old = OptimConfig(lr=3e-3)
    opt, sched = build_optimizer([w], old, total_steps=10)
    for _ in range(3):
        (w ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    saved = {"optimizer": _round_trip(opt.state_dict()), "lr_scheduler": _round_trip(sched.state_dict())}
    new = OptimConfig(lr=0.1, betas=[0.5, 0.9], eps=1e-4, weight_decay=0.25, warmup_steps=5, lr_end_factor=0.5)
    for order in (("optimizer", "lr_scheduler"), ("lr_scheduler", "optimizer")):
        opt2, sched2 = build_optimizer([w], new, total_steps=20)
        objs = {"optimizer": opt2, "lr_scheduler": sched2}
        for k in order:
            objs[k].load_state_dict(saved[k])
        sched2.apply_config()  # what restore_checkpoint does once everything is loaded
        g = opt2.param_groups[0]
        assert g["lr"] == pytest.approx(0.1 * lr_factor(3, 5, 0.5, 20))  # by hand: 0.1 * 4/5 * (1 - 0.5 * 3/20)
        assert g["lr"] == pytest.approx(0.1 * 0.8 * 0.925)
        assert (g["betas"], g["eps"], g["weight_decay"], g["initial_lr"]) == ((0.5, 0.9), 1e-4, 0.25, 0.1)
        assert sched2.last_epoch == 3 and sched2.base_lrs == [0.1]
        assert torch.equal(opt2.state[w]["exp_avg"], opt.state[w]["exp_avg"])  # state kept
        sched2.step()
        assert g["lr"] == pytest.approx(0.1 * lr_factor(4, 5, 0.5, 20))
        assert "_config" not in sched2.state_dict()  # settings are never written into a checkpoint


def test_mapping_fields_are_compared_whole_and_conditional_changes_refused():
    flow = default_config("flow_grpo")
    assert "reward.components" in mapping_fields(type(flow))
    assert {"reward.kwargs", "rollout.vllm_kwargs"} <= mapping_fields(type(default_config("vlm_grpo")))
    assert "env.tasks" in mapping_fields(type(default_config("vlm_multiturn")))
    saved = to_dict(flow)
    cur = to_dict(flow)
    cur["reward"]["components"] = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5}  # a component added
    changes = config_changes(saved, cur, mapping_fields(type(flow)))
    assert [c[0] for c in changes] == ["reward.components"]
    assert config_changes({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == []  # keys of another mmrl version: not reported
    full = {"model.lora.rank": 0}
    lora = {"model.lora.rank": 16}
    assert refused_changes([("algo.ema", False, True)], lora)  # asks for an EMA state the checkpoint lacks
    assert not refused_changes([("algo.ema", True, False)], lora)
    assert refused_changes([("algo.kl.coef", 0.0, 0.1)], full)  # full fine-tuning: the reference is a stored copy
    assert not refused_changes([("algo.kl.coef", 0.0, 0.1)], lora)  # LoRA: the reference is the base (adapters off)
    assert not refused_changes([("algo.kl.coef", 0.01, 0.1)], full)
    for key in ("warm_start.steps", "data.limit", "data.min_score_gap", "algo.mode", "env.tasks", "seed", "model.path"):
        assert is_frozen_on_resume(key), key
    assert not is_frozen_on_resume("model.gradient_checkpointing") and not is_frozen_on_resume("optim.lr")


def _toy(tmp_path, **train) -> RunConfig:
    return RunConfig(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig(**train))


def test_a_run_whose_checkpoints_are_all_unusable_is_not_restarted_silently(tmp_path):
    run = Run(_toy(tmp_path))
    for step in (1, 2):
        with run.checkpoint(step) as d:
            run.save_state(d, step=step, x=torch.tensor([float(step)]))
        run.log(step, {"reward/mean": float(step)})
    run.close()
    for step in (1, 2):
        state = run.ckpt_dir / f"step_{step}" / "state.pt"
        state.write_bytes(state.read_bytes()[:50])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "resuming from the previous checkpoint" warning: there is none
        with pytest.raises(RunError, match=r"every checkpoint of .* is unusable \(.*step_1/state.pt has 50 bytes"
                                           r".*step_2/state.pt has 50 bytes.*\): starting again from step 0 would "
                                           r"overwrite the run's metrics.jsonl; .*train.overwrite=true"):
            Run(_toy(tmp_path))
    assert len(run.read_metrics()) == 2  # nothing rewritten
    with pytest.warns(RuntimeWarning, match=r"step_2/state.pt has 50 bytes.*resuming from step 0 \(train.overwrite"):
        again = Run(_toy(tmp_path, overwrite=True))
    assert again.find_resume() is None  # an explicit choice: starts from step 0


def test_a_state_file_that_would_run_code_is_refused_and_auto_resume_falls_back(tmp_path):
    class RunsCode:
        def __reduce__(self):
            return (print, ("pwned",))

    run = Run(_toy(tmp_path))
    for step in (1, 2):
        with run.checkpoint(step) as d:
            run.save_state(d, step=step, x=torch.tensor([float(step)]))
            if step == 2:  # a foreign state.pt that passes the manifest (written before it)
                torch.save({"evil": RunsCode()}, d / "state.pt")
    run.close()
    bad = run.ckpt_dir / "step_2" / "state.pt"
    with pytest.warns(RuntimeWarning, match=rf"{bad} was refused for safety: it holds print, which .*resuming from "
                                            r"the previous complete checkpoint instead"):
        resumed = Run(_toy(tmp_path))
    assert resumed.find_resume().name == "step_1"
    resumed.close()
    with pytest.raises(RunError, match=rf"train.resume=.*step_2: checkpoint .* is unusable: {bad} was refused for "
                                       r"safety"):
        Run(_toy(tmp_path, resume=str(run.ckpt_dir / "step_2")))
    # an older PATH with train.overwrite=true that turns out unusable: refused before the later checkpoints go
    with run.checkpoint(3) as d:
        run.save_state(d, step=3, x=torch.tensor([3.0]))
    with pytest.raises(RunError, match=r"is unusable: .*was refused for safety"):
        Run(_toy(tmp_path, resume=str(run.ckpt_dir / "step_2"), overwrite=True))
    assert (run.ckpt_dir / "step_3" / "state.pt").is_file()


# ------------------------------------------------------------------ through `mmrl train`, each class of key


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    """A tiny Flow-GRPO run of 2 steps (checkpoints step_1, step_2) and its resume by 1 step with no change."""
    base = tmp_path_factory.mktemp("flow") / "run"
    assert cli.main(["train", FLOW, f"output_dir={base}", *TINY, "train.max_steps=2", "train.keep_last=0"]) == 0
    same = base.parent / "same"
    shutil.copytree(base, same)
    assert cli.main(["train", FLOW, f"output_dir={same}", *TINY, "train.max_steps=3", "train.keep_last=0"]) == 0
    return base, metrics_rows(same)[-1]


def _resume(flow_run, tmp_path, *overrides, max_steps=3) -> tuple[int, Path]:
    base, _ = flow_run
    out = tmp_path / "run"
    shutil.copytree(base, out)
    code = cli.main(["train", FLOW, f"output_dir={out}", *TINY, f"train.max_steps={max_steps}",
                     "train.keep_last=0", *overrides])
    return code, out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["optimizer", "schedule", "loop", "logging", "loss", "reward", "rollout",
                                  "running_norm"])
def test_a_changed_key_takes_effect_from_the_resumed_step(flow_run, tmp_path, capsys, case):
    _, same = flow_run  # step 3 of the resume without changes
    overrides = {
        "optimizer": ["optim.lr=0.1", "optim.betas=[0.5, 0.9]", "optim.eps=1e-4", "optim.weight_decay=0.25"],
        "schedule": ["optim.warmup_steps=10", "optim.lr_end_factor=0.5"],
        "loop": ["train.save_every=2", "train.keep_last=1"],
        "logging": ["log.sample_every=1", "log.num_samples=2", "log.trackers=[jsonl, tensorboard]"],
        "loss": ["algo.kl.coef=1.0"],
        "reward": ["reward.components.jpeg_incompressibility.quality=20"],
        "rollout": ["rollout.group_size=4"],
        "running_norm": ["reward.running_norm=true"],
    }[case]
    code, out = _resume(flow_run, tmp_path, *overrides, max_steps=5 if case == "loop" else 3)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 0, err
    for item in overrides:  # reported ...
        key = item.split("=")[0]
        assert f"[mmrl]   {'reward.components' if key.startswith('reward.components') else key}: " in err, err
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 6 if case == "loop" else 4))
    row = rows[2]  # ... and in effect at step 3
    state = torch.load(out / "checkpoints" / "step_3" / "state.pt", weights_only=False) if case != "loop" else None
    if case == "optimizer":
        assert row["policy/lr"] == pytest.approx(0.1) and same["policy/lr"] == pytest.approx(0.003)
        g = state["stateful"]["optimizer"]["param_groups"][0]
        assert (tuple(g["betas"]), g["eps"], g["weight_decay"]) == ((0.5, 0.9), 1e-4, 0.25)
    elif case == "schedule":  # 3 scheduler steps taken by the time step 3 logs; horizon max_steps = 3
        assert row["policy/lr"] == pytest.approx(0.003 * lr_factor(3, 10, 0.5, 3))
    elif case == "loop":
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_5"]  # saved at 4, 5; keep_last 1
    elif case == "logging":
        assert (out / "samples" / "step_000003.png").is_file() and list((out / "tensorboard").iterdir())
    elif case == "loss":
        assert row["kl/ref"] == same["kl/ref"] > 0 and row["reward/mean"] == same["reward/mean"]  # same rollout
        assert row["policy/loss"] != same["policy/loss"]  # ... weighted with the new coefficient
    elif case == "reward":
        assert row["reward/mean"] != same["reward/mean"]  # JPEG size at quality 20 instead of 95
    elif case == "rollout":
        assert row["cost/transformer_evals"] - rows[1]["cost/transformer_evals"] > \
            same["cost/transformer_evals"] - rows[1]["cost/transformer_evals"]  # 8 samples instead of 4
    elif case == "running_norm":
        assert "holds no ['reward_norm'] (an option turned on at this resume)" in captured.out
        assert row["reward/running_count"] == 4  # the statistics started at the resume: 4 samples of step 3
        assert "reward_norm" in state["stateful"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", [
    (["algo.ema=true"], "algo.ema: False -> True (the checkpoint holds no EMA ('old') policy state"),
    (["model.lora.rank=0", "algo.kl.coef=0.0"], "model.lora.rank: 16 -> 0"),
    (["rollout.worker=process", "rollout.max_staleness=1"], "rollout.max_staleness: 0 -> 1"),  # in-flight batches
])
def test_a_change_that_cannot_take_effect_is_refused_before_the_model_loads(flow_run, tmp_path, capsys, monkeypatch,
                                                                           overrides, message):
    from mmrl.diffusion import models

    monkeypatch.setattr(models, "load_flow_model", lambda *a, **k: pytest.fail("the model was loaded"))
    base, _ = flow_run
    code, out = _resume(flow_run, tmp_path, *overrides)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("mmrl: error: ")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "cannot change mid-run" in lines[0]
    assert (out / "config.yaml").read_text() == (base / "config.yaml").read_text()
    assert len(metrics_rows(out)) == 2


@pytest.mark.slow
def test_vlm_resume_takes_the_new_learning_rate_and_refuses_a_changed_warm_start(tmp_path, capsys):
    out = tmp_path / "run"
    tiny = [f"model.path={tmp_path / 'qwen2_vl'}", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "data.eval_size=4", "warm_start.steps=2", "warm_start.batch_size=4", "log.sample_every=0",
            "log.eval_every=0", "train.save_every=1"]
    assert cli.main(["train", VLM, f"output_dir={out}", *tiny, "train.max_steps=1"]) == 0
    capsys.readouterr()
    assert cli.main(["train", VLM, f"output_dir={out}", *tiny, "train.max_steps=2", "optim.lr=0.05"]) == 0
    assert "optim.lr: 0.001 -> 0.05" in capsys.readouterr().err
    rows = metrics_rows(out)
    assert rows[0]["policy/lr"] == pytest.approx(1e-3) and rows[1]["policy/lr"] == pytest.approx(0.05)
    code = cli.main(["train", VLM, f"output_dir={out}", *tiny[:4], "warm_start.steps=5", *tiny[5:],
                     "train.max_steps=3", "optim.lr=0.05"])
    err = capsys.readouterr().err
    assert code == 2 and "changed warm_start.steps: 2 -> 5" in err and "cannot change mid-run" in err
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
