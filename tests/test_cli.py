import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mmrl import cli
from mmrl import config as C
from mmrl.config import RunConfig, TrainConfig


@dataclass
class ToyTrain(TrainConfig):
    lr: float = 0.1
    """Learning rate."""


@dataclass
class ToyConfig(RunConfig):
    train: ToyTrain = field(default_factory=ToyTrain)
    """Train section."""


@pytest.fixture
def toy(monkeypatch, tmp_path):
    calls = []
    mod = types.ModuleType("mmrl_toy_cli")
    mod.Config = ToyConfig

    def train(cfg):
        calls.append(cfg)
        return {"lr": cfg.train.lr}

    mod.train = train
    monkeypatch.setitem(sys.modules, "mmrl_toy_cli", mod)
    monkeypatch.setitem(C.RECIPES, "toy", "mmrl_toy_cli")
    p = tmp_path / "toy.yaml"
    p.write_text(f"algorithm: toy\noutput_dir: {tmp_path / 'run'}\n")
    return p, calls


def test_train_dispatch_with_overrides(toy, capsys):
    path, calls = toy
    assert cli.main(["train", str(path), "train.lr=0.25", "train.max_steps=2"]) == 0
    assert calls[0].train.lr == 0.25 and calls[0].train.max_steps == 2
    assert '"lr": 0.25' in capsys.readouterr().out


def test_misspelled_key_is_a_clean_error(toy, capsys):
    path, calls = toy
    path.write_text("algorithm: toy\ntrain:\n  lrr: 1\n")
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.lrr'" in err and "valid keys" in err and "Traceback" not in err
    assert not calls


def test_config_dump_and_check(toy, capsys, tmp_path):
    path, _ = toy
    assert cli.main(["config", "check", str(path), "seed=3"]) == 0
    assert "seed: 3" in capsys.readouterr().out
    # dump: commented YAML of a real recipe's defaults that loads back to the same config
    assert cli.main(["config", "dump", "toy"]) == 0
    dumped = capsys.readouterr().out
    assert "# Learning rate.\n  lr: 0.1\n" in dumped and "algorithm: toy" in dumped
    (tmp_path / "dumped.yaml").write_text(dumped)
    assert C.load_config(tmp_path / "dumped.yaml") == C.default_config("toy")


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "mmrl.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "config" in out.stdout


def test_version_names_mmrl_the_torch_stack_and_the_device_build(capsys, monkeypatch):
    import platform

    import torch

    import mmrl
    from mmrl import install_check

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    out = capsys.readouterr().out.splitlines()
    assert exit_.value.code == 0 and len(out) == 2
    assert out[0] == f"mmrl {mmrl.__version__} (Python {platform.python_version()}, {Path(mmrl.__file__).parent})"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    assert out[1].startswith(f"torch {torch.__version__} ({build} build") and ", diffusers " in out[1]

    monkeypatch.setattr(install_check, "check", lambda: install_check.Outcome(False, "mmrl: install check failed: x"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 1 and capsys.readouterr().err == "mmrl: install check failed: x\n"


@pytest.mark.slow
def test_tiny_head_dim_option(tmp_path, capsys):
    """`mmrl tiny DIR --head-dim 64` (docs/scaling.md): the Qwen2-VL / Qwen2.5-VL text decoders get 64-wide heads,
    the other models are built as usual."""
    import json

    assert cli.main(["tiny", str(tmp_path), "--head-dim", "64"]) == 0
    paths = json.loads(capsys.readouterr().out)
    for name in ("qwen2_vl", "qwen25_vl"):
        text = json.loads((Path(paths[name]) / "config.json").read_text())["text_config"]
        assert text["hidden_size"] // text["num_attention_heads"] == 64, name
    qwen3 = json.loads((Path(paths["qwen3_vl"]) / "config.json").read_text())["text_config"]
    assert qwen3["head_dim"] == 16 and (Path(paths["sd3"]) / "model_index.json").is_file()


def test_tiny_into_a_file_is_a_clean_error(tmp_path, capsys):
    f = tmp_path / "not_a_dir.txt"
    f.write_text("x")
    assert cli.main(["tiny", str(f)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------- one-line config errors

REPO = Path(__file__).resolve().parents[1]
FLOW, NFT = "configs/diffusion/flow_grpo_tiny.yaml", "configs/diffusion/nft_tiny.yaml"
DPO_ON, DPO_OFF = "configs/diffusion/dpo_tiny_online.yaml", "configs/diffusion/dpo_tiny_offline.yaml"
VLM, MT = "configs/vlm/grpo_tiny_shapes.yaml", "configs/vlm/multiturn_grid_tiny.yaml"

BAD_CONFIGS = [  # (config, overrides, the one-line message); "{tmp}" is the test's tmp_path
    (FLOW, ["rollout.prompts_per_step=0"], "rollout.prompts_per_step: expected >= 1, got 0"),  # IndexError before
    (FLOW, ["rollout.height=0"], "rollout.height: expected >= 1, got 0"),
    (FLOW, ["rollout.num_steps=0"], "rollout.num_steps: expected >= 1, got 0"),
    (FLOW, ["rollout.micro_batch_size=-1"], "rollout.micro_batch_size: expected >= 0, got -1"),
    (FLOW, ["model.max_sequence_length=-1"], "model.max_sequence_length: expected >= 0, got -1"),
    (FLOW, ["log.num_samples=0"], "log.num_samples: expected >= 1, got 0"),
    (FLOW, ["data.train_prompts={tmp}/gone.txt"], "data.train_prompts: prompt file not found: {tmp}/gone.txt"),
    (FLOW, ["data.eval_prompts={tmp}/gone.txt"], "data.eval_prompts: prompt file not found: {tmp}/gone.txt"),
    (NFT, ["rollout.prompts_per_step=0"], "rollout.prompts_per_step: expected >= 1, got 0"),
    (NFT, ["rollout.width=-8"], "rollout.width: expected >= 1, got -8"),
    (DPO_ON, ["rollout.prompts_per_step=0"], "rollout.prompts_per_step: expected >= 1, got 0"),
    (DPO_ON, ["data.train_prompts={tmp}/gone.txt"], "data.train_prompts: prompt file not found: {tmp}/gone.txt"),
    (DPO_OFF, ["data.preference_file={tmp}/gone.jsonl"], "data.preference_file: preference file not found"),
    (DPO_OFF, ["data.preference_file={tmp}/pairs.jsonl", "data.image_root={tmp}/no_images"],
     "data.image_root: image folder not found: {tmp}/no_images"),
    (VLM, ["rollout.prompts_per_step=0"], "rollout.prompts_per_step: expected >= 1, got 0"),
    (VLM, ["rollout.prompts_per_step=-2"], "rollout.prompts_per_step: expected >= 1, got -2"),
    (VLM, ["rollout.group_size=1"], "rollout.group_size=1: algo.advantage=grpo compares the responses to one prompt"),
    (VLM, ["rollout.group_size=1", "algo.advantage=rloo"], "rollout.group_size=1: algo.advantage=rloo"),
    (VLM, ["rollout.group_size=1", "algo.advantage=reinforce_pp", "algo.dynamic_sampling=true"],
     "rollout.group_size=1: algo.dynamic_sampling keeps only groups whose rewards differ"),
    (VLM, ["rollout.engine=vllm"], "rollout.engine=vllm: vLLM is not installed"),
    (VLM, ["rollout.top_p=0"], "rollout.top_p: expected 0 < top_p <= 1, got 0"),
    (VLM, ["data.image_size=0"], "data.image_size: expected >= 4, got 0"),
    (VLM, ["data.n_shapes=[1]"], "data.n_shapes: expected [min, max], got [1]"),
    (VLM, ["data.colors=[]"], "colors, kinds and backgrounds must be non-empty"),  # a dry draw of the data
    (VLM, ["warm_start.batch_size=0"], "warm_start.batch_size: expected >= 1, got 0"),
    (VLM, ["log.num_samples=0"], "log.num_samples: expected >= 1, got 0"),
    (VLM, ["data.template={foo}"], "data.template: unknown placeholder 'foo'"),
    (VLM, ["data.template=what {question"], "data.template: 'what {question' is not a format string"),
    (VLM, ["data.kind=geo3k", "warm_start.steps=0", "data.path={tmp}/gone.jsonl"],
     "data.path: data file not found: {tmp}/gone.jsonl"),
    (MT, ["rollout.micro_batch_size=0"], "rollout.micro_batch_size: expected >= 1, got 0"),
    (MT, ["rollout.prompts_per_step=0"], "rollout.prompts_per_step: expected >= 1, got 0"),
    (MT, ["rollout.max_turns=0"], "rollout.max_turns: expected >= 1, got 0"),
    (MT, ["rollout.max_seq_len=3"], "rollout.max_seq_len: expected >= 4, got 3"),
    (MT, ["update.epochs=0"], "update.epochs: expected >= 1, got 0"),
    (MT, ["update.micro_batch_size=0"], "update.micro_batch_size: expected >= 1, got 0"),
    # overrides that are not YAML values, numbers out of range (checked while the config is read, naming the key)
    (FLOW, ["log.num_samples=[1,"], "override 'log.num_samples=[1,': the value is not valid YAML: expected the node "
                                    "content, but found '<stream end>' (line 1, column 4)"),
    (FLOW, ["log.num_samples=!!python/object/apply:os.system [echo pwned]"],
     "YAML tags that build Python objects (!!python/...) are not allowed"),
    (FLOW, ["algo.rollout_correction.is_threshold=1e300"],
     "algo.rollout_correction.is_threshold: expected a finite number within float32 range (|x| <= 3.4e+38)"),
    (FLOW, ["algo.rollout_correction.is_threshold=inf"], "algo.rollout_correction.is_threshold: expected a finite"),
    (FLOW, ["algo.rollout_correction.rs_threshold=.nan"], "algo.rollout_correction.rs_threshold: expected a finite"),
    (FLOW, ["optim.lr=-1e39"], "optim.lr: expected a finite number within float32 range"),
    (FLOW, ["seed=1.0e+30"], "seed: expected an integer within +-2**63, got 1000000000000000019884624838656"),
    (FLOW, ["algo.rollout_correction.rs_threshold_lower=5"],
     "algo.rollout_correction.rs_threshold_lower: expected 0 (= 1 / rs_threshold) or a number in (0, 1], got 5.0"),
    (FLOW, ["algo.rollout_correction.veto_threshold=2"],
     "algo.rollout_correction.veto_threshold: expected 0 (off) or a number in (0, 1), got 2.0"),
    (NFT, ["algo.adv_clip_max=0"], "algo.adv_clip_max: expected > 0, got 0.0"),
    (VLM, ["algo.rollout_correction.is_threshold=1e300"], "algo.rollout_correction.is_threshold: expected a finite"),
    (VLM, ["algo.clip_low=1.5"], "algo.clip_low: expected 0 <= clip_low < 1, got 1.5"),
    (VLM, ["algo.dual_clip=0.5"], "algo.dual_clip: expected 0 (off) or a constant > 1"),
    (MT, ["algo.clip_low=-0.1"], "algo.clip_low: expected 0 <= clip_low < 1, got -0.1"),
    # reward components and other mapping entries from the command line: checked like the YAML
    (FLOW, ["reward.components.pikscore.weights=/ckpt"], "reward.components.pikscore: unknown reward 'pikscore'; "
                                                         "available: ["),
    (FLOW, ["reward.components.jpeg_incompressibility.qualty=3"],
     "reward.components.jpeg_incompressibility.qualty: reward 'jpeg_incompressibility' has no argument 'qualty'; "
     "valid: ['batch_size', 'device', 'quality']"),
    (FLOW, ["reward.components.jpeg_incompressibility.weight=high"],
     "reward.components.jpeg_incompressibility.weight: expected a number, got 'high'"),
    (FLOW, ["reward.on_nonfinite.x=1"], "'reward.on_nonfinite' is a value ('error'), not a section or mapping"),
    (VLM, ["reward.kwargs.lowercas=false"], "reward.kwargs.lowercas: reward 'exact_match' has no argument 'lowercas'"),
    (VLM, ["reward.name=exact_matc"], "reward.name: unknown reward 'exact_matc'"),
    (MT, ["env.tasks.grid_puzzle.bogus=4"], "env.tasks.grid_puzzle: GridPuzzleEnv.__init__() got an unexpected "
                                            "keyword argument 'bogus'"),
    (FLOW, ["reward.components.jpeg_incompressibility.weight=.nan"],  # was: NaN rewards at step 1
     "reward.components.jpeg_incompressibility.weight: expected a finite number, got nan"),
    (FLOW, ["reward.components={jpeg_incompressibility: .inf}"],
     "reward.components.jpeg_incompressibility: expected a finite weight, got inf"),
    (VLM, ["reward.name=composite", "reward.kwargs={components: {exact_match: .nan, format: 1.0}}"],
     "reward.kwargs.components.exact_match: expected a finite weight, got nan"),
    (FLOW, ["reward.components.jpeg_incompressibility.quality=abc"],  # was: int('abc') inside the reward, unnamed
     "reward.components.jpeg_incompressibility.quality: reward 'jpeg_incompressibility' takes an integer for "
     "'quality' (default 95), got 'abc'"),
    # judges that cannot score what the run makes (they failed at the baseline evaluation, after the model load,
    # leaving a run directory with an empty metrics.jsonl); an image family asked for videos (the reward was blamed)
    (FLOW, ["log.eval_every=1", "log.judges={answer: {reward: exact_match}}"],
     "log.judges.answer: reward 'exact_match' scores texts, but this run makes images; a judge scores what the run "
     "makes: name one that scores images ("),
    (FLOW, ["rollout.num_frames=5", "log.eval_every=1", "log.judges={colour: {reward: prompt_color}}"],
     "rollout.num_frames=5: StableDiffusion3Pipeline generates images, so num_frames must be 1 (video pipelines: ["),
    (VLM, ["log.judges={colour: {reward: prompt_color}}"],
     "log.judges.colour: reward 'prompt_color' scores images, but this run makes texts"),
    (VLM, ["log.judges={answer: {reward: exact_match, lowercas: true}}"],
     "log.judges.answer.lowercas: reward 'exact_match' has no argument 'lowercas'; valid: ["),
]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Every recipe's model loader fails the test: the config errors must come before any model loads."""
    import importlib.util

    from mmrl.diffusion import models as diffusion_models
    from mmrl.vlm import grpo, multiturn

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(diffusion_models, "load_flow_model", loaded)
    monkeypatch.setattr(grpo, "build_policy", loaded)
    monkeypatch.setattr(multiturn, "build_policy", loaded)
    find_spec = importlib.util.find_spec  # vLLM counts as not installed, whatever this machine has
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))


@pytest.mark.parametrize("config, overrides, message", BAD_CONFIGS,
                         ids=[f"{Path(c).stem}:{' '.join(o)}" for c, o, _ in BAD_CONFIGS])
def test_bad_sizes_and_paths_are_one_line_errors_before_any_model_loads(config, overrides, message, tmp_path,
                                                                         monkeypatch, capsys, no_model_loads):
    monkeypatch.chdir(REPO)  # the shipped configs name assets/ relative to the checkout
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "a.png", "rejected": "b.png"}\n')
    out = tmp_path / "run"
    argv = ["train", config, f"output_dir={out}", *[o.replace("{tmp}", str(tmp_path)) for o in overrides]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [ln for ln in err.splitlines() if ln.startswith("mmrl: error: ")]
    assert len(line) == 1 and message.replace("{tmp}", str(tmp_path)) in line[0], err
    assert not out.exists()  # refused before the run directory was even created


def test_binary_prompt_file_is_a_one_line_error_naming_it(tmp_path, monkeypatch, capsys):
    from PIL import Image

    monkeypatch.chdir(REPO)
    png = tmp_path / "prompts.txt"
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    assert cli.main(["train", FLOW, f"output_dir={tmp_path / 'run'}", f"data.train_prompts={png}"]) == 2
    err = capsys.readouterr().err
    assert f"mmrl: error: {png}: not a UTF-8 text file (byte 0x89 at offset 0" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------- demo from anywhere


def test_demo_config_paths_resolve_against_checkout_and_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = cli.demo_config("diffusion", "out", ["data.eval_prompts=mine.txt"])
    assert cfg.output_dir == str(tmp_path / "out" / "demo_diffusion")
    assert cfg.model.path == str(REPO / "assets" / "tiny_sd3_shapes")  # shipped files: from the checkout
    assert cfg.data.train_prompts == str(REPO / "assets" / "prompts" / "shapes_train.txt")
    assert cfg.data.eval_prompts == "mine.txt"  # a user override keeps its meaning (relative to the cwd)
    vlm = cli.demo_config("vlm", tmp_path / "elsewhere")
    assert vlm.output_dir == str(tmp_path / "elsewhere" / "demo_vlm")
    # the tiny VLM the demo builds on first use goes under the output dir, not into the checkout
    assert vlm.model.path == str(tmp_path / "elsewhere" / "tiny_models" / "qwen2_vl")
    assert Path.cwd() == tmp_path


def test_demo_overrides_after_the_output_dir_option_reach_the_config(tmp_path, capsys):
    assert cli.main(["demo", "vlm", "--output-dir", str(tmp_path), "rollout.nn=3"]) == 2  # not an argparse error
    assert "unknown config key 'rollout.nn'" in capsys.readouterr().err
    assert not (tmp_path / "demo_vlm").exists()


def test_demo_writes_under_the_current_directory_and_prints_the_absolute_run_dir(tmp_path, monkeypatch, capsys):
    """One cheap diffusion demo step run from a foreign directory (as from an installed package)."""
    checkout_run = REPO / "runs" / "demo_diffusion" / "metrics.jsonl"
    before = checkout_run.stat().st_mtime_ns if checkout_run.exists() else None
    cwd = tmp_path / "somewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("MMRL_NO_PROGRESS", "1")
    assert cli.main(["demo", "diffusion", "train.max_steps=1", "train.save_every=0", "rollout.num_steps=2",
                     "rollout.group_size=2", "rollout.height=32", "rollout.width=32", "rollout.prompts_per_step=1",
                     "log.sample_every=0", "log.eval_every=0"]) == 0
    run_dir = cwd / "runs" / "demo_diffusion"
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "config.yaml").is_file()
    assert f"run dir {run_dir} " in capsys.readouterr().out
    assert Path.cwd() == cwd  # the process's directory is left alone
    after = checkout_run.stat().st_mtime_ns if checkout_run.exists() else None
    assert after == before  # nothing written into the source checkout


# ---------------------------------------------------------------------------------------- mapping entries


def test_dotted_overrides_reach_into_reward_components_and_other_mappings(capsys):
    """`reward.components.<name>.<arg>=...` sets one argument of one component (a component given as a bare weight
    becomes {weight: w, <arg>: ...}; a new name adds a component), checked as the YAML would be."""
    import yaml

    real = "configs/diffusion/flow_grpo_sd35_pickscore.yaml"
    assert cli.main(["config", "check", str(REPO / real), "reward.components.pickscore.weights=/ckpt/PickScore_v1",
                     "reward.components.pickscore.processor=/ckpt/CLIP-H", "reward.components.ocr.weight=0.5"]) == 0
    reward = yaml.safe_load(capsys.readouterr().out)["reward"]["components"]
    assert reward == {"pickscore": {"weight": 1.0, "weights": "/ckpt/PickScore_v1", "processor": "/ckpt/CLIP-H",
                                    "scale_by_26": True},
                      "ocr": {"weight": 0.5}}
    assert cli.main(["config", "check", str(REPO / FLOW), "reward.components.jpeg_incompressibility.quality=20"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["reward"]["components"] == {
        "jpeg_incompressibility": {"weight": 1.0, "quality": 20}}
    assert cli.main(["config", "check", str(REPO / VLM), "reward.kwargs.lowercase=false"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["reward"]["kwargs"] == {"lowercase": False}
    assert cli.main(["config", "check", str(REPO / MT), "env.tasks.grid_puzzle.width=4"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["env"]["tasks"]["grid_puzzle"]["width"] == 4
    assert cli.main(["config", "check", str(REPO / FLOW), "reward.components.pickscore.weigths=/x"]) == 2
    err = capsys.readouterr().err
    assert "reward.components.pickscore.weigths: reward 'pickscore' has no argument 'weigths'; valid: [" in err
    assert "'weights'" in err and "Traceback" not in err


def test_mmrl_no_progress_hides_the_loading_bars_of_commands_without_a_run(tmp_path):
    """MMRL_NO_PROGRESS=1 hid the diffusers / transformers bars only inside start_run: `mmrl reward score` (and eval,
    export) loaded their models with transformers' "Loading weights" bar. `--no-progress` hides them too."""
    from PIL import Image

    from mmrl.testing import child_env
    from mmrl.tiny import build_tiny_clip

    clip = build_tiny_clip(tmp_path / "clip")
    (tmp_path / "img").mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "img" / "0.png")
    (tmp_path / "p.txt").write_text("a red circle\n")
    argv = [sys.executable, "-m", "mmrl.cli", "reward", "score", "clip_score", "--weights", str(clip), "--images",
            str(tmp_path / "img"), "--prompts", str(tmp_path / "p.txt")]

    def stderr(env_progress, *extra):
        env = {k: v for k, v in child_env().items() if k != "MMRL_NO_PROGRESS"}
        env.update(env_progress)
        done = subprocess.run([*argv, *extra], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "Loading weights" in stderr({})  # the bar this test looks for (shown without the setting)
    for err in (stderr({"MMRL_NO_PROGRESS": "1"}), stderr({}, "--no-progress")):
        lines = err.strip().splitlines()  # nothing but the summary
        assert len(lines) == 1 and lines[0].startswith("scored 1 samples with clip_score: mean "), err
