"""transformers `TrainerCallback`s in an mmrl run: the events that exist here reach them with a transformers
`TrainerState` and `TrainerControl`, and `args` the run's config (TRL's names readable on it: `args.learning_rate`).

| event | when |
|---|---|
| `on_init_end` | at the end of `Trainer(...)` |
| `on_train_begin` | `train()`, before the run starts (`state.global_step`: the checkpoint it resumes from, else 0) |
| `on_step_end` | after every step's metrics row |
| `on_log` | after `on_step_end` every `logging_steps` steps and at the last step, `logs` = the metrics row |
| `on_evaluate` | after a step that evaluated (`metrics`: its `eval/*` keys) and after `trainer.evaluate()` |
| `on_save` | after a checkpoint is complete (`checkpoint=` its directory) |
| `on_train_end` | when `train()` has finished |

`control.should_training_stop` set by any of them ends the run after that step (its checkpoint written). The other
events of transformers' Trainer (epochs, sub-steps, optimizer steps, predictions, hub pushes) do not exist here: a
callback that implements one is refused when the Trainer is built. Only the main process sees the per-step events.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from mmrl.config import ConfigError

EVENTS = ("on_init_end", "on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")
NOT_HERE = ("on_epoch_begin", "on_epoch_end", "on_step_begin", "on_substep_end", "on_pre_optimizer_step",
            "on_optimizer_step", "on_prediction_step", "on_predict", "on_push_begin")


def is_transformers_callback(cb: Any) -> bool:
    cls = cb if isinstance(cb, type) else type(cb)
    return any(c.__name__ == "TrainerCallback" and c.__module__.startswith("transformers") for c in cls.__mro__)


def split_callbacks(callbacks: Sequence[Any]) -> tuple[list, list]:
    """(mmrl's own callbacks, transformers TrainerCallback instances); each checked, a class instantiated as
    transformers' Trainer does."""
    from mmrl.run.trackers import check_callback

    plain, hf = [], []
    for i, cb in enumerate(callbacks):
        if not is_transformers_callback(cb):
            check_callback(cb, f"callbacks[{i}]")
            plain.append(cb)
            continue
        cb = cb() if isinstance(cb, type) else cb
        from transformers import TrainerCallback

        used = [e for e in NOT_HERE if getattr(type(cb), e) is not getattr(TrainerCallback, e)]
        if used:
            raise ConfigError(f"callbacks[{i}]: {type(cb).__name__} implements {', '.join(used)}, which mmrl never "
                              f"calls (its events: {', '.join(EVENTS)}); move that code to one of these or leave the "
                              f"callback out")
        hf.append(cb)
    return plain, hf


class TransformersCallbacks:
    """The TrainerCallbacks of one Trainer, driven by mmrl's events (module docstring). It is itself one of mmrl's
    callbacks (`on_log(step, metrics)`, `on_save(step, checkpoint)`; `mmrl.run.trackers.CallbackTracker`), so the
    run reports to it like to any callback."""

    def __init__(self, callbacks: list, args: Any):
        from transformers import TrainerControl, TrainerState

        self.callbacks, self.args = callbacks, args
        rank0 = os.environ.get("RANK", "0") == "0"
        self.state = TrainerState(is_world_process_zero=rank0, is_local_process_zero=os.environ.get("LOCAL_RANK", "0")
                                  == "0")
        self.control = TrainerControl()
        self.rows = 0  # train_dataset rows (epochs in state.epoch); 0 = unknown

    @property
    def stop_requested(self) -> bool:
        return bool(self.control.should_training_stop)

    def _call(self, event: str, **kwargs: Any) -> None:
        for cb in self.callbacks:
            result = getattr(cb, event)(self.args, self.state, self.control, **kwargs)
            if result is not None:  # transformers' CallbackHandler: a returned control replaces it
                self.control = result

    def _step(self, step: int) -> None:
        cfg = self.args
        self.state.global_step = step
        if self.rows and hasattr(cfg, "rollout"):
            self.state.epoch = step * cfg.rollout.prompts_per_step / self.rows

    # ---------------------------------------------------------------- what the Trainer calls
    def init_end(self) -> None:
        self._call("on_init_end")

    def train_begin(self, cfg: Any) -> None:
        from mmrl.run.files import checkpoint_step
        from mmrl.trainer.evaluation import newest_checkpoint

        newest = newest_checkpoint(cfg.output_dir) if cfg.train.resume == "auto" else None
        start = checkpoint_step(newest) if newest is not None else 0  # the step the run resumes from
        self.args = cfg
        self.state.max_steps = cfg.train.max_steps
        self.state.save_steps = cfg.train.save_every
        self.state.logging_steps = getattr(cfg, "logging_steps", 1)
        self.state.eval_steps = getattr(getattr(cfg, "log", None), "eval_every", 0)
        self.state.train_batch_size = getattr(getattr(cfg, "update", None), "micro_batch_size", None)
        self.control.should_training_stop = False
        self._step(start)
        self._call("on_train_begin")

    def train_end(self) -> None:
        self._call("on_train_end")

    def evaluated(self, metrics: dict) -> None:
        self._call("on_evaluate", metrics=dict(metrics))

    # ---------------------------------------------------------------- what the run calls (main process)
    def on_log(self, step: int, metrics: dict) -> None:
        self._step(step)
        self._call("on_step_end")
        logs = {k: v for k, v in metrics.items() if k != "step"}
        every = self.state.logging_steps or 1
        if step % every == 0 or step == self.state.max_steps:
            self.state.log_history.append({**logs, "step": step})
            self._call("on_log", logs=logs)
        evaluated = {k: v for k, v in logs.items() if k.startswith("eval/")}
        if evaluated:
            self._call("on_evaluate", metrics=evaluated)

    def on_save(self, step: int, checkpoint: Any) -> None:
        self._step(step)
        self._call("on_save", checkpoint=str(checkpoint))
