"""The Python trainer API (`mmrl.Trainer`): reward callables and zoo names, prompts / VQA rows as lists and
`datasets.Dataset` (TRL's `prompt` / `image` columns), `data.path` as a `save_to_disk` directory, callbacks, resume,
model objects, `evaluate()`, `save_model()`; and the documented example. (TRL's config names, the defaults from the
model, transformers callbacks and the porting page: tests/test_trainer_trl.py.)"""

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
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220)}


def fast_flow(out, **kw):
    """A FlowGRPOConfig of a few cheap steps (2 prompts x 2 images, 2 SDE steps, no CFG) in TRL's names."""
    return mmrl.FlowGRPOConfig(output_dir=str(out), **{
        "max_steps": 2, "save_steps": 1, "num_generations": 2, "per_device_train_batch_size": 4,
        "rollout": {"num_steps": 2, "guidance_scale": 1.0, "eval_num_steps": 2, "eval_guidance_scale": 1.0},
        "log": {"sample_every": 0}, **kw})


def fast_vlm(out, **kw):
    return mmrl.VLMGRPOConfig(output_dir=str(out), **{
        "max_steps": 1, "save_steps": 1, "num_generations": 2, "per_device_train_batch_size": 4,
        "max_completion_length": 3, "log": {"sample_every": 0, "eval_every": 0}, **kw})


def colour_rows(n=6, text="prompt", image="image"):
    from PIL import Image

    names = [list(COLOURS)[i % 3] for i in range(n)]
    return [{text: "What color is the square?", image: Image.new("RGB", (56, 56), COLOURS[c]), "answer": c}
            for c in names]


def names_the_colour(completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl")


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
    t = mmrl.Trainer(model=TINY_SD3, reward_funcs=[lambda images, **k: images.mean((1, 2, 3)), "ocr"],
                     reward_weights=[1.0, 0.5], output_dir="runs/x", args=mmrl.FlowGRPOConfig(max_steps=3))
    assert t.args.model.path == str(TINY_SD3) and t.args.output_dir == "runs/x" and t.args.train.max_steps == 3
    assert t.args.reward.components == {"python:<lambda>": 1.0, "ocr": 0.5}
    v = mmrl.Trainer(args="vlm_grpo", reward_funcs=["exact_match", "format"], overrides=["train.max_steps=1"])
    assert (v.args.reward.name, v.args.reward.kwargs) == ("composite", {"components": {"exact_match": 1.0,
                                                                                       "format": 1.0}})
    assert mmrl.Trainer(args=mmrl.VLMGRPOConfig(), reward_funcs="exact_match").args.reward.name == "exact_match"
    weighted = mmrl.Trainer(args=mmrl.FlowGRPOConfig(reward_weights=[2.0, 1.0]), reward_funcs=["ocr", "pickscore"])
    assert weighted.args.reward.components == {"ocr": 2.0, "pickscore": 1.0}  # TRL's reward_weights on the config
    with pytest.raises(ConfigError, match="reward_weights: given to Trainer and to the config; give it once"):
        mmrl.Trainer(args=mmrl.FlowGRPOConfig(reward_weights=[1.0]), reward_funcs=["ocr"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="unknown reward 'nope'; available"):
        mmrl.Trainer(args="flow_grpo", reward_funcs=["nope"])
    with pytest.raises(ConfigError, match="reward_weights: 1 weights for 2 reward functions"):
        mmrl.Trainer(args="flow_grpo", reward_funcs=["ocr", "jpeg_compressibility"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="vlm_multiturn takes its rewards from its environments"):
        mmrl.Trainer(args=mmrl.MultiTurnConfig(), reward_funcs=["exact_match"])
    with pytest.raises(ConfigError, match="unknown config key 'train.lr'"):
        mmrl.Trainer(args="flow_grpo", overrides={"train.lr": 1e-4})
    for weights in ([float("nan")], [float("inf")], ["1"]):  # NaN was found only at step 1, as a NaN reward
        with pytest.raises(ConfigError, match=re.escape(f"reward_weights[0]: expected a finite number, got "
                                                        f"{weights[0]!r}")):
            mmrl.Trainer(args="flow_grpo", reward_funcs=["ocr"], reward_weights=weights)


def test_a_failed_start_leaves_no_inputs_behind(tmp_path):
    """The inputs a Trainer wrote for a start that failed go with the rest of that start: a new output_dir
    entirely, in an existing one only what this start added."""
    def args(out, prompts, model=TINY_SD3):
        return dict(model=model, reward_funcs=["jpeg_compressibility"], train_dataset=prompts, output_dir=out,
                    overrides=FAST_DIFFUSION)

    with pytest.raises(FileNotFoundError, match="model.path '.*no_model' does not exist"):  # now at construction
        mmrl.Trainer(args=TINY_FLOW, **args(tmp_path / "new", ["a red circle"], tmp_path / "no_model")).train()
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    (mine / "inputs").mkdir(parents=True)
    (mine / "inputs" / "notes.txt").write_text("mine")
    t = mmrl.Trainer(args=TINY_FLOW, **args(mine, ["a red circle"]))
    t.args.data.eval_prompts = str(tmp_path / "missing.txt")  # found by the recipe, after the inputs were written
    with pytest.raises(FileNotFoundError, match="data.eval_prompts: prompt file not found"):
        t.train()
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == ["inputs", "inputs/notes.txt"]
    with pytest.raises(ConfigError, match=re.escape("train/eval prompts: item 1: 'prompt' is int 7, expected a "
                                                    "string (the prompt text)")):
        mmrl.Trainer(args=TINY_FLOW, **args(tmp_path / "ints", [{"prompt": "a"}, {"prompt": 7}])).train()
    assert not (tmp_path / "ints").exists()


@pytest.mark.slow
def test_diffusion_trainer_with_a_python_reward_list_prompts_callbacks_and_resume(tmp_path):
    calls, logged, ended, saved = [], [], [], []

    def brightness(images, prompts, **kwargs):
        calls.append((len(prompts), images.shape))
        return images.mean(dim=(1, 2, 3))

    class Recorder:
        def on_log(self, step, metrics):
            logged.append((step, metrics["reward/mean"]))

        def on_save(self, step, checkpoint):
            saved.append((step, Path(checkpoint).name))

        def on_train_end(self, summary):
            ended.append(summary)

    class SavesOnly:  # an object with one of the methods is not called as f(step, metrics)
        def on_save(self, step, checkpoint):
            saved.append(("only", step))

    args = dict(model=TINY_SD3, reward_funcs=[brightness, "jpeg_compressibility"], reward_weights=[1.0, 0.1],
                train_dataset=PROMPTS, output_dir=tmp_path / "run", callbacks=[Recorder(), SavesOnly()])
    summary = mmrl.Trainer(args=TINY_FLOW, **args, overrides=FAST_DIFFUSION).train()
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and summary["steps_logged"] == 2 and ended == [summary]
    assert logged == [(r["step"], r["reward/mean"]) for r in rows]  # the callback saw every metrics row
    assert saved == [(1, "step_1"), ("only", 1), (2, "step_2"), ("only", 2)]  # and every complete checkpoint
    assert calls and all(n == 4 and shape[1:] == (3, 64, 64) for n, shape in calls)
    assert "python:brightness" not in available()  # registered for the run only
    cfg = load_config(tmp_path / "run" / "config.yaml")  # the run directory is an ordinary one
    assert cfg.reward.components == {"python:brightness": 1.0, "jpeg_compressibility": 0.1}
    with pytest.raises(ValueError, match="'python:brightness' was a Python function passed to mmrl.Trainer"):
        create("python:brightness")  # the config loads; scoring without the function says why not
    assert [json.loads(ln)["prompt"] for ln in Path(cfg.data.train_prompts).read_text().splitlines()] == PROMPTS
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").is_file()
    # train again with more steps: resumes from step 2, like `mmrl train` rerun
    more = {**FAST_DIFFUSION, "train.max_steps": 3}
    mmrl.Trainer(args=TINY_FLOW, **args, overrides=more).train()
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1, 2, 3]
    with pytest.raises(ConfigError, match="the dataset differs from the one this run was started with"):
        mmrl.Trainer(args=TINY_FLOW, **{**args, "train_dataset": PROMPTS[:1]}, overrides=more).train()


@pytest.mark.slow
def test_vlm_trainer_with_a_hf_dataset_and_a_python_reward(tmp_path, tiny_vlm):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rows = {"problem": [], "answer": [], "images": []}  # geometry3k's column names: `problem` is read as `prompt`
    for i in range(6):
        name = list(COLOURS)[i % 3]
        rows["problem"].append("What color is the square?")
        rows["answer"].append(name)
        rows["images"].append([Image.new("RGB", (56, 56), COLOURS[name])])
    ds = datasets.Dataset.from_dict(rows)
    scored = []

    def counted(completions, answer, **kwargs):
        scored.append(len(completions))
        return names_the_colour(completions, answer)

    t = mmrl.Trainer(model=tiny_vlm, reward_funcs=counted, train_dataset=ds, eval_dataset=ds.select(range(2)),
                     args=fast_vlm(tmp_path / "run", data={"eval_size": 2}))
    t.train()
    assert scored and [r["step"] for r in metrics_rows(tmp_path / "run")] == [1]
    cfg = load_config(tmp_path / "run" / "config.yaml")
    assert cfg.data.kind == "geo3k" and Path(cfg.data.path).is_dir() and cfg.reward.name == "python:counted"
    assert cfg.data.template == "{prompt}"  # the prompts as written
    assert (tmp_path / "run" / "checkpoints" / "step_1" / "COMPLETE").is_file()


def test_vlm_rows_take_trl_column_names(tmp_path):
    """`prompt` (TRL's name; `problem` an alias) and `image` / `images`, written as the loader reads them; the loader
    reads the same names from a YAML config's data file."""
    from mmrl.pipelines.data import load_visual_qa

    t = mmrl.Trainer(args="vlm_grpo", reward_funcs=names_the_colour, train_dataset=colour_rows(3),
                     output_dir=tmp_path / "run")
    cfg = t.args
    t._write_inputs(cfg)
    items = load_visual_qa(cfg.data.path, template=cfg.data.template)
    assert [(it.prompt, it.answer, it.images[0].getpixel((3, 3))) for it in items] == [
        ("<image>What color is the square?", c, COLOURS[c]) for c in COLOURS]
    rows = tmp_path / "rows.jsonl"
    image = json.loads(Path(cfg.data.path).read_text().splitlines()[0])["images"][0]  # a saved PNG
    rows.write_text(json.dumps({"problem": "Q1", "image": image, "answer": "a"}) + "\n"
                    + json.dumps({"prompt": "Q2", "answer": "b"}) + "\n")
    assert [it.prompt for it in load_visual_qa(rows, template="{prompt}!")] == ["<image>Q1!", "Q2!"]
    for bad, message in [
            ([{"question": "Q", "answer": "a"}], "train_dataset: row 0: no 'prompt' column (the question text; "
                                                 "'problem' is read as an alias), got columns ['answer', 'question']"),
            ([{"prompt": "Q", "image": "a.png", "images": ["b.png"], "answer": "a"}],
             "train_dataset: row 0: both 'images' and 'image' columns; give the images in one of them"),
            ([{"prompt": [{"role": "user", "content": "Q"}], "answer": "a"}],
             "train_dataset: row 0: 'prompt' is list [{'role': 'user', 'content': 'Q'}]; expected text (TRL's "
             "conversational prompts"),
            ([{"prompt": "Q"}], "train_dataset: row 0: no 'answer' column, which the zoo rewards score against")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            mmrl.Trainer(args="vlm_grpo", reward_funcs="exact_match", train_dataset=bad)
    no_answer = mmrl.Trainer(args="vlm_grpo", reward_funcs=names_the_colour, train_dataset=[{"prompt": "Q"}],
                             output_dir=tmp_path / "free")  # a Python reward reads what it names
    no_answer._write_inputs(no_answer.args)
    assert json.loads(Path(no_answer.args.data.path).read_text())["answer"] == ""


def test_loaded_model_objects_are_saved_under_inputs_and_trained_from_there(tmp_path, tiny_vlm):
    """A loaded DiffusionPipeline / transformers model (with its processor) used to fail with a YAML parse error."""
    from diffusers import DiffusionPipeline
    from transformers import AutoModelForImageTextToText, AutoProcessor

    pipe = DiffusionPipeline.from_pretrained(str(TINY_SD3))
    t = mmrl.Trainer(model=pipe, reward_funcs="jpeg_compressibility", train_dataset=PROMPTS,
                     args=fast_flow(tmp_path / "sd3", max_steps=1))
    assert t.args.algorithm == "flow_grpo" and t.args.rollout.height == 64  # recipe and size from the object
    t.train()
    saved = tmp_path / "sd3" / "inputs" / "model"
    assert load_config(tmp_path / "sd3" / "config.yaml").model.path == str(saved)
    assert (saved / "model_index.json").is_file() and (saved / "transformer" / "config.json").is_file()
    pipe.transformer.pos_embed.proj.bias.data += 1  # another model for a run with checkpoints: refused
    with pytest.raises(ConfigError, match="the model differs from the one this run was started with"):
        mmrl.Trainer(model=pipe, reward_funcs="jpeg_compressibility", train_dataset=PROMPTS,
                     args=fast_flow(tmp_path / "sd3", max_steps=2)).train()
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm))
    v = mmrl.Trainer(model=model, processing_class=AutoProcessor.from_pretrained(str(tiny_vlm)),
                     reward_funcs=names_the_colour, train_dataset=colour_rows(2), args=fast_vlm(tmp_path / "vlm"))
    assert v.args.algorithm == "vlm_grpo"
    v.train()
    files = sorted(p.name for p in (tmp_path / "vlm" / "inputs" / "model").iterdir())
    assert "config.json" in files and "model.safetensors" in files and "tokenizer.json" in files
    assert mmrl.Trainer(model=model).processing_class is not None  # loaded from the directory it came from
    with pytest.raises(ConfigError, match="processing_class: the processor is loaded from the model directory"):
        mmrl.Trainer(model=tiny_vlm, processing_class=AutoProcessor.from_pretrained(str(tiny_vlm)))


def test_evaluate_and_save_model(tmp_path, tiny_vlm):
    evaluated = []

    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            evaluated.append(sorted(metrics))

    t = mmrl.Trainer(model=TINY_SD3, reward_funcs="jpeg_compressibility", train_dataset=PROMPTS,
                     eval_dataset=["a blue circle on a white background"], args=fast_flow(tmp_path / "run"),
                     callbacks=[Seen()])
    with pytest.raises(ConfigError, match="save_model: .*run has no complete checkpoint yet; call train\\(\\) first"):
        t.save_model()
    base = t.evaluate()  # before train(): the base model
    t.train()
    trained = t.evaluate()
    assert set(trained) == set(base) >= {"eval/reward/mean", "eval/reward/std", "eval/reward/jpeg_compressibility",
                                          "eval/shapes/overall"}
    assert trained["eval/reward/mean"] != base["eval/reward/mean"]  # the trained weights, not the base model
    assert (tmp_path / "run" / "eval" / "step_2" / "eval_report.json").is_file()
    assert evaluated[-1] == sorted(trained)
    other = t.evaluate(["a red square on a white background"], metric_key_prefix="test")
    assert set(other) == {k.replace("eval/", "test/") for k in trained}
    meta = t.save_model()
    assert meta["format"] == "diffusers" and Path(meta["out"]) == (tmp_path / "run-diffusers").resolve()
    assert (tmp_path / "run-diffusers" / "model_index.json").is_file()
    assert t.save_model(tmp_path / "lora", format="diffusers-lora")["format"] == "diffusers-lora"
    with pytest.raises(ConfigError, match=re.escape(f"save_model({str(tmp_path / 'run')!r}): that is inside the run "
                                                    f"directory")):
        t.save_model(tmp_path / "run")
    v = mmrl.Trainer(model=tiny_vlm, reward_funcs=names_the_colour, train_dataset=colour_rows(2),
                     eval_dataset=colour_rows(3), args=fast_vlm(tmp_path / "vlm"))
    v.train()
    assert set(v.evaluate()) == {"eval/accuracy"}
    assert v.save_model()["format"] == "transformers" and (tmp_path / "vlm-transformers" / "config.json").is_file()
    with pytest.raises(ConfigError, match="evaluate\\(\\): no eval_dataset; pass it to Trainer"):
        mmrl.Trainer(model=tiny_vlm).evaluate()


def test_peft_config_and_num_train_epochs():
    from peft import LoraConfig

    t = mmrl.Trainer(model=TINY_SD3, train_dataset=PROMPTS * 5, args=mmrl.FlowGRPOConfig(num_train_epochs=2.5),
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["to_q", "to_v"]))
    lora = t.args.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.init) == (8, 16, ["to_q", "to_v"], "true")
    assert t.args.train.max_steps == 7  # ceil(2.5 epochs x 10 rows / 4 prompts per step)
    assert t.derived["train.max_steps"] == "7: num_train_epochs x 10 rows / 4 prompts per step"
    with pytest.raises(ConfigError, match=re.escape("peft_config.lora_dropout=0.1: not supported (model.lora takes "
                                                    "r, lora_alpha, target_modules, init_lora_weights)")):
        mmrl.Trainer(model=TINY_SD3, peft_config=LoraConfig(r=8, lora_dropout=0.1))
    with pytest.raises(ConfigError, match="num_train_epochs needs train_dataset"):
        mmrl.Trainer(model=TINY_SD3, args=mmrl.FlowGRPOConfig(num_train_epochs=1))


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
    assert summary["steps_logged"] == 3 and (Path(summary["output_dir"]) / "metrics.jsonl").is_file()
    assert namespace["metrics"]["eval/reward/mean"] is not None
    assert (tmp_path / "runs" / "python_api-diffusers" / "mmrl_export.json").is_file()
