"""Reward model from human preference pairs: Bradley-Terry (`algorithm: reward_bt`, `mmrl reward train CONFIG.yaml`).

A pair is (prompt, chosen image, rejected image); the model scores both with the zoo's own scoring call
(`backbones.py`: `pickscore` for the CLIP backbone, `hpsv3` for the VLM-with-head backbone) and the loss is
-log sigmoid(s_chosen - s_rejected) (`accuracy.bradley_terry_loss`; PickScore's two-image softmax with its logit
scale is this loss). One step reads top to bottom:
  1. pairs  - `update.pairs_per_step` training pairs, drawn epoch by epoch in a shuffled order (`data` cursor in the
              checkpoint), images read from disk;
  2. loss   - both images of each pair scored (micro-batches of `update.micro_batch_size` pairs), BT loss, backward;
  3. update - gradient clipping, the non-finite guard, one AdamW step, the learning-rate schedule.
Evaluation (before training = step 0, every `log.eval_every` steps and at the end): every held-out pair scored,
eval/pair_accuracy (chosen scored strictly higher) with its 95% Wilson interval eval/pair_accuracy_lo|hi.
At the end the model is exported, LoRA merged, into `<output_dir>/reward/` in the zoo's format with
`mmrl_reward.json`: `mmrl.rewards.load("learned_pref", weights=<output_dir>/reward)`, or in a training config
`reward.components: {learned_pref: {weight: 1.0, weights: <output_dir>/reward}}`.

Data: `data.pairs`, rows {prompt, image_0, image_1, label_0} (label_0 = 1: image_0 preferred, 0: image_1, 0.5: a
tie) or {prompt, chosen, rejected} (`mmrl.pipelines.data.load_preference_pairs`). Ties are dropped (a tie names no
preferred image; PickScore instead trains them towards equal scores). Held out: `data.eval_pairs`, or a share
`data.eval_fraction` of the prompts (all pairs of a held-out prompt are held out, so accuracy is measured on prompts
the model never trained on). One process (no torchrun).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.distributed import DistConfig
from mmrl.run.start import closes_runs
from mmrl.training import LoRAConfig, OptimConfig, TrackersConfig

__all__ = ["Config", "train"]


@dataclass
class RewardLoRAConfig(LoRAConfig):  # this recipe's defaults (a subclass: a partial YAML section keeps them)
    rank: int = 0
    """LoRA rank r; 0 = full fine-tuning of every weight (as PickScore trains CLIP)."""
    alpha: int = 16
    """LoRA alpha (scale = alpha / rank)."""


@dataclass
class ModelConfig:
    backbone: Literal["clip", "vlm_head"] = "clip"
    """`clip`: a transformers CLIPModel scored as the zoo's `pickscore` (logit_scale * cosine); `vlm_head`: a Qwen2-VL
    reward checkpoint with an MLP head in HPSv3's layout, scored as the zoo's `hpsv3` (the head's mu)."""
    path: str = ""
    """clip: a transformers CLIP directory (e.g. laion/CLIP-ViT-H-14 or PickScore_v1); vlm_head: the reward
    checkpoint (HPSv3.safetensors, or its directory)."""
    processor: str = ""
    """clip: the tokenizer + preprocessor directory when `path` has none (PickScore_v1's come from the laion CLIP);
    vlm_head: the base Qwen2-VL directory (config + processor files), required."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Further arguments of the zoo reward (vlm_head: e.g. min_pixels, max_pixels), used in training and recorded
    in the export, so the trained reward scores with them."""
    build_tiny: bool = False
    """clip: when `path` holds no config.json, build a tiny random CLIP there first (`mmrl.tiny`; the CPU demo)."""
    lora: RewardLoRAConfig = field(default_factory=RewardLoRAConfig)
    """LoRA (rank > 0; default targets: the attention projections, and the head's Linear layers for vlm_head) or
    full fine-tuning (rank 0)."""


@dataclass
class DataConfig:
    pairs: str = ""
    """Preference pairs (.jsonl/.json/.parquet): {prompt, image_0, image_1, label_0} or {prompt, chosen, rejected}."""
    image_root: str = ""
    """Folder relative image paths are resolved against (default: the pairs file's folder)."""
    eval_pairs: str = ""
    """Held-out pairs in a file of their own (same layout; its images resolved against its own folder, or
    image_root); empty = hold out `eval_fraction` of the prompts of `pairs`."""
    eval_fraction: float = 0.2
    """Without eval_pairs: the share of the pairs held out, whole prompts at a time (drawn with the run's seed)."""
    build_demo: bool = False
    """When `pairs` does not exist, write the synthetic colour preference set there first (the CPU demo:
    `make_color_preference_file`, "a red car" prefers the red-dominant image of the pair)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction: expected a share in (0, 1), got {self.eval_fraction}")


@dataclass
class RewardUpdateConfig:
    pairs_per_step: int = 16
    """Preference pairs per optimizer step."""
    micro_batch_size: int = 16
    """Pairs per forward/backward pass (gradient accumulation inside a step); also the scoring batch of evaluation."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this before every update (0 = no clipping)."""
    max_skipped_updates: int = 3
    """An update whose loss or gradient norm is NaN/inf is skipped; this many in a row stop the run (>= 1)."""

    def __post_init__(self) -> None:
        for key in ("pairs_per_step", "micro_batch_size", "max_skipped_updates"):
            if getattr(self, key) < 1:
                raise ValueError(f"update.{key}: expected >= 1, got {getattr(self, key)}")
        if self.max_grad_norm < 0:
            raise ValueError(f"update.max_grad_norm: expected >= 0 (0 = no clipping), got {self.max_grad_norm}")


@dataclass
class LogConfig(TrackersConfig):
    eval_every: int = 50
    """Held-out pairwise accuracy every this many steps (also before training and at the end; 0 = only those)."""


@dataclass
class Config(RunConfig):
    algorithm: str = "reward_bt"
    """Recipe name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The reward model: backbone, weights, LoRA or full fine-tuning."""
    data: DataConfig = field(default_factory=DataConfig)
    """Preference pairs and the held-out split."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """AdamW and its learning-rate schedule (default lr: PickScore's full fine-tuning of CLIP-H, trainer/optimizers/
    adamw.py at ca44324; a LoRA wants a larger one, e.g. 1e-4)."""
    update: RewardUpdateConfig = field(default_factory=RewardUpdateConfig)
    """Pairs per step, micro-batches, clipping, the non-finite guard."""
    log: LogConfig = field(default_factory=LogConfig)
    """Evaluation and trackers."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop length, checkpoints, resume."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Kept for the run layer: reward_bt runs in one process."""


def build_demo_inputs(cfg: Config) -> None:
    """`model.build_tiny` / `data.build_demo`: the tiny CLIP and the synthetic pairs of the CPU demo, made once."""
    if cfg.model.build_tiny and cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        if cfg.model.backbone != "clip":
            raise ValueError("model.build_tiny builds a tiny CLIP: it needs model.backbone=clip")
        from mmrl.tiny import build_tiny_clip

        build_tiny_clip(cfg.model.path, seed=cfg.seed)
    if cfg.data.build_demo and cfg.data.pairs and not Path(cfg.data.pairs).exists():
        make_color_preference_file(Path(cfg.data.pairs).parent, seed=cfg.seed, name=Path(cfg.data.pairs).name)


def check_config(cfg: Config) -> None:
    """Fail before any model loads (one line naming the key)."""
    from mmrl.pipelines.data import require_path

    m = cfg.model
    if not m.path:
        raise ValueError(f"model.path: give the {'CLIP directory' if m.backbone == 'clip' else 'reward checkpoint'} "
                         f"to train from (model.backbone={m.backbone})")
    if not Path(m.path).exists():
        require_path("model.path", m.path, "model", kind="dir" if m.backbone == "clip" else "file")
    if m.lora.init_path:
        raise ValueError("model.lora.init_path: reward_bt starts a LoRA from the base weights; to go on from a trained "
                         "reward, give its exported directory's model as model.path")
    if not m.lora.enabled and cfg.dtype != "float32":
        raise ValueError(f"dtype={cfg.dtype}: full fine-tuning (model.lora.rank=0) trains every weight, which stays "
                         f"float32; use dtype=float32, or LoRA (model.lora.rank > 0) over a {cfg.dtype} model")
    if m.backbone == "vlm_head" and not m.processor:
        raise ValueError("model.processor: model.backbone=vlm_head needs the base Qwen2-VL directory (config + "
                         "processor files) the checkpoint was built from")
    if m.processor:
        require_path("model.processor", m.processor, "processor folder", kind="dir")
    if not cfg.data.pairs:
        raise ValueError("data.pairs: give the preference pairs file (.jsonl rows {prompt, image_0, image_1, label_0})")
    require_path("data.pairs", cfg.data.pairs, "preference file")
    if cfg.data.eval_pairs:
        require_path("data.eval_pairs", cfg.data.eval_pairs, "preference file")
    if cfg.data.image_root:
        require_path("data.image_root", cfg.data.image_root, "image folder", kind="dir")


def read_pairs(path: str, image_root: str = "") -> list:
    """`load_preference_pairs` (ties dropped) with two checks first: a file of ties only, and every image on disk."""
    from mmrl.pipelines.data import DataError, load_preference_pairs, read_records

    rows = read_records(path)
    if rows and all(isinstance(r, dict) and r.get("label_0") == 0.5 for r in rows):
        raise DataError(f"{path}: all {len(rows)} rows are ties (label_0 = 0.5): a tie prefers neither image, so "
                        f"there is nothing to fit; label pairs with 1 (image_0 preferred) or 0 (image_1)")
    pairs = load_preference_pairs(path, image_root or None)
    for p in pairs:
        for image in (p.chosen, p.rejected):
            if isinstance(image, Path) and not image.is_file():
                raise DataError(f"{path}: image {str(image)!r} of the pair with prompt {p.prompt[:60]!r} not found "
                                f"(relative paths are taken from {image_root or Path(path).parent})")
    return pairs


def split_pairs(cfg: Config) -> tuple[list, list]:
    """(training pairs, held-out pairs): `data.eval_pairs`, or whole prompts of `data.pairs` held out at random."""
    pairs = read_pairs(cfg.data.pairs, cfg.data.image_root)
    if cfg.data.eval_pairs:
        return pairs, read_pairs(cfg.data.eval_pairs, cfg.data.image_root)
    prompts = list(dict.fromkeys(p.prompt for p in pairs))
    random.Random(cfg.seed).shuffle(prompts)
    held, n_held = set(), 0
    for prompt in prompts:
        if n_held >= cfg.data.eval_fraction * len(pairs):
            break
        held.add(prompt)
        n_held += sum(p.prompt == prompt for p in pairs)
    train_pairs = [p for p in pairs if p.prompt not in held]
    if not train_pairs or len(held) == len(prompts):
        raise ValueError(f"data.pairs: {len(pairs)} pairs over {len(prompts)} prompt(s) cannot be split into training "
                         f"and held-out prompts (data.eval_fraction={cfg.data.eval_fraction}); give more prompts or a "
                         f"held-out file as data.eval_pairs")
    return train_pairs, [p for p in pairs if p.prompt in held]


def score_pairs(reward: Any, pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores, rejected scores) of `pairs` in one call of the zoo reward (both images of every pair): the
    call training, evaluation and `mmrl.rewards.load("learned_pref", ...)` users make alike."""
    from mmrl.rewards.base import to_image_list

    images = to_image_list([p.chosen for p in pairs] + [p.rejected for p in pairs])
    prompts = [p.prompt for p in pairs]
    scores = reward(images=images, prompts=prompts + prompts).scores.float()
    return scores[:len(pairs)], scores[len(pairs):]


def evaluate(reward: Any, pairs: list, micro: int) -> dict[str, float]:
    """Held-out pairwise accuracy, its Wilson interval, margin and loss (`accuracy.pair_accuracy`) of a zoo reward,
    `micro` pairs per call."""
    from mmrl.reward_train.accuracy import pair_accuracy

    with torch.no_grad():
        parts = [score_pairs(reward, pairs[i:i + micro]) for i in range(0, len(pairs), micro)]
    return pair_accuracy(torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts]))


@closes_runs  # the run directory's lock released however train() ends; a failed start leaves nothing
def train(cfg: Config) -> dict:
    from mmrl.adapters import PolicyStates
    from mmrl.pipelines.data import PromptSampler
    from mmrl.reward_train.accuracy import bradley_terry_loss
    from mmrl.reward_train.backbones import build_backbone, write_export
    from mmrl.run.checkpoint import restore_checkpoint
    from mmrl.run.start import start_run
    from mmrl.training import UpdateGuard, build_optimizer, clip_grads, peft_lora_config
    from mmrl.training.steps import StepLoop

    build_demo_inputs(cfg)
    check_config(cfg)
    train_pairs, eval_pairs = split_pairs(cfg)
    ctx, run = start_run(cfg)
    if ctx.enabled:
        raise ValueError(f"reward_bt runs in one process; {ctx.world_size} were launched (run `mmrl reward train` "
                         f"without torchrun / accelerate launch)")
    update, micro = cfg.update, cfg.update.micro_batch_size
    backbone = build_backbone(cfg.model, run.device, cfg.dtype, batch_size=2 * micro)
    lora = peft_lora_config(cfg.model.lora, backbone.lora_targets())
    if lora is None:
        backbone.module.requires_grad_(True)  # the zoo loads rewards frozen
    states = PolicyStates(backbone.module, lora)
    params = states.trainable_parameters()
    optimizer, lr_sched = build_optimizer(params, cfg.optim, total_steps=cfg.train.max_steps)
    sampler = PromptSampler(list(range(len(train_pairs))), seed=cfg.seed)  # the stream of pair indices
    stateful = {"optimizer": optimizer, "lr_scheduler": lr_sched, "data": sampler}
    start, _ = restore_checkpoint(ctx, run, states, stateful)
    guard = UpdateGuard(update.max_skipped_updates, ctx, run)
    print(f"[reward_bt] {len(train_pairs)} training pairs, {len(eval_pairs)} held-out pairs; backbone "
          f"{cfg.model.backbone} ({states.mode}, {sum(p.numel() for p in params)} trainable weights)", flush=True)
    summary: dict[str, Any] = {}
    if start == 0:  # the accuracy before training: what the fit is measured against
        first = evaluate(backbone.reward, eval_pairs, micro)
        run.truncate_metrics(-1)  # a fresh start: no row of an earlier start that wrote no checkpoint (its step 0)
        run.log(0, first)
        summary.update({f"first/{k}": v for k, v in first.items()})

    def evaluate_after(step: int, metrics: dict) -> None:
        if (cfg.log.eval_every and step % cfg.log.eval_every == 0) or step == cfg.train.max_steps:
            with steps.timer("eval"):
                metrics.update(evaluate(backbone.reward, eval_pairs, micro))

    steps = StepLoop(ctx, run, cfg, start, states=states, stateful=stateful, fsdp=False, after_step=evaluate_after,
                     postfix=lambda m: {"loss": f"{m['train/loss']:.3f}", "acc": f"{m['train/pair_accuracy']:.2f}"})
    for step in steps:
        metrics = steps.metrics
        # ---- 1. pairs
        batch = [train_pairs[i] for i in sampler.next(update.pairs_per_step)]
        # ---- 2. BT loss over micro-batches (each weighted by its share of the step's pairs)
        losses, chosen, rejected = [], [], []
        with steps.timer("train"):
            for i in range(0, len(batch), micro):
                part = batch[i:i + micro]
                s_w, s_l = score_pairs(backbone.reward, part)
                loss = bradley_terry_loss(s_w, s_l)
                (loss * len(part) / len(batch)).backward()
                losses.append(loss.detach())
                chosen.append(s_w.detach())
                rejected.append(s_l.detach())
            # ---- 3. one update
            grad_norm = clip_grads(params, update.max_grad_norm)
            if guard.step(optimizer, losses, grad_norm, step):
                lr_sched.step()
            optimizer.zero_grad(set_to_none=True)
        s_w, s_l = torch.cat(chosen).float().cpu(), torch.cat(rejected).float().cpu()
        metrics.update({"train/loss": float(bradley_terry_loss(s_w, s_l)),
                        "train/pair_accuracy": float((s_w > s_l).float().mean()),
                        "train/margin": float((s_w - s_l).mean()), "train/score_mean": float(torch.cat([s_w, s_l]).mean()),
                        "train/grad_norm": grad_norm, "train/lr": lr_sched.get_last_lr()[0]})
        metrics.update(guard.pop_metrics())
    steps.close()
    last = [r for r in run.read_metrics() if r.get("eval/pair_accuracy") is not None]
    if steps.step == cfg.train.max_steps:  # not stopped early (a callback): export
        evals = {k: v for k, v in (last[-1] if last else {}).items() if k.startswith("eval/")}
        out = write_export(backbone, run.dir / "reward",
                           {"backbone": cfg.model.backbone, "trained_by": "reward_bt", "step": cfg.train.max_steps,
                            "base": str(Path(cfg.model.path).resolve()), "train_pairs": len(train_pairs),
                            "eval_pairs": len(eval_pairs), "eval": evals})
        summary["reward_dir"] = str(out)
        print(f"[reward_bt] exported to {out}: use it as reward.components: {{learned_pref: {{weight: 1.0, weights: "
              f"{out}}}}}", flush=True)
    if last:
        summary.update({k: last[-1][k] for k in ("eval/pair_accuracy", "eval/pair_accuracy_lo",
                                                 "eval/pair_accuracy_hi", "eval/pairs")})
    ctx.close()
    return run.finish(summary)


# ------------------------------------------------------------------------------------------ demo data

DEMO_SUBJECTS = ("sunset over the sea", "city street", "bowl of fruit", "mountain lake", "car", "garden",
                 "cat on a sofa", "lighthouse", "forest path", "birthday cake")


def make_color_preference_file(out_dir: str | Path, n_pairs: int = 80, seed: int = 0, size: int = 32,
                               ties: int = 2, name: str = "pairs.jsonl") -> Path:
    """A synthetic preference set with a clear signal, in the labelling page's row layout: `out_dir/<name>`
    ({prompt, image_0, image_1, label_0, pair_id}) + PNGs in `out_dir/images/` + `out_dir/image_prompts.txt` (the
    prompt of each image in file-name order, for `mmrl reward score --images DIR --prompts FILE`). The prompt names a colour ("a red car", "a blue car");
    in every pair one image is red-dominant noise and the other blue-dominant noise, in random order, and the one
    of the named colour is preferred (label_0 = 1 when image_0 is). A reward that ignores the prompt gets half
    right. The last `ties` rows are ties (label_0 = 0.5), which training drops."""
    import json

    import numpy as np
    from PIL import Image

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def noise(channel: int) -> Image.Image:
        arr = rng.uniform(0.0, 0.45, (size, size, 3))
        arr[..., channel] = rng.uniform(0.55, 1.0, (size, size))
        return Image.fromarray((arr * 255).round().astype(np.uint8))

    rows = []
    for i in range(n_pairs + ties):
        color = ("red", "blue")[i % 2]
        subject = DEMO_SUBJECTS[(i // 2) % len(DEMO_SUBJECTS)]
        first_is_red = bool(rng.integers(2))
        for j, channel in enumerate((0, 2) if first_is_red else (2, 0)):
            noise(channel).save(out / "images" / f"{i:04d}_{j}.png")
        label = 0.5 if i >= n_pairs else float(first_is_red == (color == "red"))
        rows.append({"prompt": f"a {color} {subject}", "image_0": f"images/{i:04d}_0.png",
                     "image_1": f"images/{i:04d}_1.png", "label_0": label, "pair_id": f"demo-{i:04d}"})
    path = out / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "image_prompts.txt").write_text("".join(f"{r['prompt']}\n" * 2 for r in rows))
    return path


if __name__ == "__main__":  # python -m mmrl.reward_train.bt make-color-pairs OUT_DIR [N_PAIRS]
    import sys

    if len(sys.argv) < 3 or sys.argv[1] != "make-color-pairs":
        raise SystemExit("usage: python -m mmrl.reward_train.bt make-color-pairs OUT_DIR [N_PAIRS]")
    print(make_color_preference_file(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 80))
