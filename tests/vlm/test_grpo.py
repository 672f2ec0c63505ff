"""VLM GRPO recipe: reward shaping and dynamic sampling by hand, drift, resume equality, corrupt images, demo."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.config import load_config
from mmrl.vlm import grpo

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl", seed=0)


def _cfg(tiny_path, out, *overrides):
    base = {
        "algorithm": "vlm_grpo", "output_dir": str(out), "device": "cpu", "seed": 3,
        "model": {"path": str(tiny_path), "finetune": "full", "train_vision": True},
        "data": {"kind": "shapes", "template": "{question}", "colors": ["red", "green", "blue", "yellow"],
                 "shape_size": [0.5, 0.7], "eval_size": 4},
        "rollout": {"batch_size": 2, "n": 4, "max_new_tokens": 4},
        "reward": {"name": "exact_match"},
        "algo": {"micro_batch_size": 3},
        "warmup": {"sft_steps": 2, "batch_size": 4, "lr": 1e-2},
        "log": {"sample_every": 2, "n_samples": 4, "eval_every": 0},
        "train": {"max_steps": 2, "save_every": 0, "lr": 1e-3},
    }
    return load_config(base, list(overrides))


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ pure pieces


def test_overlong_penalty_by_hand():
    # max_len 20, buffer 4: free up to 16 tokens, then -(L - 16) / 4 * factor
    lengths = torch.tensor([10, 16, 17, 18, 20])
    got = grpo.overlong_penalty(lengths, max_len=20, buffer=4, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    got = grpo.overlong_penalty(lengths, max_len=20, buffer=4, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert torch.equal(grpo.overlong_penalty(lengths, 20, 0, 1.0), torch.zeros(5))


def test_keep_groups_drops_zero_variance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.0, 0.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 1, 1])
    assert grpo.keep_groups(rewards, groups).tolist() == [False, False, True, True, True, True, False, False]


@dataclass
class _Result:  # what collect_rollouts reads from a RolloutResult
    request_index: int
    text: str


def _scripted(rounds_rewards):
    """generate/score stand-ins: round k gives each prompt's n samples the scripted rewards."""
    calls = {"round": 0}

    def next_items(n):
        return [f"prompt{calls['round']}_{i}" for i in range(n)]

    def generate(items):
        return [_Result(i, f"{items[i]}#{s}") for i in range(len(items)) for s in range(2)]

    def score_fn(results):
        r = torch.tensor(rounds_rewards[calls["round"]], dtype=torch.float32)
        calls["round"] += 1
        return r, {"accuracy": r}, r

    return next_items, generate, score_fn


def test_dynamic_sampling_fills_batch_and_drops_constant_groups():
    # batch 2 prompts x n 2; round 0: group 0 constant, group 1 varied; round 1: group 0 varied, group 1 constant
    script = [[1, 1, 0, 1], [1, 0, 0, 0], [1, 0, 1, 0]]
    roll = grpo.collect_rollouts(*_scripted(script), batch_size=2, n=2, dynamic=True, max_rounds=4)
    assert roll.rounds == 2
    assert [r.text for r in roll.results] == ["prompt0_1#0", "prompt0_1#1", "prompt1_0#0", "prompt1_0#1"]
    assert roll.items == ["prompt0_1", "prompt0_1", "prompt1_0", "prompt1_0"]
    assert roll.scores.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert roll.group_ids[0] == roll.group_ids[1] != roll.group_ids[2] == roll.group_ids[3]
    assert roll.all_scores.tolist() == [1, 1, 0, 1, 1, 0, 0, 0]  # every generated sample is logged
    # the round limit stops early with a partial batch
    roll = grpo.collect_rollouts(*_scripted(script), batch_size=2, n=2, dynamic=True, max_rounds=1)
    assert roll.rounds == 1 and len(roll.results) == 2
    # a full round is kept after the first round of a fresh stream: extra kept groups are cut at the batch size
    roll = grpo.collect_rollouts(*_scripted([[1, 0, 0, 1]]), batch_size=2, n=2, dynamic=True, max_rounds=3)
    assert roll.rounds == 1 and len(roll.results) == 4
    # without dynamic sampling the constant groups stay
    roll = grpo.collect_rollouts(*_scripted(script), batch_size=2, n=2, dynamic=False, max_rounds=4)
    assert roll.rounds == 1 and roll.scores.tolist() == [1, 1, 0, 1]


def test_lora_vision_included_or_excluded(tiny_path, tmp_path):
    for train_vision in (False, True):
        cfg = _cfg(tiny_path, tmp_path, "model.finetune=lora", "model.lora_rank=4", f"model.train_vision={train_vision}")
        states, _ = grpo.build_policy(cfg, torch.device("cpu"), torch.float32)
        names = [n for n, _ in states.named_trainable_parameters()]
        assert names and all("lora_" in n for n in names)
        assert any("language_model" in n for n in names)
        assert any("visual" in n for n in names) == train_vision


# ------------------------------------------------------------------ training runs


def test_metrics_and_logprob_drift(tiny_path, tmp_path):
    out = tmp_path / "run"
    summary = grpo.train(_cfg(tiny_path, out))
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "reward/std", "accuracy", "response_length/mean", "response_length/max",
                "response/clip_ratio", "actor/clipfrac", "actor/entropy", "actor/pg_loss", "time/rollout_s",
                "time/reward_s", "time/train_s", "time/step_s", "diag/logprob_drift"):
        assert key in rows[0], key
    assert all(r["diag/logprob_drift"] < 1e-4 for r in rows)
    assert "eval/accuracy" in rows[-1] and "eval_accuracy_first" in summary
    assert (out / "samples" / "step_000002.png").is_file() and (out / "checkpoints" / "step_2" / "COMPLETE").is_file()


def test_recompute_old_logprobs_kl_loss_and_minibatches(tiny_path, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(tiny_path, out, "algo.ppo_epochs=2", "algo.mini_batch_size=4", "algo.kl_coef=0.01",
               "algo.kl_estimator=k3", "algo.advantage=rloo", "algo.loss_agg=seq-mean-token-sum-norm",
               "reward.overlong_buffer=2", "warmup.sft_steps=0", "log.sample_every=0")
    grpo.train(cfg)
    rows = _rows(out)
    for r in rows:
        assert r["diag/logprob_drift"] < 1e-4
        assert "kl" in r and r["kl"] >= 0 and "time/old_logprob_s" in r and "time/ref_s" in r
        assert r["reward/overlong"] <= 0


def test_resume_equals_uninterrupted_run(tiny_path, tmp_path):
    common = ("model.finetune=lora", "model.lora_rank=4", "algo.kl_coef=0.05", "train.save_every=2", "train.lr=5e-3",
              "warmup.params=[]", "log.sample_every=0")
    full = tmp_path / "full"
    grpo.train(_cfg(tiny_path, full, "train.max_steps=4", *common))
    part = tmp_path / "part"
    grpo.train(_cfg(tiny_path, part, "train.max_steps=2", *common))
    grpo.train(_cfg(tiny_path, part, "train.max_steps=4", *common))  # resumes from step_2 (resume=auto)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/"))} for r in rows]

    a, b = strip(_rows(full)), strip(_rows(part))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    assert any(r["actor/grad_norm"] > 0 for r in a)  # the runs really updated the adapters


def _geo3k_files(tmp_path):
    rows = []
    for i, color in enumerate(["red", "green", "blue"]):
        Image.new("RGB", (56, 56), color).save(tmp_path / f"img{i}.png")
        rows.append({"images": [f"img{i}.png"], "problem": "<image>What color is the image?", "answer": color})
    (tmp_path / "img1.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not an image")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "train.jsonl"


def test_corrupt_image_skipped_or_raised(tiny_path, tmp_path):
    path = _geo3k_files(tmp_path)
    opts = ("data.kind=geo3k", f"data.path={path}", "data.template={problem}", "warmup.sft_steps=0",
            "train.max_steps=1", "log.sample_every=0", "train.save_every=0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo.train(_cfg(tiny_path, tmp_path / "skip", "data.on_error=skip", *opts))
    assert any("img1.png" in str(w.message) for w in caught)
    assert len(_rows(tmp_path / "skip")) == 1
    with pytest.raises(ValueError, match="img1.png"):
        grpo.train(_cfg(tiny_path, tmp_path / "raise", "data.on_error=raise", *opts))


@pytest.mark.slow
def test_tiny_shapes_demo_learns(tmp_path):
    """The shipped CPU demo config: accuracy on fixed eval questions rises from chance to clearly above it."""
    cfg = load_config(ROOT / "configs/vlm/grpo_tiny_shapes.yaml",
                      [f"output_dir={tmp_path / 'demo'}", f"model.path={tmp_path / 'tiny'}", "log.sample_every=100"])
    t0 = time.time()
    summary = grpo.train(cfg)
    assert time.time() - t0 < 600
    assert summary["eval_accuracy_first"] < 0.45
    assert summary["eval_accuracy_last"] > summary["eval_accuracy_first"] + 0.3
    assert list((tmp_path / "demo" / "samples").glob("step_*.png"))


@pytest.mark.parametrize("override, match", [
    ("algo.loss_agg=mean", "loss_agg"), ("algo.kl_estimator=k9", "KL estimator"), ("algo.advantage=ppo", "advantage"),
    ("algo.old_logprobs=rollout", "one update per rollout"), ("data.kind=coco", "data.kind"),
    ("rollout.engine=sglang", "rollout engine"),
])
def test_bad_config_fails_with_clear_error(tiny_path, tmp_path, override, match):
    extra = ["algo.ppo_epochs=2"] if "rollout" in override and "old" in override else []
    with pytest.raises(ValueError, match=match):
        grpo.train(_cfg(tiny_path, tmp_path / "bad", override, *extra, "warmup.sft_steps=0"))
