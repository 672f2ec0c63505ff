"""The Python trainer API (`mmrl.Trainer`): reward callables and zoo names, prompts / VQA rows as lists and
`datasets.Dataset`, `data.path` as a `save_to_disk` directory, callbacks, resume; and the documented example."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import mmrl
from mmrl.config import ConfigError, load_config
from mmrl.rewards import available, from_callable
from mmrl.rewards.registry import create
from mmrl.testing import metrics_rows

ROOT = Path(__file__).resolve().parents[1]
TINY_SD3 = ROOT / "assets" / "tiny_sd3_shapes"
TINY_FLOW = ROOT / "configs/diffusion/flow_grpo_tiny.yaml"
FAST_DIFFUSION = {"train.max_steps": 2, "train.save_every": 1, "rollout.num_steps": 2, "rollout.prompts_per_step": 2,
                  "rollout.group_size": 2, "log.eval_every": 0, "log.sample_every": 0, "data.eval_prompts": ""}


# ------------------------------------------------------------------------------------------ reward callables
def test_function_rewards_are_called_like_trl_reward_functions():
    seen = {}

    def brightness(images, prompts, **kwargs):
        seen.update(kwargs, prompts=prompts)
        return images.mean(dim=(1, 2, 3))

    def says(completions, answer):  # no **kwargs: gets only what it names
        return [1.0 if a in c else None for c, a in zip(completions, answer)]

    r = from_callable(brightness)
    x = torch.stack([torch.full((3, 4, 4), 0.25), torch.full((3, 4, 4), 0.75)])
    out = r(images=x, prompts=["a", "b"], metadata=[{"text": "HI"}, {"text": "YO", "extra": 1}])
    assert r.kind == "image" and out.scores.tolist() == [0.25, 0.75]
    assert seen == {"prompts": ["a", "b"], "text": ["HI", "YO"], "extra": [None, 1]}
    t = from_callable(says)
    res = t(completions=["red", "blue"], metadata=[{"answer": "red", "q": 1}, {"answer": "green"}])
    assert t.kind == "text" and res.scores[0] == 1.0 and torch.isnan(res.scores[1])  # None -> NaN (TRL: n/a)
    with pytest.raises(ValueError, match="returned 1 scores for 2 samples"):
        from_callable(lambda images, **k: [0.0])(images=x)
    with pytest.raises(ValueError, match="cannot tell whether it scores images or text"):
        from_callable(lambda x: x)


def test_a_reward_function_returning_text_is_named_with_the_sample():
    """float('good') failed without naming the function or the sample; '0.5' was silently taken as a number."""
    def grade(images, prompts, **kwargs):
        return [0.5, "good"]

    x = torch.zeros(2, 3, 4, 4)
    with pytest.raises(TypeError, match=re.escape("reward function 'grade' returned 'good' (str) for sample 1 of 2 "
                                                  "(prompt 'a blue square'); expected one number per sample (None "
                                                  "where it does not apply)")):
        from_callable(grade)(images=x, prompts=["a red circle", "a blue square"])
    with pytest.raises(TypeError, match=re.escape("reward function 'says' returned '1' (str) for sample 0 of 1; ")):
        from_callable(lambda completions: ["1"], name="says")(completions=["x"])


# ------------------------------------------------------------------------------------------ save_to_disk data
def test_data_path_reads_a_save_to_disk_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    from mmrl.pipelines.data import load_prompts, load_visual_qa, require_path

    ds = datasets.Dataset.from_dict({"prompt": ["a red circle", "a blue square"], "text": ["A", "B"]})
    ds.save_to_disk(str(tmp_path / "prompts"))
    items = load_prompts(tmp_path / "prompts")
    assert [(i.prompt, i.metadata) for i in items] == [("a red circle", {"text": "A"}), ("a blue square", {"text": "B"})]
    red = Image.new("RGB", (28, 28), (220, 30, 30))
    vqa = datasets.Dataset.from_dict({"problem": ["What color?"], "answer": ["red"], "images": [[red]]},
                                     features=datasets.Features({"problem": datasets.Value("string"),
                                                                 "answer": datasets.Value("string"),
                                                                 "images": [datasets.Image()]}))
    datasets.DatasetDict({"train": vqa, "test": vqa}).save_to_disk(str(tmp_path / "vqa"))
    rows = load_visual_qa(tmp_path / "vqa", template="{problem}")
    assert rows[0].prompt == "<image>What color?" and rows[0].answer == "red"
    assert rows[0].images[0].getpixel((5, 5)) == (220, 30, 30)
    require_path("data.path", tmp_path / "vqa", "data file", kind="data")
    with pytest.raises(FileNotFoundError, match="data.path: data file .* is not a file or a directory saved with"):
        require_path("data.path", tmp_path, "data file", kind="data")
    datasets.DatasetDict({"a": vqa, "b": vqa}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\] and no 'train' split"):
        load_visual_qa(tmp_path / "two")


# ------------------------------------------------------------------------------------------ the trainer
def test_trainer_builds_the_config_a_yaml_would():
    t = mmrl.Trainer("flow_grpo", model=TINY_SD3, reward_funcs=[lambda images, **k: images.mean((1, 2, 3)), "ocr"],
                     reward_weights=[1.0, 0.5], output_dir="runs/x", overrides={"train.max_steps": 3})
    assert t.config.model.path == str(TINY_SD3) and t.config.output_dir == "runs/x" and t.config.train.max_steps == 3
    assert t.config.reward.components == {"python:<lambda>": 1.0, "ocr": 0.5}
    v = mmrl.Trainer("vlm_grpo", reward_funcs=["exact_match", "format"], overrides=["train.max_steps=1"])
    assert (v.config.reward.name, v.config.reward.kwargs) == ("composite", {"components": {"exact_match": 1.0,
                                                                                           "format": 1.0}})
    assert mmrl.Trainer("vlm_grpo", reward_funcs="exact_match").config.reward.name == "exact_match"
    with pytest.raises(ConfigError, match="unknown reward 'nope'; available"):
        mmrl.Trainer("flow_grpo", reward_funcs=["nope"])
    with pytest.raises(ConfigError, match="reward_weights: 1 weights for 2 reward functions"):
        mmrl.Trainer("flow_grpo", reward_funcs=["ocr", "jpeg_compressibility"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="vlm_multiturn takes its rewards from its environments"):
        mmrl.Trainer("vlm_multiturn", reward_funcs=["exact_match"])
    with pytest.raises(ConfigError, match="unknown config key 'train.lr'"):
        mmrl.Trainer("flow_grpo", overrides={"train.lr": 1e-4})
    for weights in ([float("nan")], [float("inf")], ["1"]):  # NaN was found only at step 1, as a NaN reward
        with pytest.raises(ConfigError, match=re.escape(f"reward_weights[0]: expected a finite number, got "
                                                        f"{weights[0]!r}")):
            mmrl.Trainer("flow_grpo", reward_funcs=["ocr"], reward_weights=weights)


def test_a_failed_start_leaves_no_inputs_behind(tmp_path):
    """The inputs a Trainer wrote for a start that failed (here: no model folder) go with the rest of that start:
    a new output_dir entirely, in an existing one only what this start added."""
    def args(out, prompts):
        return dict(model=tmp_path / "no_model", reward_funcs=["jpeg_compressibility"], train_dataset=prompts,
                    output_dir=out, overrides=FAST_DIFFUSION)

    with pytest.raises(FileNotFoundError, match="model.path '.*no_model' does not exist"):
        mmrl.Trainer(TINY_FLOW, **args(tmp_path / "new", ["a red circle"])).train()
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    (mine / "inputs").mkdir(parents=True)
    (mine / "inputs" / "notes.txt").write_text("mine")
    with pytest.raises(FileNotFoundError, match="no_model"):
        mmrl.Trainer(TINY_FLOW, **args(mine, ["a red circle"])).train()
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == ["inputs", "inputs/notes.txt"]
    with pytest.raises(ConfigError, match=re.escape("train/eval prompts: item 1: 'prompt' is int 7, expected a "
                                                    "string (the prompt text)")):
        mmrl.Trainer(TINY_FLOW, **args(tmp_path / "ints", [{"prompt": "a"}, {"prompt": 7}])).train()
    assert not (tmp_path / "ints").exists()


@pytest.mark.slow
def test_diffusion_trainer_with_a_python_reward_list_prompts_callbacks_and_resume(tmp_path):
    calls, logged, ended = [], [], []

    def brightness(images, prompts, **kwargs):
        calls.append((len(prompts), images.shape))
        return images.mean(dim=(1, 2, 3))

    class Recorder:
        def on_log(self, step, metrics):
            logged.append((step, metrics["reward/mean"]))

        def on_train_end(self, summary):
            ended.append(summary)

    prompts = ["a red circle on a blue background", "a green square on a white background"]
    args = dict(model=TINY_SD3, reward_funcs=[brightness, "jpeg_compressibility"], reward_weights=[1.0, 0.1],
                train_dataset=prompts, output_dir=tmp_path / "run", callbacks=[Recorder()])
    summary = mmrl.Trainer(ROOT / "configs/diffusion/flow_grpo_tiny.yaml", **args, overrides=FAST_DIFFUSION).train()
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and summary["steps_logged"] == 2 and ended == [summary]
    assert logged == [(r["step"], r["reward/mean"]) for r in rows]  # the callback saw every metrics row
    assert calls and all(n == 4 and shape[1:] == (3, 64, 64) for n, shape in calls)
    assert "python:brightness" not in available()  # registered for the run only
    cfg = load_config(tmp_path / "run" / "config.yaml")  # the run directory is an ordinary one
    assert cfg.reward.components == {"python:brightness": 1.0, "jpeg_compressibility": 0.1}
    with pytest.raises(ValueError, match="'python:brightness' was a Python function passed to mmrl.Trainer"):
        create("python:brightness")  # the config loads; scoring without the function says why not
    assert [json.loads(ln)["prompt"] for ln in Path(cfg.data.train_prompts).read_text().splitlines()] == prompts
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").is_file()
    # train again with more steps: resumes from step 2, like `mmrl train` rerun
    more = {**FAST_DIFFUSION, "train.max_steps": 3}
    mmrl.Trainer(ROOT / "configs/diffusion/flow_grpo_tiny.yaml", **args, overrides=more).train()
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1, 2, 3]
    with pytest.raises(ConfigError, match="the dataset differs from the one this run was started with"):
        mmrl.Trainer(ROOT / "configs/diffusion/flow_grpo_tiny.yaml", **{**args, "train_dataset": prompts[:1]},
                     overrides=more).train()


@pytest.mark.slow
def test_vlm_trainer_with_a_hf_dataset_and_a_python_reward(tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    from mmrl.tiny import build_tiny_qwen2_vl

    colours = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220)}
    rows = {"problem": [], "answer": [], "images": []}
    for i in range(6):
        name = list(colours)[i % 3]
        rows["problem"].append("What color is the square?")
        rows["answer"].append(name)
        rows["images"].append([Image.new("RGB", (56, 56), colours[name])])
    ds = datasets.Dataset.from_dict(rows)
    scored = []

    def names_the_colour(completions, answer, **kwargs):
        scored.append(len(completions))
        return [float(a in c) for c, a in zip(completions, answer)]

    t = mmrl.Trainer("vlm_grpo", model=build_tiny_qwen2_vl(tmp_path / "tiny"), reward_funcs=names_the_colour,
                     train_dataset=ds, eval_dataset=ds.select(range(2)), output_dir=tmp_path / "run",
                     overrides={"train.max_steps": 1, "train.save_every": 1, "rollout.prompts_per_step": 2,
                                "rollout.group_size": 2, "rollout.max_new_tokens": 3, "data.template": "{problem}",
                                "data.eval_size": 2, "warm_start.steps": 0, "log.sample_every": 0,
                                "log.eval_every": 0})
    t.train()
    assert scored and [r["step"] for r in metrics_rows(tmp_path / "run")] == [1]
    cfg = load_config(tmp_path / "run" / "config.yaml")
    assert cfg.data.kind == "geo3k" and Path(cfg.data.path).is_dir() and cfg.reward.name == "python:names_the_colour"
    assert (tmp_path / "run" / "checkpoints" / "step_1" / "COMPLETE").is_file()


# ------------------------------------------------------------------------------------------ the documented example
@pytest.mark.slow
def test_the_documented_python_api_example_runs(tmp_path, monkeypatch):
    """docs/python-api.md's first example, executed as written (from a copy of the checkout's paths)."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    for name in ("assets", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    namespace: dict = {}
    exec(compile(code, "docs/python-api.md", "exec"), namespace)
    summary = namespace["summary"]
    assert summary["steps_logged"] >= 1 and Path(summary["output_dir"]).is_dir()
    assert (Path(summary["output_dir"]) / "metrics.jsonl").is_file()
