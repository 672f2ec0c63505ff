"""What a newcomer meets first: the demo's result lines, the reward curve, sample grids, `mmrl eval`'s output place,
`dist.strategy: auto` under torchrun, `make ... TORCH=cpu`, and user docs free of internal history."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mmrl import cli
from mmrl.config import load_config
from mmrl.run.plots import caption_lines, make_image_grid, plot_reward_curve
from mmrl.testing import child_env, metrics_rows, run_torchrun
from mmrl.training.summary import reward_axis

ROOT = Path(__file__).resolve().parents[1]
TINY_DIFFUSION = ["train.save_every=1", "rollout.num_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                  "rollout.eval_num_steps=2", "log.eval_every=0", "log.num_samples=4"]


# ------------------------------------------------------------------------------------------ demo result lines
def test_demo_result_lines_say_what_each_number_is():
    vlm = load_config(ROOT / "configs/vlm/grpo_tiny_shapes.yaml")
    line = cli.demo_result_line("vlm", {"reward_first": 0.17, "reward_last": 0.5, "eval_accuracy_first": 0.115,
                                        "eval_accuracy_last": 1.0}, vlm)
    assert line.startswith("greedy eval accuracy 0.115 -> 1.000; ")
    assert "train reward (exact_match: 1 = correct, sampled rollouts) first 5 steps 0.17 -> last 5 steps 0.5" in line
    diff = load_config(ROOT / "configs/diffusion/flow_grpo_tiny.yaml")
    line = cli.demo_result_line("diffusion", {"reward_first5": 2.01, "reward_last5": 3.0, "reward_rise_in_std": 3.1},
                                diff)
    assert "train reward (jpeg_incompressibility: JPEG kB, sampled rollouts) first 5 steps 2.01 -> last 5 steps 3" in line
    assert line.endswith("= +3.1 std of the first steps (the demo expects > 2: met)")
    short = cli.demo_result_line("diffusion", {"reward_first5": 2.0, "reward_last5": 2.0, "reward_rise_in_std": 0.0},
                                 diff)
    assert short.endswith("(the demo expects > 2: not met)")


# ------------------------------------------------------------------------------------------ the reward curve
def test_reward_axis_comes_from_the_rewards_units_and_ranges():
    assert reward_axis(load_config(ROOT / "configs/diffusion/flow_grpo_tiny.yaml")) == {
        "unit": "jpeg_incompressibility: JPEG kB", "value_range": (0.0, None)}
    assert reward_axis(load_config(ROOT / "configs/vlm/grpo_tiny_shapes.yaml")) == {
        "unit": "exact_match: 1 = correct", "value_range": (0.0, 1.0)}
    cfg = load_config(ROOT / "configs/diffusion/flow_grpo_tiny.yaml",
                      ["reward.components={prompt_color: 2.0, clip: {reward: jpeg_compressibility, weight: -0.5}}"])
    # by hand: 2 * [0, 1] + (-0.5) * (-inf, 0] = [0, inf)
    assert reward_axis(cfg) == {"unit": "weighted sum: 2*prompt_color + -0.5*clip", "value_range": (0.0, None)}
    vlm = load_config(ROOT / "configs/vlm/grpo_tiny_shapes.yaml",
                      ["reward.name=composite", "reward.kwargs={components: {exact_match: 0.9, format: 0.1}}"])
    assert reward_axis(vlm)["value_range"] == pytest.approx((0.0, 1.0))
    assert reward_axis(load_config(ROOT / "configs/vlm/multiturn_grid_tiny.yaml"))["unit"] == "episode return"
    wan = load_config(ROOT / "configs/diffusion/flow_grpo_wan_tiny.yaml",
                      ["reward.components={motion_amount: 0.5, temporal_consistency: 1.0}"])
    assert reward_axis(wan)["value_range"] == pytest.approx((-1.0, 1.5))  # by hand: 0.5 * [0, 1] + [-1, 1]
    # offline DPO logs the implicit reward margin as reward/mean (it has no reward model)
    assert reward_axis(load_config(ROOT / "configs/diffusion/dpo_tiny_offline.yaml"))["unit"] == \
        "implicit reward margin of the preference pairs"


def test_reward_curve_clips_the_band_names_the_unit_and_draws_eval_accuracy(tmp_path, monkeypatch):
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    rows = [{"step": s, "reward/mean": m, "reward/std": 0.45} for s, m in ((1, 0.1), (2, 0.5), (3, 0.9))]
    rows[0]["eval/accuracy"], rows[2]["eval/accuracy"] = 0.115, 1.0
    assert plot_reward_curve(rows, tmp_path / "c.png", unit="exact_match: 1 = correct", value_range=(0.0, 1.0))
    fig = figures[-1]
    ax, ax2 = fig.axes
    assert ax.get_ylabel() == "reward (exact_match: 1 = correct)" and ax2.get_ylabel() == "eval accuracy (greedy)"
    band = next(c for c in ax.collections)  # fill_between: the +- std band
    ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
    assert ys.min() == pytest.approx(0.0) and ys.max() == pytest.approx(1.0)  # 0.1 - 0.45 and 0.9 + 0.45 clipped
    assert [tuple(xy) for xy in ax2.lines[0].get_xydata()] == [(1.0, 0.115), (3.0, 1.0)]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["train reward (sampled rollouts)", "+- 1 std over samples", "eval accuracy (greedy)"]
    figures.clear()
    plot_reward_curve(rows, tmp_path / "d.png")  # no range: the band is not clipped
    band = next(c for c in figures[-1].axes[0].collections)
    ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
    assert ys.min() == pytest.approx(0.1 - 0.45) and ys.max() == pytest.approx(0.9 + 0.45)


# ------------------------------------------------------------------------------------------ sample grids
def test_captions_wrap_at_words_and_keep_the_reward_first():
    assert caption_lines("r=0.123 | a red circle on a blue background", 21, 6) == [
        "r=0.123 | a red", "circle on a blue", "background"]
    assert caption_lines("r=1 | " + "word " * 40, 20, 2)[-1].endswith("...")
    import torch

    grid = make_image_grid(torch.rand(2, 3, 8, 8), ["r=0.1 | a long prompt " * 4, "r=0.2 | short"])
    assert grid.size[1] > 128  # cells 128 px high plus the wrapped caption lines


def test_sample_grid_forwards_are_not_training_cost():
    import torch

    from mmrl.diffusion.common import TransformerEvalCounter, not_counted

    layer = torch.nn.Linear(3, 3)
    counter = TransformerEvalCounter(layer)
    layer(torch.zeros(4, 3))
    with not_counted():
        layer(torch.zeros(5, 3))
    layer(torch.zeros(2, 3))
    assert counter.count == 6


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """Two Flow-GRPO steps on the tiny SD3 with a grid every step; the captions each grid got, by step."""
    import mmrl

    seen: dict[int, list[str]] = {}

    class Grids:
        def on_samples(self, step, name, images, captions):
            if name == "rollout":
                seen[step] = captions

    out = tmp_path_factory.mktemp("grids") / "run"
    mmrl.Trainer(args=ROOT / "configs/diffusion/flow_grpo_tiny.yaml", model=ROOT / "assets/tiny_sd3_shapes",
                 output_dir=out, overrides=["train.max_steps=2", "log.sample_every=1", "optim.lr=0.05",
                                            f"data.train_prompts={ROOT}/assets/prompts/shapes_train.txt",
                                            f"data.eval_prompts={ROOT}/assets/prompts/shapes_eval.txt",
                                            *TINY_DIFFUSION],
                 callbacks=[Grids()]).train()
    return out, seen


@pytest.mark.slow
def test_sample_grids_show_fixed_prompts_from_step_0_with_the_reward(grid_run):
    out, seen = grid_run
    assert sorted(p.name for p in (out / "samples").glob("step_*.png")) == [
        "step_000000.png", "step_000001.png", "step_000002.png"]
    eval_prompts = [ln for ln in (ROOT / "assets/prompts/shapes_eval.txt").read_text().splitlines()
                    if ln.strip() and not ln.startswith("#")][:4]
    for step, captions in seen.items():  # the same prompts in every grid, each captioned with its reward
        assert [c.split(" | ", 1)[1] for c in captions] == eval_prompts, step
        assert all(re.match(r"^reward [-0-9.e]+ \| ", c) for c in captions)
    rewards = {step: [c.split(" | ")[0] for c in caps] for step, caps in seen.items()}
    assert rewards[0] != rewards[2]  # the policy moved (lr 0.05): same prompts and noise, other images


@pytest.mark.slow
def test_eval_of_a_run_writes_into_that_run(grid_run, tmp_path, monkeypatch, capsys):
    """`mmrl eval CONFIG --checkpoint RUN` writes RUN/eval/step_N, wherever the config's output_dir points."""
    out, _ = grid_run
    monkeypatch.chdir(tmp_path)
    assert cli.main(["eval", str(out / "config.yaml"), "--checkpoint", str(out), "--max-prompts", "1",
                     "output_dir=elsewhere"]) == 0
    report = json.loads((out / "eval" / "step_2" / "eval_report.json").read_text())
    assert report["policy"]["step"] == 2 and f'"out_dir": "{out / "eval" / "step_2"}"' in capsys.readouterr().out
    assert not (tmp_path / "elsewhere").exists()


def test_default_eval_directory_by_hand(tmp_path):
    from mmrl.eval.harness import default_out_dir

    cfg = load_config(ROOT / "configs/diffusion/flow_grpo_tiny.yaml", [f"output_dir={tmp_path / 'cfg_out'}"])
    run_adapters = tmp_path / "myrun" / "checkpoints" / "step_7" / "adapters"
    assert default_out_dir(cfg, run_adapters, "step_7") == tmp_path / "myrun" / "eval" / "step_7"
    assert default_out_dir(cfg, tmp_path / "loose" / "adapters", "checkpoint") == tmp_path / "cfg_out" / "eval" / \
        "checkpoint"
    assert default_out_dir(cfg, None, "base") == tmp_path / "cfg_out" / "eval" / "base"


# ------------------------------------------------------------------------------------------ launchers, make
@pytest.mark.slow
def test_torchrun_without_a_strategy_trains_data_parallel(tmp_path):
    """`torchrun --nproc_per_node 2 -m mmrl.cli train CFG` with no dist.strategy: auto -> ddp, said at start-up;
    `dist.strategy=none` under the same launch is still refused with one line."""
    out = tmp_path / "run"
    args = ["-m", "mmrl.cli", "train", "configs/diffusion/flow_grpo_tiny.yaml", f"output_dir={out}",
            "train.max_steps=2", "log.sample_every=0", "dist.backend=gloo", *TINY_DIFFUSION]
    proc = run_torchrun(args, cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[mmrl] dist.strategy: auto -> ddp (2 processes launched)" in proc.stdout
    assert [r["step"] for r in metrics_rows(out)] == [1, 2]
    assert load_config(out / "config.yaml").dist.strategy == "ddp"  # the run records what it did
    refused = run_torchrun([*args, f"output_dir={tmp_path / 'none'}", "dist.strategy=none"], cwd=ROOT,
                           env=child_env())
    assert refused.returncode != 0 and "dist.strategy is 'none': use dist.strategy=auto or ddp" in refused.stderr


def test_one_process_auto_is_none_and_said_so(tmp_path, capsys):
    from mmrl.run.start import start_run

    cfg = load_config(ROOT / "configs/diffusion/flow_grpo_tiny.yaml", [f"output_dir={tmp_path}"])
    assert cfg.dist.strategy == "auto"
    ctx, run = start_run(cfg)
    ctx.close()
    assert cfg.dist.strategy == "none" and "[mmrl] dist.strategy: auto -> none (one process)" in capsys.readouterr().out


def test_make_with_torch_cpu_installs_the_cpu_build_first(tmp_path):
    """`make demo TORCH=cpu` in a fresh clone (dry run): the CPU torch / torchvision pair, pinned with its `+cpu`
    label (no CUDA build or other release can stand in) from PyTorch's CPU index, before mmrl; then the install check,
    then the stamp. Without TORCH=cpu only the CPU pair is left out."""
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).symlink_to(ROOT / name)
    cpu = subprocess.run(["make", "-n", "demo", "TORCH=cpu"], cwd=tmp_path, capture_output=True, text=True)
    plain = subprocess.run(["make", "-n", "demo"], cwd=tmp_path, capture_output=True, text=True)
    assert cpu.returncode == 0 and plain.returncode == 0, cpu.stderr + plain.stderr
    lines = cpu.stdout.splitlines()
    torch_line = next(i for i, ln in enumerate(lines) if "--index-url https://download.pytorch.org/whl/cpu" in ln)
    assert lines[torch_line].startswith(".venv/bin/pip install -q torch==2.14.1+cpu torchvision==0.29.1+cpu ")
    order = [torch_line] + [next(i for i, ln in enumerate(lines) if ln == want) for want in (
        '.venv/bin/pip install -q -e ".[dev]"', ".venv/bin/python -m mmrl.install_check",
        "touch .venv/.mmrl-install-checked", ".venv/bin/mmrl demo")]
    assert order == sorted(order)
    assert "download.pytorch.org" not in plain.stdout
    assert [ln for ln in plain.stdout.splitlines() if "mmrl.install_check" in ln or "touch" in ln] == [
        ".venv/bin/python -m mmrl.install_check", "touch .venv/.mmrl-install-checked"]


# stand-ins for .venv/bin/pip and .venv/bin/python: each call is logged; FAKE_PIP_FAIL (a word of the arguments)
# fails that pip call, FAKE_CHECK_FAIL is the line the install check prints before it fails
_FAKE_PIP = """#!/bin/sh
echo "pip $*" >> "$LOG"
[ -n "$FAKE_PIP_FAIL" ] && case " $* " in *" $FAKE_PIP_FAIL "*) echo "ERROR: no distribution" >&2; exit 1;; esac
exit 0
"""
_FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$LOG"
[ -n "$FAKE_CHECK_FAIL" ] && { echo "$FAKE_CHECK_FAIL" >&2; exit 1; }
echo "mmrl: install check passed: fake"
"""


def test_make_install_writes_its_stamp_only_after_pip_and_the_check_pass(tmp_path):
    """`make install` with stand-in pip and python: an unreachable CPU index stops it with one line and installs
    nothing else; a failing install check stops it (make fails) and removes an older stamp, so the next make
    checks again; only a passing check writes the stamp."""
    import os

    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for name, text in (("pip", _FAKE_PIP), ("python", _FAKE_PYTHON)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    stamp, log = tmp_path / ".venv" / ".mmrl-install-checked", tmp_path / "calls.log"

    def make(*args, **fake):
        log.write_text("")
        env = {**os.environ, "LOG": str(log), "FAKE_PIP_FAIL": "", "FAKE_CHECK_FAIL": "", **fake}
        proc = subprocess.run(["make", "-s", "install", *args], cwd=tmp_path, env=env, capture_output=True, text=True)
        return proc, log.read_text().splitlines()

    proc, calls = make("TORCH=cpu", FAKE_PIP_FAIL="torch==2.14.1+cpu")
    assert proc.returncode != 0 and not stamp.exists()
    assert calls == ["pip install -q torch==2.14.1+cpu torchvision==0.29.1+cpu --index-url "
                     "https://download.pytorch.org/whl/cpu"]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("mmrl:")] == [
        "mmrl: install failed: pip found no torch==2.14.1+cpu torchvision==0.29.1+cpu at "
        "https://download.pytorch.org/whl/cpu (its error is above: unreachable?) and installed nothing in their "
        "place; fix: check the network or proxy and rerun, or take the CUDA build: make install (about 6.7 GB)"]

    stamp.write_text("")
    os.utime(stamp, (0, 0))  # a stamp older than pyproject.toml: the install runs again
    failure = "mmrl: install check failed: torchvision 0.28.0 does not pair with torch 2.14.1; fix: rm -rf .venv"
    proc, calls = make(FAKE_CHECK_FAIL=failure)
    assert proc.returncode != 0 and not stamp.exists() and failure in proc.stderr.splitlines()
    assert calls == ['pip install -q -e .[dev]', "python -m mmrl.install_check"]
    proc, calls = make(FAKE_CHECK_FAIL=failure)  # no stamp: checked again, not taken as installed
    assert proc.returncode != 0 and calls[-1] == "python -m mmrl.install_check"

    proc, calls = make()
    assert proc.returncode == 0 and stamp.exists() and calls[-1] == "python -m mmrl.install_check"
    assert make()[1] == []  # installed and checked: nothing runs


# ------------------------------------------------------------------------------------------ user docs
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_user_docs_describe_the_library_not_its_history():
    history = re.compile(r"\bissue\s*#?\d+|\bround[- ]\d\b|\brefactor(ing)?\b", re.I)
    found = [f"{p.name}:{i}: {m.group(0)}" for p in USER_DOCS
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in history.finditer(line)]
    assert found == []


def test_every_environment_variable_mmrl_reads_is_documented():
    names = set()
    for path in (ROOT / "mmrl").rglob("*.py"):
        names |= set(re.findall(r"[\"'](MMRL_[A-Z_]+)[\"']", path.read_text()))
    docs = "\n".join(p.read_text() for p in USER_DOCS)
    assert names and sorted(n for n in names if not re.search(rf"`\$?{n}\b", docs)) == []


@pytest.mark.slow
def test_readme_python_quickstarts_run_as_written(tmp_path, monkeypatch, capsys):
    """README.md's two Python quickstarts (text-to-image, vision-language), executed as written in a scratch dir
    that sees the checkout's assets: each trains, the LoRA export exists, the VLM evaluation reports its accuracy."""
    from mmrl.testing import metrics_rows

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 2, "README.md: the text-to-image and the VLM quickstart"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets").symlink_to(ROOT / "assets")
    exec(compile(blocks[0], "README.md (text-to-image quickstart)", "exec"), {})
    assert [r["step"] for r in metrics_rows(tmp_path / "runs" / "quickstart_t2i")] == [1, 2]
    assert (tmp_path / "runs" / "quickstart_t2i-lora" / "pytorch_lora_weights.safetensors").is_file()
    capsys.readouterr()
    exec(compile(blocks[1], "README.md (VLM quickstart)", "exec"), {})
    assert [r["step"] for r in metrics_rows(tmp_path / "runs" / "quickstart_vlm") if r["step"] > 0] == [1, 2]
    assert "'eval/accuracy'" in capsys.readouterr().out
