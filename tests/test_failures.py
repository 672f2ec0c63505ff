"""What the `mmrl train` command line says when a run fails: one line, the step a rerun resumes from, and nothing
left behind by a start that failed."""

import re
import types
from pathlib import Path

import pytest
import torch

import mmrl.cli as cli
from mmrl.config import load_config
from mmrl.rewards.remote import RemoteRewardError
from mmrl.run.directory import Run
from mmrl.run.files import RunError
from mmrl.run.start import closes_runs


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


# ---------------------------------------------------------------------------------------- failed starts

REPO = Path(__file__).resolve().parents[1]
FLOW, VLM = "configs/diffusion/flow_grpo_tiny.yaml", "configs/vlm/grpo_tiny_shapes.yaml"
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "log.eval_every=0", "train.max_steps=1"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("mmrl: error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("config, overrides, message", [
    (FLOW, ["model.path={tmp}/no_model"], "model.path '{tmp}/no_model' does not exist"),  # after the run dir exists
    (FLOW, ["reward.components.pickscore.weights={tmp}/PickScore_v1"],  # an override into a reward's arguments
     "pickscore: weights path '{tmp}/PickScore_v1' does not exist"),
    (FLOW, ["rollout.height=60"], "image size 60x64 must be a multiple of 8"),  # at step 1, before anything is logged
    (VLM, ["model.path={tmp}/no_model", "model.build_tiny="], "model.path: no config.json in '{tmp}/no_model'"),
])
@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_start_leaves_nothing_behind(config, overrides, message, existing, tmp_path, monkeypatch, capsys):
    """A run that fails before it writes a metrics row, a checkpoint or a sample removes what its start created: no
    new run directory, no config.yaml, no empty checkpoints/ samples/ plots/, no lock file; and no 'rerun to
    resume' hint (there is nothing to resume)."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    if existing:  # a directory the user made: it stays, empty
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    argv = ["train", config, f"output_dir={out}", *SMALL, *[o.replace("{tmp}", str(tmp_path)) for o in overrides]]
    assert cli.main(argv) == 2
    line = _one_error_line(capsys)
    assert message.replace("{tmp}", str(tmp_path)) in line and "rerun" not in line, line
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert not out.exists()


def test_a_failed_offline_dpo_start_leaves_no_latent_cache(tmp_path, monkeypatch, capsys):
    """Offline DPO keeps VAE latents in <output_dir>/latent_cache/: the folder is made with the first shard, so a
    start that fails on its first batch (a missing preference image) leaves the user's directory as it was."""
    import json

    from mmrl.diffusion.dpo import make_shapes_preference_file

    monkeypatch.chdir(REPO)
    pairs = make_shapes_preference_file(tmp_path / "pairs", 4)
    rows = [json.loads(ln) for ln in Path(pairs).read_text().splitlines()]
    rows[0]["chosen"] = "missing.png"
    bad = tmp_path / "pairs" / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    out.mkdir()
    argv = ["train", "configs/diffusion/dpo_tiny_offline.yaml", f"output_dir={out}", f"data.preference_file={bad}",
            "train.max_steps=1", "data.pairs_per_step=4", "update.micro_batch_size=4"]
    assert cli.main(argv) == 2
    line = _one_error_line(capsys)
    assert f"preference image not found: {tmp_path / 'pairs' / 'missing.png'}" in line, line
    assert list(out.iterdir()) == []


def test_a_failed_resume_keeps_the_run_as_it_was(tmp_path, capsys):
    """A resumed run that fails at start (here: its reward server is down) leaves the run's files untouched."""
    cfg_path = REPO / FLOW
    out = tmp_path / "run"
    run = Run(load_config(cfg_path, [f"output_dir={out}"]))
    with run.checkpoint(1) as d:
        run.save_state(d, x=torch.zeros(1))
    run.log(1, {"reward/mean": 1.0})
    run.close()
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    @closes_runs
    def train(cfg):
        Run(cfg)
        raise RemoteRewardError("reward server http://127.0.0.1:9/score is not reachable: connection refused")

    original = cli.recipe_module
    cli.recipe_module = lambda name: types.SimpleNamespace(train=train)  # (monkeypatch is not used: one process)
    try:
        assert cli.main(["train", str(cfg_path), f"output_dir={out}", "train.max_steps=5"]) == 2
    finally:
        cli.recipe_module = original
    assert "is not reachable" in _one_error_line(capsys)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_read_only_tracker_folder_is_one_line(tracker, tmp_path, monkeypatch, capsys):
    """A tracker folder the run cannot write into (a real read-only mount) is one line naming the tracker and the
    folder, before anything trains, and the start leaves nothing behind."""
    import subprocess

    out = tmp_path / "run"
    mnt = out / tracker
    mnt.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (not root)")
    try:
        monkeypatch.chdir(REPO)
        assert cli.main(["train", FLOW, f"output_dir={out}", *SMALL, f"log.trackers=[jsonl, {tracker}]"]) == 2
        line = _one_error_line(capsys)
        assert f"log.trackers: {tracker} cannot write into {mnt} (Read-only file system)" in line, line
        assert sorted(p.name for p in out.iterdir()) == [tracker]  # the mount point the test made; nothing else
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------------------------------- pickled weights


def _pickle_weights(safetensors_file: Path, bin_name: str) -> Path:
    """Replace a safetensors weight file by a torch.save pickle that also holds an object weights_only refuses."""
    import argparse

    from safetensors.torch import load_file

    sd = load_file(str(safetensors_file))
    sd["extra"] = argparse.Namespace(note="not a tensor")
    target = safetensors_file.with_name(bin_name)
    torch.save(sd, target)
    safetensors_file.unlink()
    return target


def test_a_pickled_diffusers_model_file_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    import logging
    import shutil

    # diffusers logs two lines before it falls back to the .bin; a handler left with a stream pytest has closed
    # would print a "--- Logging error ---" traceback of its own
    monkeypatch.setattr(logging, "raiseExceptions", False)
    model = tmp_path / "model"
    shutil.copytree(REPO / "assets" / "tiny_sd3_shapes", model)
    bad = _pickle_weights(model / "transformer" / "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
    monkeypatch.chdir(REPO)
    assert cli.main(["train", FLOW, f"output_dir={tmp_path / 'run'}", *SMALL, f"model.path={model}"]) == 2
    line = _one_error_line(capsys)
    assert (f"model.path: {bad} was refused for safety: it is a pickle holding argparse.Namespace, which "
            f"torch.load(weights_only=True) does not load") in line, line
    assert not (tmp_path / "run").exists()


def test_a_pickled_transformers_model_file_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    from mmrl.tiny import build_tiny_qwen2_vl

    model = build_tiny_qwen2_vl(tmp_path / "qwen2_vl", seed=0)
    bad = _pickle_weights(model / "model.safetensors", "pytorch_model.bin")
    monkeypatch.chdir(REPO)
    assert cli.main(["train", VLM, f"output_dir={tmp_path / 'run'}", f"model.path={model}", "warm_start.steps=0"]) == 2
    line = _one_error_line(capsys)
    assert f"model.path: {bad} was refused for safety: it is a pickle holding argparse.Namespace" in line, line


def test_pickled_reward_weights_are_refused_naming_them(tmp_path):
    import argparse

    from mmrl.rewards import load
    from mmrl.rewards.image._common import load_state_dict_file
    from mmrl.tiny import build_tiny_clip

    clip = build_tiny_clip(tmp_path / "clip", seed=0)
    bad = _pickle_weights(clip / "model.safetensors", "pytorch_model.bin")
    with pytest.raises(RunError, match=rf"pickscore: {bad} was refused for safety: it is a pickle holding "
                                       r"argparse.Namespace"):
        load("pickscore", weights=clip, processor=clip, device="cpu")
    pth = tmp_path / "aesthetic.pth"  # a single-file reward head (aesthetic, HPS, ImageReward)
    torch.save({"layers.0.weight": torch.zeros(2, 2), "x": argparse.Namespace()}, pth)
    with pytest.raises(ValueError, match=rf"aesthetic: '{pth}' was refused for safety: it is a pickle holding "
                                         r"argparse.Namespace.*trust_pickle=True"):
        load_state_dict_file(pth, "aesthetic")
