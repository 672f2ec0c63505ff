"""What the `mmrl train` command line says when a run fails: one line, and the step a rerun resumes from."""

import re
import types

import pytest
import torch

import mmrl.cli as cli
from mmrl.rewards.remote import RemoteRewardError
from mmrl.runtime import Run


def _fake_recipe(fail_at: int, saved: tuple[int, ...]):
    """A recipe whose train() opens the run, checkpoints `saved` steps and then fails like a reward server would."""

    def train(cfg):
        run = Run(cfg)
        for step in saved:
            with run.checkpoint(step) as d:
                run.save_state(d, step=step, x=torch.zeros(1))
        raise RemoteRewardError(f"reward server http://127.0.0.1:9/score failed at step {fail_at}: connection refused")

    return types.SimpleNamespace(train=train)


@pytest.mark.parametrize("saved, expected", [((1, 2), r"rerun the same command to resume from step 2 \(.*step_2\)"),
                                             ((), r"no checkpoint was written in .*: a rerun starts from step 0")])
def test_failure_mid_run_names_the_resume_step(tmp_path, monkeypatch, capsys, saved, expected):
    monkeypatch.setattr(cli, "recipe_module", lambda name: _fake_recipe(3, saved))
    code = cli.main(["train", "configs/diffusion/flow_grpo_tiny.yaml", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "reward server http://127.0.0.1:9/score failed at step 3" in err
    assert re.search(expected, err)


def test_refused_start_gets_no_resume_hint(tmp_path, monkeypatch, capsys):
    """A start refused by the run-directory checks says why, and not 'rerun to resume' (nothing had started)."""
    monkeypatch.setattr(cli, "recipe_module", lambda name: _fake_recipe(1, (1,)))
    out = f"output_dir={tmp_path / 'run'}"
    assert cli.main(["train", "configs/diffusion/flow_grpo_tiny.yaml", out]) == 2
    capsys.readouterr()
    monkeypatch.setattr(cli, "recipe_module", lambda name: types.SimpleNamespace(train=lambda cfg: Run(cfg)))
    code = cli.main(["train", "configs/diffusion/flow_grpo_tiny.yaml", out, "train.resume=never"])
    err = capsys.readouterr().err
    assert code == 2 and "would discard 1 checkpoint(s) (step_1)" in err and "rerun the same command" not in err
