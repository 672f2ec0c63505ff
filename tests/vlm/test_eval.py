"""`mmrl eval` of VLM runs, checkpoints and exports on the tiny Qwen2-VL (the demo config, 2 small steps): the
greedy accuracy equals the run's own logged eval/accuracy, every answer is written down and re-scored here, exports
(merged and peft) give the run's answers, bad input is one line; the demo prints its accuracy on every rerun; the
sample grid says its samples are training samples at the sampling temperature, beside the greedy eval accuracy."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrl import cli
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.testing import metrics_rows

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "vlm" / "grpo_tiny_shapes.yaml"
SMALL = ["data.eval_size=24", "rollout.prompts_per_step=2", "rollout.group_size=4", "warm_start.steps=10",
         "train.max_steps=2", "log.eval_every=0", "log.sample_every=1", "log.num_samples=4",
         "update.micro_batch_size=8", "rollout.micro_batch_size=8"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm_eval") / "qwen2_vl", seed=0)


def _train(tiny, out, *extra):
    """2 GRPO steps of the demo config (full fine-tuning after a 10-step warm start); (summary, sample grid titles)."""
    from mmrl.run.directory import Run
    from mmrl.vlm import grpo

    titles, save = {}, Run.save_samples

    def spy(self, step, images, captions=None, name=None, title=None):
        titles[step] = title
        return save(self, step, images, captions, name, **({"title": title} if title is not None else {}))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Run, "save_samples", spy)
        summary = grpo.train(load_config(DEMO, [f"output_dir={out}", f"model.path={tiny}", *SMALL, *extra]))
    return summary, titles


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "full"
    summary, titles = _train(tiny, out)
    return out, summary, titles


def _eval(capsys, *argv):
    assert main(["eval", *map(str, argv)]) == 0
    printed = json.loads(capsys.readouterr().out)
    out = Path(printed["out_dir"])
    report = json.loads((out / "eval_report.json").read_text())
    assert {k: report[k] for k in printed} == printed
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    return report, answers


def _logged(out):
    return [r for r in metrics_rows(out) if "eval/accuracy" in r][-1]


def test_vlm_eval_of_a_run_equals_its_logged_accuracy_and_writes_every_answer(run, tmp_path, capsys):
    from mmrl import rewards
    from mmrl.vlm.rollout_collect import build_data

    out, _, _ = run
    report, answers = _eval(capsys, out)  # the run directory: its newest checkpoint, its config.yaml
    logged = _logged(out)
    assert logged["step"] == 2 and 0 < logged["eval/accuracy"] < 1  # a number that could differ
    assert report["metrics"] == {"eval/accuracy": logged["eval/accuracy"]} == {"eval/accuracy": report["accuracy"]}
    assert report["out_dir"] == str(out / "eval" / "step_2")
    pol = report["policy"]
    weights = out / "checkpoints" / "step_2" / "adapters" / "default" / "model.safetensors"
    assert (pol["step"], pol["mode"], pol["weights"]) == (2, "full", str(weights))
    # every answer, re-scored here from the file alone; the questions and images are the run's eval set
    items = build_data(load_config(out / "config.yaml"))[1]
    assert [a["prompt"] for a in answers] == [it.prompt for it in items] and len(items) == 24
    scored = rewards.load("exact_match")(completions=[a["response"] for a in answers],
                                         metadata=[{"answer": a["answer"]} for a in answers])
    assert [a["answer"] for a in answers] == [it.metadata["answer"] for it in items]
    assert [a["reward"] for a in answers] == scored.scores.tolist() == [a["correct"] for a in answers]
    assert [a["components"] for a in answers] == [{"exact_match": s} for s in scored.scores.tolist()]
    assert [a["parsed"] for a in answers] == scored.details["extracted"]
    assert sum(a["correct"] for a in answers) / 24 == pytest.approx(report["accuracy"])
    assert report["components"]["exact_match"]["mean"] == pytest.approx(report["accuracy"])
    for a, it in zip(answers, items):
        assert np.array_equal(np.array(Image.open(report["out_dir"] + "/" + a["images"][0])), np.array(it.images[0]))
    # CONFIG --checkpoint STEP_DIR: the same policy; --max-prompts: the first questions, the same answers
    report2, first = _eval(capsys, out / "config.yaml", "--checkpoint", out / "checkpoints" / "step_2",
                           "--out", tmp_path / "first", "--max-prompts", 8)
    assert [a["response"] for a in first] == [a["response"] for a in answers[:8]]
    assert report2["policy"]["sha256"] == pol["sha256"] and report2["num_evaluated"] == 8


def test_vlm_exports_evaluate_to_the_runs_answers(run, tiny, tmp_path, capsys):
    """A merged (transformers) export of the full fine-tuning run and a peft export of a LoRA run: mmrl eval gives
    the accuracy each run logged and the answers of its checkpoint; the config comes from the checkpoint the export
    was made from, or --config when that is gone."""
    from mmrl.export import export

    out, _, _ = run
    _, answers = _eval(capsys, out, "--out", tmp_path / "ckpt")
    export(out, "transformers", tmp_path / "merged")
    report, merged = _eval(capsys, tmp_path / "merged")
    assert report["accuracy"] == _logged(out)["eval/accuracy"]
    assert [a["response"] for a in merged] == [a["response"] for a in answers]
    assert report["policy"]["format"] == "transformers" and report["out_dir"] == str(out / "eval" / "export_merged")

    lora = tmp_path / "lora"
    _train(tiny, lora, "model.lora.rank=4", "model.lora.alpha=8", "warm_start.params=[]", "log.sample_every=0")
    capsys.readouterr()
    _, lora_answers = _eval(capsys, lora, "--out", tmp_path / "lora_ckpt")
    export(lora, "peft", tmp_path / "peft")
    report, peft = _eval(capsys, tmp_path / "peft", "--out", tmp_path / "peft_eval")
    assert report["accuracy"] == _logged(lora)["eval/accuracy"]
    assert [a["response"] for a in peft] == [a["response"] for a in lora_answers]
    # the checkpoint the export came from is gone: one line asking for the config, then --config
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "peft", moved)
    meta = json.loads((moved / "mmrl_export.json").read_text())
    meta["source"]["checkpoint"] = str(tmp_path / "gone" / "checkpoints" / "step_2" / "adapters" / "default")
    (moved / "mmrl_export.json").write_text(json.dumps(meta))
    gone = tmp_path / "gone" / "checkpoints" / "step_2" / "config.yaml"
    _one_line_error(capsys, ["eval", str(moved)], f"mmrl eval {moved}: the export holds no training config and its "
                    f"checkpoint's config.yaml is gone ({gone}); pass --config CONFIG.yaml, the config the run was "
                    f"trained with")
    report, again = _eval(capsys, moved, "--config", lora / "config.yaml", "--out", tmp_path / "moved_eval")
    assert again == peft


def _one_line_error(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    return err


def test_vlm_eval_errors_are_one_line(run, tmp_path, capsys):
    out, _, _ = run
    cfg = str(out / "config.yaml")
    _one_line_error(capsys, ["eval", str(out), "--prompts", "p.txt"], "mmrl eval: --prompts is an option of the "
                    "diffusion evaluation; a vlm_grpo evaluation uses the run's own eval set")
    _one_line_error(capsys, ["eval", str(out), "--seed", "3"], "--seed is an option of the diffusion evaluation")
    _one_line_error(capsys, ["eval", cfg, "--checkpoint", str(tmp_path / "nowhere")], "nowhere: not found")
    _one_line_error(capsys, ["eval", str(tmp_path / "nowhere")], "not found (expected CONFIG.yaml, a run directory")
    _one_line_error(capsys, ["eval", str(out), "--checkpoint", str(out)], "--checkpoint goes with a config file")
    _one_line_error(capsys, ["eval", cfg, "--config", cfg], "both given; pass one")
    _one_line_error(capsys, ["eval", str(out), "--state", "old"], "no policy state 'old' (saved: ['default']")
    # a VLM checkpoint under a diffusion config (or the reverse): named before any model loads
    diffusion = ROOT / "configs" / "diffusion" / "flow_grpo_tiny.yaml"
    _one_line_error(capsys, ["eval", str(diffusion), "--checkpoint", str(out)],
                    f"--checkpoint {out} was written by vlm_grpo (vlm) per its "
                    f"{out / 'checkpoints' / 'step_2' / 'config.yaml'}, but the config {diffusion} is flow_grpo "
                    f"(diffusion)")
    fake = tmp_path / "lora_export"
    fake.mkdir()
    (fake / "mmrl_export.json").write_text(json.dumps({"format": "diffusers-lora"}))
    _one_line_error(capsys, ["eval", str(fake)], "a diffusers-lora export (diffusion); mmrl eval scores the run it "
                                                 "came from")
    _one_line_error(capsys, ["eval", cfg, f"model.path={tmp_path / 'no_model'}", f"output_dir={tmp_path / 'o'}"],
                    "model.path: no config.json in")
    assert not (tmp_path / "o").exists()  # nothing written before the failure


def test_vlm_eval_of_a_run_on_a_read_only_mount_is_one_line(run, tmp_path, capsys):
    out, _, _ = run
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        shutil.copytree(out, mnt / "run", ignore=shutil.ignore_patterns("eval"))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        _one_line_error(capsys, ["eval", str(mnt / "run")],
                        f"mmrl: error: mmrl eval: cannot write into {mnt / 'run' / 'eval' / 'step_2'} (Read-only file "
                        f"system); pass --out DIR, a directory on a writable disk")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_sample_grids_say_they_are_training_samples_beside_the_greedy_accuracy(run):
    from mmrl.run.plots import make_image_grid

    out, summary, titles = run
    first, last = summary["eval_accuracy_first"], _logged(out)["eval/accuracy"]
    assert titles == {
        1: f"training samples of step 1, sampled at temperature 1 (not greedy answers); greedy eval accuracy "
           f"{first:.3f} (step 0)",
        2: f"training samples of step 2, sampled at temperature 1 (not greedy answers); greedy eval accuracy "
           f"{last:.3f} (step 2)"}
    images = [Image.new("RGB", (8, 8), "white")] * 2
    plain = np.array(make_image_grid(images, ["a", "b"]))
    titled = np.array(make_image_grid(images, ["a", "b"], title=titles[1]))
    top = titled.shape[0] - plain.shape[0]  # the title's band above the cells: 3 lines of 12 px at this width
    assert top == 3 * 12 + 4 and np.array_equal(titled[top:], plain) and (titled[:top] < 128).any()


def test_demo_rerun_prints_the_accuracy_line_again(tmp_path, capsys):
    """`make demo` twice: the second run resumes at its last step and trains nothing, and still reports the greedy
    eval accuracy (before RL, kept in the checkpoint; last, from the run's last evaluation)."""
    small = ["train.max_steps=1", "warm_start.steps=2", "data.eval_size=8", "rollout.prompts_per_step=2",
             "rollout.group_size=2", "log.sample_every=0", "log.eval_every=0"]
    lines = []
    for _ in range(2):
        assert cli.main(["demo", "vlm", "--output-dir", str(tmp_path), *small]) == 0
        lines.append([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("== vlm: ")])
    assert len(lines[0]) == 1 and lines[0][0].startswith("== vlm: greedy eval accuracy ")
    assert lines[1] == lines[0]
    assert len(metrics_rows(tmp_path / "demo_vlm")) == 1  # the rerun trained no step


def test_vlm_eval_of_a_multiturn_run_equals_its_logged_eval_metrics(tiny, tmp_path, capsys):
    """vlm_multiturn: greedy episodes on the eval seeds give the eval/* metrics the run logged at its last step;
    one row per episode with each turn's response and reward."""
    from mmrl.vlm.multiturn import train

    out = tmp_path / "mt"
    train(load_config({
        "algorithm": "vlm_multiturn", "output_dir": str(out), "seed": 0, "device": "cpu", "num_threads": 1,
        "model": {"path": str(tiny)}, "env": {"tasks": {"grid_puzzle": {"width": 5, "max_turns": 2}},
                                              "eval_episodes": 6, "max_workers": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_turns": 2, "max_new_tokens": 3, "max_seq_len": 256},
        "algo": {"advantage": "turn_grpo", "dynamic_sampling": False}, "optim": {"lr": 0.01},
        "warm_start": {"steps": 5, "batch_size": 4}, "update": {"micro_batch_size": 2, "mini_batch_size": 2},
        "train": {"max_steps": 1, "save_every": 1}}))
    capsys.readouterr()
    logged = metrics_rows(out)[-1]
    assert main(["eval", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["eval/success_rate"] == logged["eval/success_rate"]
    report = json.loads((out / "eval" / "step_1" / "eval_report.json").read_text())
    episodes = [json.loads(line) for line in (out / "eval" / "step_1" / "episodes.jsonl").read_text().splitlines()]
    assert logged["step"] == 1 and report["metrics"] == {k: v for k, v in logged.items() if k.startswith("eval/")}
    assert len(episodes) == 6 and [e["seed"] for e in episodes] == [10**7 + i for i in range(6)]
    assert report["success_rate"] == sum(e["success"] for e in episodes) / 6 == logged["eval/success_rate"]
    assert all(e["turns"] and all(isinstance(t["response"], str) for t in e["turns"]) for e in episodes)
    _one_line_error(capsys, ["eval", str(out), "--max-prompts", "2"], "--max-prompts: vlm_multiturn evaluates "
                    "env.eval_episodes episodes per task; pass env.eval_episodes=N instead")
