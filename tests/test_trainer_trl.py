"""`mmrl.Trainer` in the shape of TRL's GRPOTrainer: the typed recipe configs with TRL's names (and the table of them
in docs/python-api.md), the recipe and defaults from the model, transformers TrainerCallbacks, and the page's
"Porting a TRL GRPO script", run as written."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import mmrl
from mmrl import trl_names
from mmrl.config import ConfigError, load_config, to_yaml
from mmrl.testing import metrics_rows

ROOT = Path(__file__).resolve().parents[1]
TINY_SD3 = ROOT / "assets" / "tiny_sd3_shapes"
DOC = ROOT / "docs" / "python-api.md"
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]
SIZE_WHY = "transformer sample_size 16 x VAE scale 4; at most pos_embed_max_size 32 x patch 2 x VAE scale 4 = 256"


# ------------------------------------------------------------------------------------------ configs and TRL names
def test_recipe_configs_take_sections_and_trl_names():
    assert mmrl.GRPOConfig is mmrl.VLMGRPOConfig is load_config({"algorithm": "vlm_grpo"}).__class__
    assert mmrl.FlowGRPOConfig().algorithm == "flow_grpo" and mmrl.MultiTurnConfig().algorithm == "vlm_multiturn"
    assert mmrl.JanusGRPOConfig is load_config({"algorithm": "janus_grpo"}).__class__
    c = mmrl.VLMGRPOConfig("runs/x", learning_rate=1e-5, num_generations=4, per_device_train_batch_size=8,
                           gradient_accumulation_steps=2, max_completion_length=32, beta=0.01, epsilon=0.1,
                           temperature=0.9, bf16=True, logging_steps=5, report_to="none", loss_type="dr_grpo",
                           scale_rewards="none", lr_scheduler_type="linear", rollout={"top_p": 0.9})
    assert (c.output_dir, c.optim.lr, c.rollout.group_size, c.rollout.max_new_tokens, c.rollout.temperature) == \
        ("runs/x", 1e-5, 4, 32, 0.9)
    # 8 per device x 2 accumulation = 16 completions a step = 4 prompts x 4, one update
    assert (c.update.micro_batch_size, c.rollout.prompts_per_step, c.update.mini_batch_size) == (8, 4, 0)
    assert (c.algo.kl.coef, c.algo.clip_low, c.algo.clip_high, c.dtype) == (0.01, 0.1, 0.1, "bfloat16")
    assert (c.algo.loss_agg, c.algo.advantage, c.optim.lr_end_factor, c.log.trackers) == \
        ("seq-mean-token-sum-norm", "dr_grpo", 0.0, ["jsonl"])
    assert c.rollout.top_p == 0.9 and c.rollout.micro_batch_size == 64  # a section as a mapping keeps its defaults
    assert c.trainer_args == {"logging_steps": 5} and "logging_steps" not in to_yaml(c)
    assert (c.learning_rate, c.num_generations, c.epsilon, c.bf16, c.logging_steps) == (1e-5, 4, 0.1, True, 5)
    f = mmrl.FlowGRPOConfig(epsilon=0.01, beta=0.1, num_generations=6, scale_rewards="batch", update={"epochs": 2})
    assert (f.algo.clip_range, f.algo.kl.coef, f.rollout.group_size, f.reward.std_mode, f.update.epochs) == \
        (0.01, 0.1, 6, "global", 2)
    assert mmrl.DPOConfig(beta=500.0).algo.beta == 500.0  # DPO has no KL term: TRL DPOConfig's beta
    assert mmrl.VLMGRPOConfig(epsilon=0.2, epsilon_high=0.28).algo.clip_high == 0.28
    assert not hasattr(mmrl.FlowGRPOConfig(), "temperature") and not hasattr(c, "nonsense")


@pytest.mark.parametrize("make, message", [
    (lambda: mmrl.FlowGRPOConfig(temperature=0.7),
     "FlowGRPOConfig: temperature: TRL's temperature has no counterpart in flow_grpo; a diffusion rollout's "
     "randomness is its SDE noise (rollout.noise_level)"),
    (lambda: mmrl.VLMGRPOConfig(push_to_hub=True),
     "VLMGRPOConfig: push_to_hub: TRL's push_to_hub has no counterpart in vlm_grpo; write the model with "
     "trainer.save_model(DIR) and upload DIR"),
    (lambda: mmrl.VLMGRPOConfig(steps_per_generation=4), "steps_per_generation: TRL's steps_per_generation has no "
     "counterpart in vlm_grpo; one batch is sampled per step"),
    (lambda: mmrl.VLMGRPOConfig(vllm_mode="colocate"), "vllm_mode: TRL's vllm_mode has no counterpart in vlm_grpo"),
    (lambda: mmrl.VLMGRPOConfig(learning_rat=1e-5), "VLMGRPOConfig: unknown keyword 'learning_rat': expected one of "
     "the config's keys ['algo', 'algorithm', 'data'"),
    (lambda: mmrl.FlowGRPOConfig(epsilon=0.1, epsilon_high=0.2), "FlowGRPOConfig: epsilon_high=0.2: flow_grpo clips "
     "the ratio symmetrically (algo.clip_range); give epsilon alone"),
    (lambda: mmrl.VLMGRPOConfig(per_device_train_batch_size=6, num_generations=4),
     "per_device_train_batch_size x gradient_accumulation_steps = 6 completions per step must be a multiple of "
     "num_generations = 4 (rollout.group_size): a step's completions are whole groups"),
    (lambda: mmrl.VLMGRPOConfig(learning_rate=-1), "VLMGRPOConfig: learning_rate=-1 (-> optim.lr): optim.lr: "
     "expected > 0, got -1.0"),
    (lambda: mmrl.VLMGRPOConfig(loss_type="bnpo"), "loss_type='bnpo': expected one of ['dapo', 'grpo', 'dr_grpo']"),
    (lambda: mmrl.VLMGRPOConfig(report_to="mlflow"), "report_to: 'mlflow' is not a tracker here; valid: 'none', "
     "'tensorboard', 'wandb'"),
    (lambda: mmrl.VLMGRPOConfig(bf16=True, fp16=True), "bf16=True and fp16=True: choose one (dtype)"),
    (lambda: mmrl.VLMGRPOConfig(num_train_epochs=1, max_steps=5), "num_train_epochs and max_steps: give one"),
    (lambda: mmrl.VLMGRPOConfig(mask_truncated_completions=True), "mask_truncated_completions=True: not supported; "
     "overlong responses: reward.overlong_buffer"),
    (lambda: mmrl.MultiTurnConfig(loss_type="dapo"), "loss_type: TRL's loss_type has no counterpart in "
     "vlm_multiturn"),
    (lambda: mmrl.VLMGRPOConfig("a", "b"), "VLMGRPOConfig: one positional argument (output_dir) at most"),
])
def test_a_trl_name_without_a_meaning_here_is_one_line(make, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make()


def test_the_trl_table_in_the_docs_is_the_code_s():
    """Every TRL name of docs/python-api.md's table is one the configs take, and every one they take is there."""
    section = DOC.read_text().split("### TRL names")[1].split("\n## ")[0]
    documented = {n for row in re.findall(r"^\| (.+?) \|", section, re.M) for n in re.findall(r"`(\w+)`", row)}
    taken = {n for names, _ in trl_names.GROUPS for n in names} | set(trl_names.TRAINER_ARGS)
    assert documented - {"TRL"} == taken


# ------------------------------------------------------------------------------------------ recipe and defaults
def test_the_recipe_and_its_defaults_come_from_the_model(tmp_path):
    from mmrl.tiny import build_tiny_qwen2_vl

    bare = mmrl.Trainer(model=TINY_SD3, reward_funcs="jpeg_compressibility", train_dataset=PROMPTS)
    assert bare.args.algorithm == "flow_grpo" and bare.args.model.path == str(TINY_SD3)
    assert bare.derived == {"rollout.height": f"64: the model's own size ({SIZE_WHY})",
                            "rollout.width": f"64: the model's own size ({SIZE_WHY})"}
    odd = mmrl.Trainer(model=TINY_SD3, args=mmrl.FlowGRPOConfig(num_generations=6))
    assert odd.args.update.mini_batch_size == 12 and odd.derived["update.mini_batch_size"] == (
        "12: the recipe's 48 does not divide the batch of 24 (rollout.prompts_per_step x group_size); 2 updates per "
        "step, as the recipe's default")
    with pytest.raises(ConfigError, match=re.escape(f"rollout.height=1024: model {TINY_SD3} takes images of at most "
                                                    f"256 px ({SIZE_WHY}); use 64 or less")):
        mmrl.Trainer(model=TINY_SD3, args=mmrl.FlowGRPOConfig(rollout={"height": 1024}))
    vlm = build_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    v = mmrl.Trainer(model=vlm, train_dataset=[{"prompt": "What color?", "answer": "red"}])
    assert v.args.algorithm == "vlm_grpo" and v.args.model.path == str(vlm)
    assert v.derived == {"data.template": "'{prompt}': train_dataset's prompts are used as written (TRL's way)"}
    bare = mmrl.Trainer(model=vlm, reward_funcs=lambda completions, **k: [float("red" in c) for c in completions],
                        train_dataset=[{"prompt": "What color?"}], output_dir=tmp_path / "run")
    bare.args.train.max_steps = 1  # vlm_grpo's defaults otherwise: 8 prompts x 8 responses, a LoRA of rank 64
    bare.train()
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1]
    with pytest.raises(ConfigError, match=re.escape(f"args is a VLMGRPOConfig (vlm_grpo, vlm models) but model "
                                                    f"{TINY_SD3} is a diffusers pipeline: use mmrl.FlowGRPOConfig")):
        mmrl.Trainer(model=TINY_SD3, args=mmrl.GRPOConfig())
    with pytest.raises(FileNotFoundError, match=re.escape("model.path 'Qwen/Qwen2-VL-2B-Instruct' does not exist: "
                                                          "expected a local diffusers pipeline directory")):
        mmrl.Trainer(model="Qwen/Qwen2-VL-2B-Instruct")
    with pytest.raises(ConfigError, match=re.escape("Trainer: pass model= (a diffusers pipeline or transformers VLM")):
        mmrl.Trainer()


@pytest.mark.slow
def test_a_call_without_settings_trains_the_tiny_sd3(tmp_path):
    """The recipe's own batch (4 prompts x 24 images, 10 SDE steps, CFG) at the model's size: one step (it failed
    with `Height (64) cannot be greater than pos_embed_max_size: 32` inside diffusers)."""
    sizes = []

    def brightness(images, **kwargs):
        sizes.append(tuple(images.shape))
        return images.mean(dim=(1, 2, 3))

    t = mmrl.Trainer(model=TINY_SD3, reward_funcs=brightness, train_dataset=PROMPTS,
                     args=mmrl.FlowGRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1))
    t.train()
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1]
    assert (96, 3, 64, 64) in sizes and {s[1:] for s in sizes} == {(3, 64, 64)}  # (and the sample grids' images)


# ------------------------------------------------------------------------------------------ transformers callbacks
def test_transformers_callbacks_get_the_events_that_exist_here(tmp_path):
    """A TrainerCallback used to crash with a TypeError after step 1 (it was called as on_log(step, metrics))."""
    from transformers import TrainerCallback

    events = []

    class Recorder(TrainerCallback):
        def on_init_end(self, args, state, control, **kwargs):
            events.append(("init_end", state.global_step))

        def on_train_begin(self, args, state, control, **kwargs):
            events.append(("train_begin", state.global_step, state.max_steps, args.learning_rate))

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("step_end", state.global_step))
            control.should_training_stop = state.global_step == 3

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("log", state.global_step, "reward/mean" in logs))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            events.append(("evaluate", state.global_step, "eval/reward/mean" in metrics))

        def on_save(self, args, state, control, checkpoint=None, **kwargs):
            events.append(("save", state.global_step, Path(checkpoint).name))

        def on_train_end(self, args, state, control, **kwargs):
            events.append(("train_end", state.global_step, len(state.log_history)))

    args = mmrl.FlowGRPOConfig(output_dir=str(tmp_path / "run"), max_steps=5, save_steps=2, logging_steps=2,
                               learning_rate=1e-3, num_generations=2, per_device_train_batch_size=4,
                               eval_steps=3, rollout={"num_steps": 2, "guidance_scale": 1.0, "eval_num_steps": 2},
                               log={"sample_every": 0})
    t = mmrl.Trainer(model=TINY_SD3, reward_funcs="jpeg_compressibility", train_dataset=PROMPTS,
                     eval_dataset=PROMPTS[:1], args=args, callbacks=[Recorder])
    t.train()
    assert events == [("init_end", 0), ("train_begin", 0, 5, 1e-3),
                      ("step_end", 1), ("evaluate", 1, True),  # log.eval_every: after step 1 and every 3
                      ("step_end", 2), ("log", 2, True), ("save", 2, "step_2"),
                      ("step_end", 3), ("evaluate", 3, True), ("save", 3, "step_3"),  # stopped: step 3 saved
                      ("train_end", 3, 1)]
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1, 2, 3]
    events.clear()
    t.train()  # resumes at step 3
    assert events == [("train_begin", 3, 5, 1e-3), ("step_end", 4), ("log", 4, True), ("save", 4, "step_4"),
                      ("step_end", 5), ("log", 5, True), ("evaluate", 5, True), ("save", 5, "step_5"),
                      ("train_end", 5, 3)]


def test_transformers_callbacks_with_events_mmrl_has_not_are_refused():
    from transformers import ProgressCallback, TrainerCallback

    class PerEpoch(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            pass

    events = "on_init_end, on_train_begin, on_step_end, on_log, on_evaluate, on_save, on_train_end"
    with pytest.raises(ConfigError, match=re.escape(f"callbacks[1]: PerEpoch implements on_epoch_end, which mmrl never "
                                                    f"calls (its events: {events}); move that code")):
        mmrl.Trainer(model=TINY_SD3, callbacks=[lambda step, metrics: None, PerEpoch()])
    with pytest.raises(ConfigError, match=re.escape("callbacks[0]: ProgressCallback implements on_prediction_step, "
                                                    "on_predict, which mmrl never calls")):
        mmrl.Trainer(model=TINY_SD3, callbacks=[ProgressCallback])
    with pytest.raises(TypeError, match=re.escape("callbacks[0] 3: expected a function f(step, metrics), an object "
                                                  "with on_log / on_samples / on_videos / on_save, or a transformers "
                                                  "TrainerCallback")):
        mmrl.Trainer(model=TINY_SD3, callbacks=[3])


# ------------------------------------------------------------------------------------------ porting a TRL script
def _port_diff() -> tuple[str, str, list[str]]:
    """(the TRL script, the mmrl script, the changed lines) of the page's diff block."""
    block = re.search(r"## Porting a TRL GRPO script.*?```diff\n(.*?)```", DOC.read_text(), re.S).group(1)
    lines = block.splitlines()
    assert all(ln[:1] in " -+" or not ln for ln in lines), "every diff line starts with ' ', '-' or '+'"
    trl = "".join(ln[1:] + "\n" for ln in lines if not ln.startswith("+"))
    ours = "".join(ln[1:] + "\n" for ln in lines if not ln.startswith("-"))
    return trl, ours, [ln for ln in lines if ln.startswith(("-", "+"))]


def test_the_port_changes_only_imports_and_the_config_class():
    import ast

    trl, ours, changed = _port_diff()
    assert changed == ["-from trl import GRPOConfig, GRPOTrainer", "+from mmrl import GRPOTrainer, VLMGRPOConfig",
                       "-training_args = GRPOConfig(", "+training_args = VLMGRPOConfig("]
    assert "mmrl" not in trl and "trl" not in ours.replace("control", "")
    # every keyword the TRL side gives its GRPOConfig is one TRL has (GRPOConfig's fields or TrainingArguments')
    from transformers import TrainingArguments

    call = next(n for n in ast.walk(ast.parse(trl)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") ==
                "GRPOConfig")
    known = trl_names.TRL_GRPO_FIELDS | {f.name for f in dataclasses.fields(TrainingArguments)}
    assert {k.arg for k in call.keywords} <= known


def test_the_ported_script_runs_as_written(tmp_path, monkeypatch):
    from mmrl.tiny import build_tiny_qwen2_vl

    _, ours, _ = _port_diff()
    monkeypatch.chdir(tmp_path)
    build_tiny_qwen2_vl(tmp_path / "runs" / "tiny_models" / "qwen2_vl")
    namespace: dict = {}
    exec(compile(ours, "docs/python-api.md (Porting a TRL GRPO script)", "exec"), namespace)
    run = tmp_path / "runs" / "grpo-vlm"
    assert [r["step"] for r in metrics_rows(run)] == [1, 2]
    cfg = load_config(run / "config.yaml")
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.optim.lr) == \
        (2, 2, 8, 1e-5)  # per_device_train_batch_size 4 / num_generations 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert (tmp_path / "runs" / "grpo-vlm-model" / "config.json").is_file()
