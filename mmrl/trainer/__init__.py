"""The Python trainer API, in the shape of TRL's GRPOTrainer (docs/python-api.md):

    import mmrl

    def brightness(images, prompts, **kwargs):                 # one float per image, images float NCHW in [0, 1]
        return images.mean(dim=(1, 2, 3))

    trainer = mmrl.Trainer(model="assets/tiny_sd3_shapes", reward_funcs=[brightness, "jpeg_compressibility"],
                           args=mmrl.FlowGRPOConfig(output_dir="runs/api", max_steps=20),
                           train_dataset=["a red circle on a blue background", ...])
    summary = trainer.train()                                  # what `mmrl train` prints; checkpoints as usual
    metrics = trainer.evaluate(["a green square"])             # eval/* of the newest checkpoint
    trainer.save_model("exports/api", format="diffusers")      # mmrl.export

It is a thin layer over the recipes' `train(cfg)`, not a second engine: `args` is the recipe's own config
(`mmrl.FlowGRPOConfig` is `mmrl.diffusion.flow_grpo.Config`; TRL's flat names such as `learning_rate` set the keys
they mean, `mmrl.trl_names`), written to `output_dir/config.yaml` like any run; the datasets (and a loaded model
object) are written under `output_dir/inputs/` and named by the config's keys (`mmrl.trainer.inputs`); reward
functions are registered in the reward zoo while the run uses them, under the names `python:<function name>`. So a
run started here is the run `mmrl train` makes: same checkpoints, metrics, sample grids, resume (call `train()`
again), `mmrl eval` and `mmrl export`.

Without `args` the recipe comes from the model (a diffusers pipeline: flow_grpo, a transformers VLM: vlm_grpo); the
recipe defaults a model or dataset cannot work with are fitted to them (`mmrl.trainer.defaults`, listed in
`trainer.derived`). Callbacks: functions `f(step, metrics)`, objects with `on_log(step, metrics)`,
`on_samples(step, name, images, captions)`, `on_videos(...)`, `on_save(step, checkpoint)`,
`on_train_end(summary)`, and transformers `TrainerCallback`s (`mmrl.trainer.callbacks`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping, Sequence

from mmrl.config import ConfigError, apply_overrides, recipe_module
from mmrl.trainer import callbacks as hf_callbacks
from mmrl.trainer import defaults, inputs
from mmrl.trainer.inputs import INPUTS_DIR

__all__ = ["Trainer"]

SAVE_FORMATS = {"diffusion": "diffusers", "vlm": "transformers"}  # save_model's default: a merged, loadable model


class Trainer:
    """A recipe run built from Python objects (see the module docstring); `train()`, `evaluate()`, `save_model()`."""

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: Sequence[Any] | None = None,
                 peft_config: Any = None, *, reward_weights: Sequence[float] | None = None,
                 output_dir: str | Path | None = None, overrides: Mapping[str, Any] | Sequence[str] = ()):
        info = defaults.inspect_model(model, processing_class)
        self.args = defaults.recipe_of(args, info)
        self.family = defaults.family_of(self.args.algorithm)  # "diffusion" | "vlm" | "joint"
        if output_dir is not None:
            self.args.output_dir = str(output_dir)
        self.model_object, self.processing_class = (None, None) if info is None or info.path is not None \
            else (model, processing_class)
        if info is not None:
            self.args.model.path = str(info.path) if info.path is not None else \
                str(Path(self.args.output_dir) / INPUTS_DIR / "model")
        if self.model_object is not None and info.kind == "vlm" and processing_class is None:
            self.processing_class = _processor_of(model)
        self.derived: dict[str, str] = {}
        if peft_config is not None:
            self.derived.update(defaults.apply_peft_config(self.args, peft_config))
        items = [f"{k}={v if isinstance(v, str) else _json(v)}" for k, v in overrides.items()] \
            if isinstance(overrides, Mapping) else list(overrides)
        apply_overrides(self.args, items)
        trainer_args = dict(self.args.__dict__.get("trainer_args", {}))
        if reward_weights is not None and "reward_weights" in trainer_args:
            raise ConfigError("reward_weights: given to Trainer and to the config; give it once")
        self.rewards = inputs.reward_specs(reward_funcs, trainer_args.get("reward_weights", reward_weights))
        if self.rewards and self.args.algorithm == "vlm_multiturn":
            raise ConfigError("vlm_multiturn takes its rewards from its environments (env.tasks); reward_funcs is not "
                              "used: pass rewards through an Env (mmrl.vlm.envs)")
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self._check_dataset(train_dataset, "train_dataset")
        self._check_dataset(eval_dataset, "eval_dataset")
        self.derived.update(defaults.fit(self.args, info, train_dataset is not None))
        if "num_train_epochs" in trainer_args:
            if train_dataset is None:
                raise ConfigError("num_train_epochs needs train_dataset (steps = epochs x rows / "
                                  "rollout.prompts_per_step); or give max_steps")
            steps = defaults.steps_for_epochs(self.args, trainer_args["num_train_epochs"], len(train_dataset))
            self.args.train.max_steps = steps
            self.derived["train.max_steps"] = f"{steps!r}: num_train_epochs x {len(train_dataset)} rows / " \
                                              f"{self.args.rollout.prompts_per_step} prompts per step"
        if self.rewards:
            self._set_reward_config()
        plain, hf = hf_callbacks.split_callbacks(list(callbacks or ()))
        self.callbacks = plain
        self.hf_callbacks = hf_callbacks.TransformersCallbacks(hf, self.args) if hf else None
        if self.hf_callbacks is not None:
            self.hf_callbacks.rows = len(train_dataset) if train_dataset is not None else 0
            self.hf_callbacks.init_end()

    # ------------------------------------------------------------------ config
    def _set_reward_config(self) -> None:
        names = {name: weight for name, _, weight in self.rewards}
        if self.family == "diffusion":
            self.args.reward.components = names
        elif len(names) == 1 and next(iter(names.values())) == 1.0:
            self.args.reward.name, self.args.reward.kwargs = next(iter(names)), {}
        else:
            self.args.reward.name, self.args.reward.kwargs = "composite", {"components": names}

    def _needs_answer(self) -> bool:
        """A zoo reward scores VLM responses against the rows' `answer` (a Python function reads what it names)."""
        return any(model is None for _, model, _ in self.rewards) or not self.rewards

    def _check_dataset(self, data: Any, where: str) -> None:
        if data is None:
            return
        if self.args.algorithm not in ("vlm_grpo",) and self.family != "diffusion":
            raise ConfigError(f"{self.args.algorithm}: {where} is not used by this recipe (its data comes from "
                              f"env.tasks or the config's data section)")
        if not inputs.is_hf_dataset(data) and (isinstance(data, (str, bytes)) or not isinstance(data, Sequence)):
            raise ConfigError(f"{where}: expected a list or a datasets.Dataset, got {type(data).__name__}")
        if len(data) == 0:
            raise ConfigError(f"{where}: empty")
        if self.family == "vlm":
            first = data[0]
            columns = data.column_names if inputs.is_hf_dataset(data) else list(first) if isinstance(first, Mapping) \
                else []
            shown = f"{where}: row 0" if columns else f"{where}: row 0 ({first!r:.40})"
            inputs.check_vqa_columns(columns, first, shown, self._needs_answer())

    def _write_inputs(self, cfg: Any) -> None:
        """Datasets and a model object -> files under output_dir/inputs/, named by `cfg`'s keys."""
        folder = Path(cfg.output_dir) / INPUTS_DIR
        if self.model_object is not None:
            folder.mkdir(parents=True, exist_ok=True)
            cfg.model.path = inputs.write_model(self.model_object, self.processing_class, folder / "model")
        if self.family == "diffusion":
            if self.train_dataset is not None:
                cfg.data.train_prompts = inputs.write_dataset(self.train_dataset, folder / "train_prompts",
                                                              inputs.prompt_row)
            if self.eval_dataset is not None:
                cfg.data.eval_prompts = inputs.write_dataset(self.eval_dataset, folder / "eval_prompts",
                                                             inputs.prompt_row)
        elif cfg.algorithm == "vlm_grpo":
            if self.train_dataset is not None:
                cfg.data.kind, cfg.data.path = "geo3k", self._write_vqa(self.train_dataset, folder, "train")
            if self.eval_dataset is not None:
                cfg.data.val_path = self._write_vqa(self.eval_dataset, folder, "eval")

    def _write_vqa(self, data: Any, folder: Path, name: str, keep: bool = True) -> str:
        if inputs.is_hf_dataset(data):
            data = inputs.prepare_hf_vqa(data, f"{name} dataset", self._needs_answer())
        return inputs.write_dataset(data, folder / name, inputs.vqa_row(folder / "images" / name, self._needs_answer()),
                                    keep=keep)

    # ------------------------------------------------------------------ running
    def train(self) -> dict:
        """Run the recipe (resuming from `output_dir`'s newest checkpoint, as `mmrl train` does); returns its
        summary."""
        from mmrl.run.trackers import callbacks_active

        cfg = copy.deepcopy(self.args)
        out, folder = Path(cfg.output_dir), Path(cfg.output_dir) / INPUTS_DIR
        before = (out.exists(), set(folder.iterdir()) if folder.is_dir() else None)
        reporting = list(self.callbacks) + ([self.hf_callbacks] if self.hf_callbacks is not None else [])
        try:
            with inputs.rewards_registered(self.rewards):
                self._write_inputs(cfg)
                if self.hf_callbacks is not None:
                    self.hf_callbacks.train_begin(cfg)
                with callbacks_active(reporting):
                    summary = recipe_module(cfg.algorithm).train(cfg)
        except BaseException:
            inputs.remove_new_inputs(out, *before)
            raise
        self.last_config = cfg
        for cb in self.callbacks:
            if hasattr(cb, "on_train_end"):
                cb.on_train_end(summary)
        if self.hf_callbacks is not None:
            self.hf_callbacks.train_end()
        return summary

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict:
        """The recipe's held-out evaluation (`mmrl.trainer.evaluation`) of the newest checkpoint of `output_dir` (the
        trained weights; before any, the base model) on `eval_dataset` (default: the Trainer's); returns its
        metrics, keys `<metric_key_prefix>/...`, and passes them to the callbacks' `on_evaluate`."""
        from mmrl.trainer import evaluation

        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if data is None:
            raise ConfigError("evaluate(): no eval_dataset; pass it to Trainer(...) or to evaluate()")
        self._check_dataset(data, "eval_dataset")
        cfg = copy.deepcopy(getattr(self, "last_config", self.args))
        folder = Path(cfg.output_dir) / INPUTS_DIR
        with inputs.rewards_registered(self.rewards):
            if self.model_object is not None:
                folder.mkdir(parents=True, exist_ok=True)
                cfg.model.path = inputs.write_model(self.model_object, self.processing_class, folder / "model")
            if self.family == "diffusion":
                prompts = inputs.write_dataset(data, folder / "evaluate_prompts", inputs.prompt_row, keep=False)
                metrics = evaluation.evaluate_diffusion(cfg, prompts)
            else:
                metrics = evaluation.evaluate_vlm(cfg, self._write_vqa(data, folder, "evaluate", keep=False))
        metrics = {metric_key_prefix + k[len("eval"):]: v for k, v in metrics.items()}
        if self.hf_callbacks is not None:
            self.hf_callbacks.evaluated(metrics)
        return metrics

    def save_model(self, output_dir: str | Path | None = None, format: str | None = None, *,  # noqa: A002
                   state: str = "default", overwrite: bool = False) -> dict:
        """The newest checkpoint's policy written by `mmrl.export.export` in `format` (default: the merged model,
        "diffusers" or "transformers"; also "diffusers-lora", "kohya", "peft") into `output_dir` (default:
        `<run dir>-<format>` beside the run directory); returns the export's metadata."""
        from mmrl.export import FORMATS, export
        from mmrl.trainer.evaluation import newest_checkpoint

        fmt = format or SAVE_FORMATS.get(self.family)
        if fmt not in FORMATS:
            raise ConfigError(f"save_model: format {fmt!r} unknown; valid: {sorted(FORMATS)}")
        run_dir = Path(self.args.output_dir)
        target = Path(output_dir) if output_dir is not None else run_dir.with_name(f"{run_dir.name}-{fmt}")
        if target.resolve() == run_dir.resolve() or run_dir.resolve() in target.resolve().parents:
            raise ConfigError(f"save_model({str(target)!r}): that is inside the run directory {run_dir} (its "
                              f"checkpoints, resumed and pruned by mmrl); save to a directory outside it, e.g. "
                              f"{str(run_dir.with_name(run_dir.name + '-' + fmt))!r}")
        checkpoint = newest_checkpoint(run_dir)
        if checkpoint is None:
            raise ConfigError(f"save_model: {run_dir} has no complete checkpoint yet; call train() first")
        return export(checkpoint, fmt, target, state=state, overwrite=overwrite)


def _processor_of(model: Any) -> Any:
    """The processor of a loaded transformers model when it was loaded from a local directory; else one line."""
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    if source.is_dir() and any((source / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(source))
    raise ConfigError(f"processing_class: a loaded {type(model).__name__} needs its processor (it is saved with the "
                      f"model under output_dir/inputs/model): pass processing_class=AutoProcessor.from_pretrained(...)")


def _json(value: Any) -> str:
    import json

    return json.dumps(value)
