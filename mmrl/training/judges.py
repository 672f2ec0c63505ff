"""Judges and the reward-hacking alarm (`log.judges`, `log.hacking`), shared by the recipes that evaluate.

A judge is a zoo reward the run never trains on. At every evaluation the recipe scores its fixed held-out prompts
(one deterministic sample each) with the training reward AND every judge; `JudgePanel.observe` compares each
score prompt by prompt with the baseline evaluation (before the first update) and raises the alarm when the
training reward rose while a judge fell, each beyond its noise (the rule and its noise estimate:
`mmrl.core.hacking`). It logs, per evaluation:

    eval/judge/<name>          the judge's mean over the held-out prompts
    eval/judge/<name>/delta    change since the baseline;  eval/judge/<name>/noise  the threshold it must exceed
    eval/judge/reward/delta    the training reward's change (on the same prompts); eval/judge/reward/noise
    eval/hacking               1 when this evaluation meets the rule (reward rose and a judge fell), else 0
    eval/hacking_alarm         1 from the evaluation where `hacking.patience` consecutive ones fired the alarm on
    eval/hacking_no_verdict    1 (instead of eval/hacking) when the training reward, or every judge, was compared on
                               fewer than `mmrl.core.hacking.MIN_PROMPTS` finite prompts: no verdict, and a line
                               says so ("no verdict: K finite prompts < 8"); such a score logs no `noise`

The run summary prints one line (fired at step N and which judge fell, or quiet) and reports `hacking_alarm`,
`hacking_alarm_step`. With `hacking.stop: true` the run stops after the step that fired the alarm (a checkpoint is
written first). The panel's baseline and counters are checkpointed, so a resumed run compares with the same
baseline.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmrl.core.hacking import MIN_PROMPTS, ScoreChange, hacking_verdict, score_change

__all__ = ["HackingConfig", "JudgeFields", "JudgePanel", "build_judges", "check_judges", "judge_summary",
           "learned_reward_judges", "stop_for_hacking"]


@dataclass
class HackingConfig:
    """The alarm rule's constants (mmrl.core.hacking)."""

    z: float = 2.0
    """A change counts only beyond z standard errors of the per-prompt paired differences (over the held-out set)."""
    min_effect: float = 0.5
    """A judge's fall counts only beyond min_effect baseline spreads too (its std over the held-out prompts at the
    baseline evaluation); the training reward's rise needs the z test only."""
    patience: int = 1
    """Fire the alarm after this many consecutive evaluations that meet the rule."""
    stop: bool = False
    """Stop the run (after writing a checkpoint) at the step that fires the alarm."""

    def __post_init__(self) -> None:
        if self.z < 0 or self.min_effect < 0:
            raise ValueError(f"log.hacking.z and log.hacking.min_effect must be >= 0, got {self.z}, {self.min_effect}")
        if self.patience < 1:
            raise ValueError(f"log.hacking.patience: expected >= 1, got {self.patience}")


@dataclass
class JudgeFields:
    """`log:` keys of a recipe that evaluates: the judges and the alarm rule. Put it first among the bases
    (``class LogConfig(JudgeFields, Base)``)."""

    judges: dict[str, Any] = field(default_factory=dict)
    """Rewards never trained on, scored with the training reward on the evaluation prompts at every evaluation (and
    once before the first update, the baseline): name -> load kwargs ({} or null for none; `reward: <zoo name>`
    to load a zoo reward under another name). Empty = no judges, no alarm."""
    hacking: HackingConfig = field(default_factory=HackingConfig)
    """The reward-hacking alarm: reward rose while a judge fell beyond their noise (z, min_effect, patience, stop)."""
    learned_judge: bool = True
    """With a `learned_pref` reward among `reward.components` and `judges` empty: watch it with the model it was
    trained from (the `base` its mmrl_reward.json records) as the judge `<component>_base` (a line says so);
    false = no judge."""

    def __post_init__(self) -> None:
        for name, spec in self.judges.items():
            if spec is not None and not isinstance(spec, dict):
                raise ValueError(f"log.judges.{name}: expected a mapping of load kwargs (or null), got {spec!r}")
            if isinstance(spec, dict) and "weight" in spec:
                raise ValueError(f"log.judges.{name}: a judge has no weight (it is never trained on); remove 'weight'")
            _check_judge(name, spec)  # an unknown reward or argument: while the config is read, before any load
        post = getattr(super(), "__post_init__", None)  # the next base's checks
        if post is not None:
            post()


def _check_judge(name: str, spec: dict | None) -> tuple[str, dict]:
    """(zoo reward name, load kwargs) of judge `name`; ValueError naming `log.judges.<name>[.<arg>]` for a reward
    that does not exist or an argument it does not take (the valid ones listed)."""
    from mmrl.rewards.registry import check_reward_arguments

    kw = dict(spec or {})
    zoo = str(kw.pop("reward", name))
    check_reward_arguments(zoo, kw, f"log.judges.{name}")
    return zoo, kw


def _registered_kind(name: str, kwargs: dict) -> str | None:
    """What the reward registered under `name` scores (image, text, video) without building it; None when only the
    built reward knows (a factory, a remote reward without `kind`, a module that fails to import)."""
    from mmrl.rewards.registry import lookup

    if name == "remote":
        return kwargs.get("kind")
    try:
        obj = lookup(name)
    except Exception:  # noqa: BLE001 - an optional dependency missing: building it will say so
        return None
    kind = getattr(obj, "kind", None) if isinstance(obj, type) else None
    return kind if isinstance(kind, str) else None


def check_judges(log_cfg: Any, makes: str) -> None:
    """Before the run starts (no model loaded, no run directory): every `log.judges` entry names a known reward,
    with arguments it takes, that scores what the run makes (`makes`: image, video or text); a judge of another
    kind failed only at the baseline evaluation, after the model load."""
    from mmrl import rewards

    for name, spec in (getattr(log_cfg, "judges", None) or {}).items():
        zoo, kw = _check_judge(name, spec)  # an unknown reward or argument: named with the valid ones
        kind = _registered_kind(zoo, kw)
        if kind is not None and kind != makes:
            same = [n for n in rewards.available()  # the zoo's names (not tests' `_...` or the Trainer's `python:...`)
                    if n[0].isalpha() and ":" not in n and _registered_kind(n, {}) == makes]
            raise ValueError(f"log.judges.{name}: reward '{zoo}' scores {kind}s, but this run makes {makes}s; a "
                             f"judge scores what the run makes: name one that scores {makes}s ({', '.join(same)})")


def learned_reward_judges(components: dict[str, Any] | None, log_cfg: Any, evaluates: bool) -> None:
    """A reward fitted to few labels is the easiest to hack: with a `learned_pref` component, empty `log.judges` and
    `log.learned_judge` on, add the judge `<component>_base` = the model the learned reward was trained from (its
    `mmrl_reward.json`: zoo reward, `base` weights, arguments), printing one line. Without an evaluation (`evaluates`
    False) or a base on this machine, one line says that nothing watches it instead."""
    from mmrl.rewards.learned import SPEC_FILE

    if getattr(log_cfg, "judges", None) or not getattr(log_cfg, "learned_judge", False):
        return
    for key, value in (components or {}).items():
        spec = value if isinstance(value, dict) else {}
        if spec.get("reward", key) != "learned_pref":
            continue
        off = "log.learned_judge=false silences this"
        if not evaluates:
            print(f"[judges] reward.components.{key} is a learned reward and nothing watches it: set data.eval_prompts "
                  f"and log.eval_every > 0 (a judge of the model it was trained from is then added), or name "
                  f"log.judges; {off}", flush=True)
            return
        root = Path(str(spec.get("weights", "")))
        try:
            info = json.loads((root / SPEC_FILE).read_text())
            base = Path(info["base"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # not a reward_bt export: loading the reward names the problem
        if not base.exists():
            print(f"[judges] reward.components.{key} is a learned reward and nothing watches it: its base model {base} "
                  f"is not on this machine; name a judge in log.judges (docs/reward-hacking.md); {off}", flush=True)
            return
        kwargs = dict(info.get("kwargs") or {})
        if info.get("reward") == "pickscore":
            kwargs.setdefault("processor", str(root))  # the export holds the tokenizer and preprocessor of the base
        name = f"{key}_base"
        log_cfg.judges = {name: {"reward": info["reward"], "weights": str(base), **kwargs}}
        print(f"[judges] watching the learned reward reward.components.{key} with the model it was trained from: "
              f"log.judges.{name} = {info['reward']} on {base} (the default for a learned reward without judges; "
              f"{off})", flush=True)
        return


def build_judges(log_cfg: Any, device: Any, stateful: dict | None = None, eval_prompts: int | None = None,
                 eval_key: str = "log.eval_max_prompts") -> "JudgePanel | None":
    """The `JudgePanel` of `log.judges` (None when empty), registered in `stateful` as "judges" (checkpointed).
    `eval_prompts`: the number of held-out prompts the recipe evaluates; fewer than MIN_PROMPTS warns (the alarm
    can give no verdict), naming `eval_key`, the setting that limits them."""
    specs = getattr(log_cfg, "judges", None) or {}
    if not specs:
        return None
    if eval_prompts is not None and eval_prompts < MIN_PROMPTS:
        warnings.warn(f"log.judges: the evaluation has {eval_prompts} held-out prompts, fewer than the {MIN_PROMPTS} "
                      f"the reward-hacking alarm needs for a verdict (mmrl.core.hacking.MIN_PROMPTS): it will log no "
                      f"verdict; evaluate on at least {MIN_PROMPTS} prompts ({eval_key})", stacklevel=2)
    from mmrl import rewards

    judges = {}
    for name, spec in specs.items():
        zoo, kw = _check_judge(name, spec)  # again: log.judges may have been set after the config was read
        judges[name] = rewards.load(zoo, **{"device": str(device), **kw})  # a judge's own device wins
    panel = JudgePanel(judges, log_cfg.hacking)
    if stateful is not None:
        stateful["judges"] = panel
    return panel


class JudgePanel:
    """The judges of a run and the alarm state (module docstring). Judges added when a run resumes from a checkpoint
    written without them start fresh (stateful name "judges" is in `mmrl.run.checkpoint.FRESH_ON_RESUME`):
    their baseline is the first evaluation after the resumed step."""

    def __init__(self, judges: dict[str, Any], cfg: HackingConfig | None = None):
        if not judges:
            raise ValueError("JudgePanel needs at least one judge")
        bad = [n for n in judges if n == "reward" or "/" in n]
        if bad:
            raise ValueError(f"log.judges: names must not be 'reward' or contain '/', got {bad}")
        self.judges, self.cfg = dict(judges), cfg or HackingConfig()
        self.baseline: dict[str, list[float]] | None = None  # "reward" and every judge: per-prompt scores
        self.baseline_step: int | None = None
        self.consecutive = 0
        self.alarm_step: int | None = None
        self.alarm_judges: list[str] = []
        self.stop_requested = False

    # -------------------------------------------------------------------------------------- scoring

    def score(self, reward_scores: Any, **inputs: Any) -> dict[str, torch.Tensor]:
        """{"reward": the training reward's per-prompt scores, name: each judge's} (float64, cpu). `inputs` go to
        every judge as they go to a reward: images=, prompts=, metadata= (image judges) or completions=, ..."""
        out = {"reward": torch.as_tensor(reward_scores, dtype=torch.float64).detach().cpu().reshape(-1)}
        for name, judge in self.judges.items():
            s = judge(**inputs).scores.detach().to(torch.float64).cpu().reshape(-1)
            if s.shape != out["reward"].shape:
                raise ValueError(f"judge '{name}' returned {s.numel()} scores for {out['reward'].numel()} prompts")
            out[name] = s
        return out

    def observe(self, step: int, reward_scores: Any, **inputs: Any) -> dict[str, float]:
        """Score one evaluation (see `score`) and apply the rule against the baseline; the first call sets the
        baseline. Returns the metrics (module docstring)."""
        scores = self.score(reward_scores, **inputs)
        metrics = {f"eval/judge/{n}": float(_finite(s).mean()) if _finite(s).numel() else math.nan
                   for n, s in scores.items() if n != "reward"}
        if self.baseline is None:
            self.baseline = {n: s.tolist() for n, s in scores.items()}
            self.baseline_step = int(step)
            print(f"[judges] baseline at step {step}: " + ", ".join(f"{n} {float(s.mean()):.4g}"
                                                                    for n, s in scores.items()), flush=True)
            return metrics
        changes = {n: self._change(n, s) for n, s in scores.items()}
        for n, ch in changes.items():
            metrics[f"eval/judge/{n}/delta"] = ch.delta
            if ch.verdict:  # below MIN_PROMPTS the threshold means nothing: none is logged
                metrics[f"eval/judge/{n}/noise"] = ch.noise
        hacking, fell = hacking_verdict(changes["reward"], {n: c for n, c in changes.items() if n != "reward"})
        short = ", ".join(f"{n} {ch.prompts} finite prompts < {MIN_PROMPTS}" for n, ch in changes.items()
                          if not ch.verdict)
        if hacking is None:
            print(f"[judges] no verdict at step {step}: {short}", flush=True)
        elif short:
            print(f"[judges] left out of the rule at step {step}: {short}", flush=True)
        self.consecutive = self.consecutive + 1 if hacking else 0
        if self.alarm_step is None and self.consecutive >= self.cfg.patience:
            self.alarm_step, self.alarm_judges = int(step), fell
            self.stop_requested = self.cfg.stop
            print(f"[judges] REWARD HACKING at step {step}: training reward {changes['reward'].delta:+.4g} (noise "
                  f"{changes['reward'].noise:.3g}) while " + ", ".join(
                      f"{n} {changes[n].delta:+.4g} (noise {changes[n].noise:.3g})" for n in fell), flush=True)
        if hacking is None:
            metrics["eval/hacking_no_verdict"] = 1.0
        else:
            metrics["eval/hacking"] = float(hacking)
        metrics["eval/hacking_alarm"] = float(self.alarm_step is not None)
        return metrics

    def _change(self, name: str, current: torch.Tensor) -> ScoreChange:
        base = torch.tensor(self.baseline[name], dtype=torch.float64)
        ok = torch.isfinite(base) & torch.isfinite(current)  # a prompt a judge could not score is left out
        if not bool(ok.any()):
            return ScoreChange(0.0, 0.0, 0.0, 0.0, prompts=0)
        return score_change(base[ok], current[ok], self.cfg.z, 0.0 if name == "reward" else self.cfg.min_effect)

    # -------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict:
        return {"baseline": self.baseline, "baseline_step": self.baseline_step, "consecutive": self.consecutive,
                "alarm_step": self.alarm_step, "alarm_judges": list(self.alarm_judges)}

    def load_state_dict(self, state: dict) -> None:
        self.baseline, self.baseline_step = state["baseline"], state["baseline_step"]
        self.consecutive, self.alarm_step = int(state["consecutive"]), state["alarm_step"]
        self.alarm_judges = list(state["alarm_judges"])
        if self.baseline is not None and set(self.baseline) != {"reward", *self.judges}:
            raise ValueError(f"log.judges changed since the checkpoint: it scored {sorted(self.baseline)}, this run "
                             f"has {sorted(['reward', *self.judges])}; judges compare with their own baseline, so "
                             "keep the judges of a run (or start a new run)")


def _finite(s: torch.Tensor) -> torch.Tensor:
    return s[torch.isfinite(s)]


def stop_for_hacking(ctx: Any, run: Any, step: int, panel: "JudgePanel | None", states: Any, stateful: dict,
                     fsdp: bool) -> bool:
    """True when `log.hacking.stop` asks to end the run at this step (the decision of the evaluating rank 0 is
    shared by every rank); writes this step's checkpoint first unless the recipe's schedule just did."""
    if panel is None or not panel.cfg.stop:
        return False
    stop = ctx.max_int(int(panel.stop_requested)) if ctx.enabled else int(panel.stop_requested)
    if not stop:
        return False
    from mmrl.run.checkpoint import checkpoint_due, save_checkpoint

    if not checkpoint_due(run.cfg, step):
        save_checkpoint(ctx, run, step, states, stateful, fsdp=fsdp)
    if ctx.is_main:
        print(f"[judges] stopping at step {step} (log.hacking.stop: true); the checkpoint of this step is written",
              flush=True)
    return True


def judge_summary(rows: list[dict], name: str) -> dict:
    """The run summary's judge line and keys (nothing when the run had no judges)."""
    evals = [r for r in rows if r.get("eval/hacking_alarm") is not None]
    if not evals:
        return {}
    fired = next((r for r in evals if r.get("eval/hacking_alarm")), None)
    last = evals[-1]
    judges = sorted({k.split("/")[2] for r in evals for k in r if k.startswith("eval/judge/") and k.count("/") == 3
                     and k.endswith("/delta") and k.split("/")[2] != "reward"})

    def moved(r: dict, n: str) -> str:
        noise = r.get(f"eval/judge/{n}/noise")
        limit = "no verdict" if noise is None else f"noise {noise:.3g}"
        return f"{n} {r.get(f'eval/judge/{n}/delta', 0.0):+.4g} ({limit})"

    if fired is not None:
        fell = [n for n in judges if judge_fell(fired, n)]
        print(f"[{name}] reward hacking alarm at step {fired['step']}: {moved(fired, 'reward')}, while "
              + ", ".join(moved(fired, n) for n in fell), flush=True)
    elif last.get("eval/hacking_no_verdict"):
        print(f"[{name}] judges: no verdict at the last evaluation (step {last['step']}, fewer than {MIN_PROMPTS} "
              "finite held-out prompts) " + ", ".join(moved(last, n) for n in ["reward", *judges]), flush=True)
    else:
        print(f"[{name}] judges quiet (no reward hacking): last evaluation (step {last['step']}) "
              + ", ".join(moved(last, n) for n in ["reward", *judges]), flush=True)
    return {"hacking_alarm": fired is not None, "hacking_alarm_step": fired["step"] if fired else None}


def judge_fell(row: dict, judge: str) -> bool:
    """Whether `judge` fell beyond its noise in the metrics row of an evaluation."""
    d, n = row.get(f"eval/judge/{judge}/delta"), row.get(f"eval/judge/{judge}/noise")
    return d is not None and n is not None and d < -n
