"""VLM GRPO recipe: reward shaping and dynamic sampling by hand, drift, resume equality, corrupt images, demo;
data-parallel training (2 CPU processes, gloo): the recipe's policy_update on 2 ranks = 1 rank on the combined
batch, and `torchrun ... mmrl.cli train ... dist.strategy=ddp` then a 1-process resume; vision-feature reuse
in the update (bypassed when the vision tower trains)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.config import load_config
from mmrl.core import keep_groups, overlong_penalty
from mmrl.pipelines.shapes_qa import ShapesQA
from mmrl.testing import RESUMED_RUN, assert_same_path, child_env, metrics_rows, run_torchrun, spawn_ranks, without_time
from mmrl.vlm import grpo
from mmrl.vlm.policy import build_policy, rl_parameters
from mmrl.vlm.rollout_collect import collect_rollouts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl", seed=0)


def _cfg(tiny_path, out, *overrides):
    base = {
        "algorithm": "vlm_grpo", "output_dir": str(out), "device": "cpu", "seed": 3,
        "model": {"path": str(tiny_path), "lora": {"rank": 0}, "train_vision": True},
        "data": {"kind": "shapes", "template": "{question}", "colors": ["red", "green", "blue", "yellow"],
                 "shape_size": [0.5, 0.7], "eval_size": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "reward": {"name": "exact_match"},
        "update": {"micro_batch_size": 3},
        "warm_start": {"steps": 2, "batch_size": 4, "lr": 1e-2},
        "log": {"sample_every": 2, "num_samples": 4, "eval_every": 0},
        "train": {"max_steps": 2, "save_every": 0}, "optim": {"lr": 1e-3},
    }
    return load_config(base, list(overrides))



# ------------------------------------------------------------------ pure pieces


def test_overlong_penalty_by_hand():
    # max_len 20, buffer 4: free up to 16 tokens, then -(L - 16) / 4 * factor
    lengths = torch.tensor([10, 16, 17, 18, 20])
    got = overlong_penalty(lengths, max_len=20, buffer=4, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    got = overlong_penalty(lengths, max_len=20, buffer=4, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert torch.equal(overlong_penalty(lengths, 20, 0, 1.0), torch.zeros(5))


def test_keep_groups_drops_zero_variance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.0, 0.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 1, 1])
    assert keep_groups(rewards, groups).tolist() == [False, False, True, True, True, True, False, False]


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
    roll = collect_rollouts(*_scripted(script), batch_size=2, n=2, dynamic=True, max_rounds=4)
    assert roll.rounds == 2
    assert [r.text for r in roll.results] == ["prompt0_1#0", "prompt0_1#1", "prompt1_0#0", "prompt1_0#1"]
    assert roll.items == ["prompt0_1", "prompt0_1", "prompt1_0", "prompt1_0"]
    assert roll.scores.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert roll.group_ids[0] == roll.group_ids[1] != roll.group_ids[2] == roll.group_ids[3]
    assert roll.all_scores.tolist() == [1, 1, 0, 1, 1, 0, 0, 0]  # every generated sample is logged
    # the round limit stops early with a partial batch
    roll = collect_rollouts(*_scripted(script), batch_size=2, n=2, dynamic=True, max_rounds=1)
    assert roll.rounds == 1 and len(roll.results) == 2
    # a full round is kept after the first round of a fresh stream: extra kept groups are cut at the batch size
    roll = collect_rollouts(*_scripted([[1, 0, 0, 1]]), batch_size=2, n=2, dynamic=True, max_rounds=3)
    assert roll.rounds == 1 and len(roll.results) == 4
    # without dynamic sampling the constant groups stay
    roll = collect_rollouts(*_scripted(script), batch_size=2, n=2, dynamic=False, max_rounds=4)
    assert roll.rounds == 1 and roll.scores.tolist() == [1, 1, 0, 1]


def test_lora_vision_included_or_excluded(tiny_path, tmp_path):
    for train_vision in (False, True):
        cfg = _cfg(tiny_path, tmp_path, "model.lora.rank=4", f"model.train_vision={train_vision}")
        states, _ = build_policy(cfg.model, torch.device("cpu"), torch.float32, keep_ref=False)
        names = [n for n, _ in states.named_trainable_parameters()]
        assert names and all("lora_" in n for n in names)
        assert any("language_model" in n for n in names)
        assert any("visual" in n for n in names) == train_vision


def test_a_freeze_list_that_leaves_nothing_to_train_is_one_clear_error(tiny_path, tmp_path):
    cfg = _cfg(tiny_path, tmp_path, "model.lora.rank=0")
    states, _ = build_policy(cfg.model, torch.device("cpu"), torch.float32, keep_ref=False)
    assert rl_parameters(states, ["lm_head"])  # the other weights train
    with pytest.raises(ValueError, match=r"^model.freeze=\['model', 'lm_head'\] excludes every trainable parameter$"):
        rl_parameters(states, ["model", "lm_head"])


# ------------------------------------------------------------------ RolloutBatch, update, warm start


def _mixed_rows(tiny_path):
    """Prompts with one image, none, and two images; responses of different lengths (one empty)."""
    from mmrl.vlm.common import encode_prompt, load_policy, messages_from_text, render_prompt

    model, proc = load_policy(tiny_path)
    imgs = [Image.new("RGB", (56, 56), c) for c in ("red", "blue")]
    texts = [("<image>What color?", imgs[:1]), ("a text-only prompt that is longer than the others", []),
             ("<image>Which one?<image>", imgs)]
    encs = [encode_prompt(proc, render_prompt(proc, messages_from_text(t)), im) for t, im in texts]
    g = torch.Generator().manual_seed(0)
    R = [torch.randint(10, 100, (k,), generator=g).tolist() for k in (5, 2, 7, 0, 3)]
    return model, proc, [encs[i % 3].input_ids for i in range(5)], R, [encs[i % 3].mm for i in range(5)]


def test_rollout_batch_logprobs_equal_collate_path(tiny_path):
    """The padded-once batch (rope index computed once, rows selected and trimmed) gives bit-identical log-probs to
    collating every micro-batch anew (compute_logprobs), for every micro-batch size, with images, text-only rows,
    two images in a row, left/right padding and an empty response; select(rows) equals building those rows alone."""
    from mmrl.vlm.batch import RolloutBatch
    from mmrl.vlm.common import compute_logprobs

    model, proc, P, R, MM = _mixed_rows(tiny_path)
    pad = proc.tokenizer.pad_token_id
    batch = RolloutBatch.build(model, P, R, MM, pad, rollout_logprobs=[[0.5] * len(r) for r in R])
    assert batch.input_ids.shape == (5, max(map(len, P)) + 7) and batch.position_ids.shape[:2] == (3, 5)
    assert batch.response_mask.sum(-1).tolist() == [5, 2, 7, 0, 3]
    assert batch.rollout_logprobs.sum().item() == 0.5 * 17  # 0 at padding
    for mbs in (1, 2, 3, 8):
        old, _ = compute_logprobs(model, P, R, MM, pad, mbs, 0.7)
        new = batch.logprobs(model, mbs, 0.7)
        for i in range(5):
            assert torch.equal(old[i], new[i, :len(R[i])]), (mbs, i)
        assert torch.equal(new[~batch.response_mask], torch.zeros(int((~batch.response_mask).sum())))
    rows = [2, 0]
    sub, alone = batch.select(rows), RolloutBatch.build(model, [P[i] for i in rows], [R[i] for i in rows],
                                                        [MM[i] for i in rows], pad)
    for key in ("input_ids", "attention_mask", "position_ids", "mm_token_type_ids", "response_mask", "loss_mask"):
        assert torch.equal(getattr(sub, key), getattr(alone, key)), key
    assert sub.prompt_len == alone.prompt_len and sub.mm[0] is MM[2]


def test_policy_update_loss_registry_and_token_advantages(tiny_path):
    """`algo.policy_loss` picks the core registry's loss: the update's first micro-batch loss equals gspo_policy_loss
    (resp. clipped_policy_loss) on the same tensors; token-level advantages [N, T] and a loss mask over part of the
    response (multi-turn rows) reach the loss; an unknown name lists the valid ones."""
    from mmrl.core import clipped_policy_loss, gspo_policy_loss
    from mmrl.core.cpgd import registered_cpgd_loss
    from mmrl.training import UpdateGuard
    from mmrl.vlm.batch import RolloutBatch
    from mmrl.vlm.update import MicroBatch, PolicyGradientLoss, contiguous_minibatches, policy_update

    model, proc, P, R, MM = _mixed_rows(tiny_path)
    pad = proc.tokenizer.pad_token_id
    mask = [[1, 1, 0, 0, 1], [1, 1], [0, 1, 1, 1, 0, 0, 1], [], [1, 0, 1]]  # policy tokens of each response
    adv = [torch.linspace(-1, 1, len(r)).tolist() for r in R]
    batch = RolloutBatch.build(model, P, R, MM, pad, loss_mask=mask, advantages=adv)
    assert batch.loss_mask.sum().item() == 11 and batch.advantages.shape == batch.response_mask.shape
    batch.old_logprobs = batch.logprobs(model, 5) - 0.01
    for name, fn in (("gspo", gspo_policy_loss), ("ppo_clip", clipped_policy_loss), ("cpgd", registered_cpgd_loss)):
        loss_fn = PolicyGradientLoss(name, clip_low=0.2, clip_high=0.3)
        seen = []

        def spy(mb: MicroBatch, loss_fn=loss_fn):
            out = loss_fn(mb)
            seen.append((mb, out))
            return out

        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.0)
        res = policy_update(model, batch, opt, params, loss_fn=spy, minibatches=contiguous_minibatches(5, 5, 5),
                            micro_batch_size=5, guard=UpdateGuard(1))
        mb, (loss, m) = seen[0]
        want, _ = fn(mb.logp, mb.batch.old_logprobs, mb.batch.advantages, mb.batch.loss_mask, clip_low=0.2,
                     clip_high=0.3, agg="token-mean")
        assert torch.equal(loss, want) and res.applied == 1 and 0 < res.drift < 0.011
        assert set(res.metrics()) >= {"policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/ratio_max"}
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'; valid: \['cpgd', 'gspo', 'ppo_clip'"):
        PolicyGradientLoss("ppo2")


def test_format_warm_start_equals_the_earlier_loop(tiny_path):
    """format_warm_start (RolloutBatch, AdamW without weight decay) moves the weights exactly like the earlier
    vlm_grpo loop (collate + response_logprobs + Adam) on the same pairs."""
    from mmrl.core import agg_loss
    from mmrl.vlm.common import collate, load_policy, response_logprobs
    from mmrl.vlm.config import WarmStartConfig
    from mmrl.vlm.warm_start import format_warm_start

    _, proc, P, R, MM = _mixed_rows(tiny_path)
    pad = proc.tokenizer.pad_token_id
    R = [r + [7] for r in R]  # every response non-empty
    cfg = WarmStartConfig(steps=3, lr=1e-2, params=["lm_head"])
    after = []
    for which in ("new", "old"):
        torch.manual_seed(0)
        model, _ = load_policy(tiny_path)
        if which == "new":
            loss = format_warm_start(model, list(model.named_parameters()), cfg, lambda step: (P, R, MM), pad)
        else:
            params = [p for n, p in model.named_parameters() if "lm_head" in n]
            opt = torch.optim.Adam(params, lr=cfg.lr)
            for _ in range(cfg.steps):
                batch, Pl, mask = collate(model, P, R, MM, pad)
                logp, _ = response_logprobs(model, batch, Pl, batch["input_ids"][:, Pl:])
                loss_t = -agg_loss(logp, mask, "token-mean")
                opt.zero_grad(set_to_none=True)
                loss_t.backward()
                opt.step()
            loss = float(loss_t.detach())
        after.append((loss, {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert after[0][0] == after[1][0]
    assert all(torch.equal(after[0][1][n], after[1][1][n]) for n in after[0][1])
    with pytest.raises(ValueError, match=r"warm_start.params=\['nothing'\]: no trainable parameter"):
        format_warm_start(model, list(model.named_parameters()), WarmStartConfig(steps=1, params=["nothing"]),
                          lambda step: (P, R, MM), pad)


METRIC_PREFIXES = ("reward/", "policy/", "kl/", "train/", "rollout/", "eval/", "time/", "diag/", "cost/", "dist/",
                   "perf/", "async/")


def test_every_logged_metric_has_a_design_prefix(tiny_path, tmp_path):
    """A tiny run with the KL loss, entropy, overlong shaping, DAPO and dropped samples: every key it logs (besides
    `step`) starts with one of the design's prefixes (no bare `accuracy`, `kl`, `lr`, no `actor/*`)."""
    out = tmp_path / "run"
    grpo.train(_cfg(tiny_path, out, "algo.kl.coef=0.01", "algo.entropy_coef=0.01", "reward.overlong_buffer=2",
                    "algo.dynamic_sampling=true", "algo.max_gen_batches=2", "update.epochs=2",
                    "reward.on_nonfinite=drop_sample", "log.eval_every=1", "log.sample_every=0"))
    keys = {k for r in metrics_rows(out) for k in r} - {"step"}
    assert keys and all(k.startswith(METRIC_PREFIXES) for k in keys), sorted(k for k in keys
                                                                              if not k.startswith(METRIC_PREFIXES))
    assert {"reward/accuracy", "kl/ref", "policy/lr", "policy/entropy", "rollout/dynamic/rounds"} <= keys


# ------------------------------------------------------------------ training runs


def test_metrics_and_logprob_drift(tiny_path, tmp_path):
    out = tmp_path / "run"
    summary = grpo.train(_cfg(tiny_path, out))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "reward/std", "reward/accuracy", "rollout/response_length/mean",
                "rollout/response_length/max",
                "rollout/clip_ratio", "policy/clipfrac", "policy/entropy", "policy/loss", "time/rollout_s",
                "time/reward_s", "time/train_s", "time/step_s", "diag/logprob_drift"):
        assert key in rows[0], key
    assert all(r["diag/logprob_drift"] < 1e-4 for r in rows)
    assert "eval/accuracy" in rows[-1] and "eval_accuracy_first" in summary
    assert (out / "samples" / "step_000002.png").is_file() and (out / "checkpoints" / "step_2" / "COMPLETE").is_file()


def test_recompute_old_logprobs_kl_loss_and_minibatches(tiny_path, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(tiny_path, out, "update.epochs=2", "update.mini_batch_size=4", "algo.kl.coef=0.01",
               "algo.kl.estimator=k3", "algo.advantage=rloo", "algo.loss_agg=seq-mean-token-sum-norm",
               "reward.overlong_buffer=2", "warm_start.steps=0", "log.sample_every=0")
    grpo.train(cfg)
    rows = metrics_rows(out)
    for r in rows:
        assert r["diag/logprob_drift"] < 1e-4
        assert "kl/ref" in r and r["kl/ref"] >= 0 and "time/old_logprob_s" in r and "time/ref_s" in r
        assert r["reward/overlong"] <= 0


def test_resume_equals_uninterrupted_run(tiny_path, tmp_path):
    common = ("model.lora.rank=4", "algo.kl.coef=0.05", "train.save_every=2", "optim.lr=5e-3",
              "warm_start.params=[]", "log.sample_every=0")
    full = tmp_path / "full"
    grpo.train(_cfg(tiny_path, full, "train.max_steps=4", *common))
    part = tmp_path / "part"
    grpo.train(_cfg(tiny_path, part, "train.max_steps=2", *common))
    grpo.train(_cfg(tiny_path, part, "train.max_steps=4", *common))  # resumes from step_2 (resume=auto)

    def strip(rows):  # (perf/: the interrupted run evaluates at its last step 2, and a step's FLOPs count that)
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/", "perf/"))} for r in rows]

    a, b = strip(metrics_rows(full)), strip(metrics_rows(part))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert_same_path(a, b, why=RESUMED_RUN)
    assert any(r["policy/grad_norm"] > 0 for r in a)  # the runs really updated the adapters


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
    opts = ("data.kind=geo3k", f"data.path={path}", "data.template={problem}", "warm_start.steps=0",
            "train.max_steps=1", "log.sample_every=0", "train.save_every=0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo.train(_cfg(tiny_path, tmp_path / "skip", "data.on_error=skip", *opts))
    assert any("img1.png" in str(w.message) for w in caught)
    assert len(metrics_rows(tmp_path / "skip")) == 1
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
    ("algo.loss_agg=mean", "loss_agg"), ("algo.kl.estimator=k9", "algo.kl.estimator"),
    ("algo.advantage=ppo", "advantage"),
    ("algo.old_logprobs=rollout", "one update per rollout"), ("data.kind=coco", "data.kind"),
    ("rollout.engine=sglang", "rollout.engine"), ("algo.policy_loss=ppo2", "unknown policy loss 'ppo2'; valid: "),
    ("rollout.n=4", "unknown config key 'rollout.n'"), ("warmup.sft_steps=3", "unknown config key 'warmup.sft_steps'"),
    ("dist.strategy=fsdp", "FSDP with rollout.engine=hf only"), ("dist.strategy=zero3", "dist.strategy"),
])
def test_bad_config_fails_with_clear_error(tiny_path, tmp_path, override, match):
    extra = ["update.epochs=2"] if "rollout" in override and "old" in override else []
    extra += ["rollout.engine=vllm"] if override == "dist.strategy=fsdp" else []  # FSDP: the HF engine only
    with pytest.raises(ValueError, match=match):
        grpo.train(_cfg(tiny_path, tmp_path / "bad", override, *extra, "warm_start.steps=0"))


def test_one_response_per_prompt_only_with_a_batch_whitened_estimator(tmp_path):
    """rollout.n=1: a group of one gets advantage 0 from every group-relative estimator (nothing would train, as
    before this check, silently); REINFORCE++ whitens over the whole batch, so n=1 still gives a signal there."""
    from mmrl.core import get_advantage_estimator

    singletons = get_advantage_estimator("reinforce_pp")(torch.tensor([0.0, 1.0, 3.0]), torch.tensor([0, 1, 2]))
    assert singletons.abs().min() > 0.1  # whitened rewards: (r - mean) / std, no group involved
    grpo.check_config(_cfg("unused", tmp_path, "rollout.group_size=1", "algo.advantage=reinforce_pp"))
    for adv in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError,
                           match=f"rollout.group_size=1: algo.advantage={adv} compares the responses to one"):
            grpo.check_config(_cfg("unused", tmp_path, "rollout.group_size=1", f"algo.advantage={adv}"))
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step \* rollout.group_size = 1"):
        grpo.check_config(_cfg("unused", tmp_path, "rollout.group_size=1", "rollout.prompts_per_step=1",
                               "algo.advantage=reinforce_pp"))
    # the smallest group the group estimators accept
    grpo.check_config(_cfg("unused", tmp_path, "rollout.group_size=2"))


# ------------------------------------------------------------------ vision features reused in the update


@pytest.mark.slow
def test_policy_update_vision_cache_lm_only_equal_and_vision_lora_still_trained(tiny_path, tmp_path):
    """LoRA on the language model only: the update with reused vision features gives the same adapters as without.
    LoRA on the vision tower too: the cache handed to policy_update is bypassed in the training forward, so the
    vision LoRA weights get gradients and move (B starts at 0)."""
    batch = _fixed_rollouts(tiny_path)
    for train_vision in (False, True):
        after = [_run_update(tiny_path, batch, _UPDATE_CASES["lm_split"] | {"train_vision": train_vision}, None, reuse)
                 for reuse in (False, True)]
        for name in after[0]:
            torch.testing.assert_close(after[1][name], after[0][name], atol=1e-6, rtol=0)
        vision_b = [n for n in after[1] if "visual" in n and "lora_B" in n]
        assert bool(vision_b) == train_vision
        assert all(after[1][n].abs().max() > 0 for n in vision_b)


# ------------------------------------------------------------------ data parallel (2 CPU processes, gloo)

_UPDATE_CASES = {
    # uneven 5 + 3 rows, micro-batches of 2 (accumulated under no_sync), a group split over the ranks, KL loss,
    # 2 PPO epochs (2 optimizer steps), LoRA on the language model with reused vision features
    "lm_split": {"split": [5, 3], "train_vision": False},
    # 8 + 0: rank 1 joins every all-reduce with a zero-weight placeholder row; vision LoRA trained (cache bypassed)
    "vision_placeholder": {"split": [8, 0], "train_vision": True},
}


def _update_cfg(tiny_path, case):
    return load_config({
        "algorithm": "vlm_grpo", "output_dir": "unused", "device": "cpu",
        "model": {"path": str(tiny_path), "lora": {"rank": 4}, "train_vision": case["train_vision"]},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 5},
        "algo": {"kl": {"coef": 0.05}, "loss_agg": "token-mean"},
        "update": {"micro_batch_size": 2, "epochs": 2, "max_grad_norm": 1.0},
        "optim": {"lr": 1e-4},  # Adam's steps are ~lr * sign(g): fp noise in tiny g scales with lr
    })


def _fixed_rollouts(tiny_path):
    """8 sampled responses (2 prompts x 4) of the tiny policy with fixed rewards: the batch every rank starts from."""
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.config import DataConfig
    from mmrl.vlm.rollout import HFRolloutEngine, SamplingParams
    from mmrl.vlm.rollout_collect import to_request

    model, proc = load_policy(tiny_path)
    items = ShapesQA(DataConfig(colors=["red", "green", "blue"], image_size=84), seed=5).next(2)
    reqs = [to_request(it, proc, DataConfig()) for it in items]
    res = HFRolloutEngine(model, proc).generate(reqs, SamplingParams(n=4, temperature=1.0, max_new_tokens=5, seed=0))
    return {"P": [r.prompt_ids for r in res], "R": [r.response_ids for r in res], "MM": [r.mm for r in res],
            "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
            "gids": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), "pad": proc.tokenizer.pad_token_id}


def _run_update(tiny_path, batch, case, ctx=None, reuse=True, strategy="ddp"):
    """The recipe's own pieces on this rank's share: global advantages, old/ref log-probs, policy_update.
    Returns the trainable (LoRA) parameters after the update (full tensors).
    strategy="fsdp": the recipe's FSDP path: decoder layers sharded before the optimizer is built, no vision cache,
    old/ref passes inside LockstepForwards (ranks hold different row counts), equal micro-batch counts."""
    from mmrl.core import get_advantage_estimator
    from mmrl.distributed import DistContext, LockstepForwards
    from mmrl.training import UpdateGuard
    from mmrl.vlm.batch import RolloutBatch
    from mmrl.vlm.common import VisionCache, language_block_types, vision_has_adapters
    from mmrl.vlm.update import PolicyGradientLoss, contiguous_minibatches, policy_update

    ctx = ctx or DistContext()
    fsdp = strategy == "fsdp" and ctx.enabled
    reuse = reuse and not fsdp
    cfg = _update_cfg(tiny_path, case)
    torch.manual_seed(0)
    states, _ = build_policy(cfg.model, torch.device("cpu"), torch.float32, keep_ref=True)
    model = states.model
    if fsdp:
        ctx.wrap_model(model, "fsdp", fsdp_block_types=language_block_types(model))
        states.refresh()
    params = [p for _, p in states.named_trainable_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    split = case["split"] if ctx.enabled else [sum(case["split"])]
    start, n_local = sum(split[:ctx.rank]), split[ctx.rank]
    rows = list(range(start, start + n_local)) or [0]  # a rank with nothing holds one placeholder row
    rb = RolloutBatch.build(model, *([batch[k][i] for i in rows] for k in ("P", "R", "MM")), batch["pad"])
    r_all, g_all = ctx.gather_group_rewards(batch["rewards"][start:start + n_local], batch["gids"][start:start + n_local])
    rb.advantages = ctx.local_slice(get_advantage_estimator("grpo")(r_all, g_all)) if n_local else torch.zeros(1)
    cache = VisionCache(model) if reuse else None
    pad_1 = torch.full((1, 1), batch["pad"], dtype=torch.long)
    with LockstepForwards(ctx, model, dummy=lambda: model(input_ids=pad_1), enabled=fsdp) as ls_old:
        rb.old_logprobs = rb.logprobs(model, 2, vision_cache=cache)
    with states.use("ref"), LockstepForwards(ctx, model, dummy=lambda: model(input_ids=pad_1), enabled=fsdp):
        ref_cache = VisionCache(model) if reuse and vision_has_adapters(model) else cache
        rb.ref_logprobs = rb.logprobs(model, 2, vision_cache=ref_cache)
    tmodel = model if fsdp else ctx.wrap_model(model, "ddp")
    al, up = cfg.algo, cfg.update
    loss_fn = PolicyGradientLoss(al.policy_loss, al.clip_low, al.clip_high, al.dual_clip, al.loss_agg,
                                 cfg.rollout.max_new_tokens, al.entropy_coef, al.kl.coef, al.kl.estimator)
    n_rows = ctx.max_int(n_local) if ctx.enabled else n_local
    res = policy_update(tmodel, rb, opt, params, loss_fn=loss_fn,
                        minibatches=contiguous_minibatches(n_local, n_rows, n_rows),
                        micro_batch_size=up.micro_batch_size, epochs=up.epochs, max_grad_norm=up.max_grad_norm,
                        guard=UpdateGuard(3, ctx), lr_scheduler=sched, ctx=ctx, equal_micro_batches=fsdp,
                        vision_cache=cache)
    stats = {"dist/padding_micro_batches": sum(ctx.all_gather_object(res.placeholders))} if fsdp else {}
    out = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
           for n, p in states.named_trainable_parameters()}
    if fsdp:
        out["_padding"] = torch.tensor(stats["dist/padding_micro_batches"])
        out["_dummies"] = torch.tensor(sum(ctx.all_gather_object(ls_old.dummies)))
    return out


def _update_worker(ctx, out: str, strategy: str = "ddp") -> None:
    data = torch.load(Path(out) / "batch.pt", weights_only=False)
    res = {name: _run_update(data["tiny"], data["batch"], case, ctx, strategy=strategy)
           for name, case in _UPDATE_CASES.items()}
    torch.save(res, Path(out) / f"{strategy}_rank{ctx.rank}.pt")


@pytest.mark.slow
def test_two_rank_policy_update_equals_one_rank_on_combined_batch(tiny_path, tmp_path):
    """policy_update on 2 processes (DDP, gloo) = 1 process on the 8 rows together: uneven 5 + 3 split with
    micro-batch accumulation and a group spread over both ranks; 8 + 0 with a zero-weight placeholder rank and a
    trained vision LoRA. 2 PPO epochs (two AdamW steps), KL loss, grad clipping."""
    batch = _fixed_rollouts(tiny_path)
    torch.save({"tiny": str(tiny_path), "batch": batch}, tmp_path / "batch.pt")
    env = child_env()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "update", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"2-rank update failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    print(f"[test_grpo] 2-rank policy_update wall {time.perf_counter() - t0:.1f}s")
    ranks = [torch.load(tmp_path / f"ddp_rank{r}.pt", weights_only=False) for r in range(2)]
    for name, case in _UPDATE_CASES.items():
        single = _run_update(tiny_path, batch, case)
        worst = 0.0
        for key, value in single.items():
            for r in range(2):
                torch.testing.assert_close(ranks[r][name][key], value, atol=1e-6, rtol=0, msg=f"{name} {key} rank {r}")
                worst = max(worst, float((ranks[r][name][key] - value).abs().max()))
        print(f"[test_grpo] {name}: max |2 ranks - 1 rank| over the LoRA parameters {worst:.2e}")
        # the update really moved the adapters (LoRA B starts at 0; two Adam steps of ~lr each)
        assert max(float(v.abs().max()) for k, v in single.items() if "lora_B" in k) > 1e-4
        if case["train_vision"]:
            assert any("visual" in k and "lora_B" in k and float(v.abs().max()) > 0 for k, v in single.items())


@pytest.mark.slow
def test_two_rank_policy_update_under_fsdp_equals_one_rank(tiny_path, tmp_path):
    """The FSDP path of the recipe with uneven rows per rank (what DAPO dynamic sampling produces): 5 + 3 rows and
    8 + 0 rows (placeholder rank, vision LoRA trained); old/ref passes in LockstepForwards, micro-batch counts
    padded with zero-weight micro-batches. The full adapters equal 1 process on the 8 rows together."""
    batch = _fixed_rollouts(tiny_path)
    torch.save({"tiny": str(tiny_path), "batch": batch}, tmp_path / "batch.pt")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "update", str(tmp_path), "fsdp"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"2-rank FSDP update failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    ranks = [torch.load(tmp_path / f"fsdp_rank{r}.pt", weights_only=False) for r in range(2)]
    for name, case in _UPDATE_CASES.items():
        single = _run_update(tiny_path, batch, case)
        # the ranks really ran different forward counts: dummy forwards in the old pass, padded micro-batches
        assert int(ranks[0][name]["_dummies"]) > 0 and int(ranks[0][name]["_padding"]) > 0
        worst = 0.0
        for key, value in single.items():
            for r in range(2):
                torch.testing.assert_close(ranks[r][name][key], value, atol=1e-6, rtol=0, msg=f"{name} {key} rank {r}")
                worst = max(worst, float((ranks[r][name][key] - value).abs().max()))
        print(f"[test_grpo] FSDP {name}: max |2 ranks - 1 rank| {worst:.2e}; dummy forwards "
              f"{int(ranks[0][name]['_dummies'])}, padding micro-batches {int(ranks[0][name]['_padding'])} "
              f"({time.perf_counter() - t0:.1f}s)")


@pytest.mark.slow
@pytest.mark.skipif(not (Path(sys.executable).parent / "torchrun").exists(), reason="torchrun not in the venv")
def test_torchrun_ddp_train_then_resume_on_one_process(tmp_path):
    """`torchrun --nproc_per_node 2 -m mmrl.cli train configs/vlm/grpo_tiny_shapes.yaml ... dist.strategy=ddp`
    (DAPO dynamic sampling, mini-batches, micro-batches) writes one metrics row per step from rank 0 and
    checkpoints; then one plain process resumes from the newest checkpoint to step 3."""
    out = tmp_path / "run"
    args = ["train", str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"), f"output_dir={out}",
            f"model.path={tmp_path / 'tiny'}", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "warm_start.steps=20", "warm_start.batch_size=8", "data.eval_size=4", "log.sample_every=1",
            "log.eval_every=0", "train.save_every=1",
            "algo.dynamic_sampling=true", "algo.max_gen_batches=2", "update.mini_batch_size=8",
            "update.micro_batch_size=3", "dist.strategy=ddp"]
    env = child_env()
    t0 = time.perf_counter()
    proc = run_torchrun(["-m", "mmrl.cli", *args, "train.max_steps=2"], cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone logs
    assert all(r["diag/logprob_drift"] < 1e-4 for r in rows if "diag/logprob_drift" in r)
    assert all(r["rollout/dynamic/rounds"] in (1, 2) for r in rows)
    assert any("policy/grad_norm" in r for r in rows)  # the 20-step format warm start gives varied rewards: updates ran
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file() and (out / "config.yaml").is_file()
    t1 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", *args, "train.max_steps=3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"1-process resume failed:\n{proc.stderr[-6000:]}"
    print(f"[test_grpo] torchrun 2 procs 2 steps {wall:.1f}s; 1-process resume to step 3 {time.perf_counter() - t1:.1f}s")
    assert "eval accuracy before RL" not in proc.stdout  # resumed, not restarted
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (out / "checkpoints" / "step_3" / "COMPLETE").is_file()


@pytest.mark.slow
def test_the_run_that_builds_the_tiny_model_equals_a_later_run(tmp_path):
    """`mmrl train configs/vlm/grpo_tiny_shapes.yaml` with `model.build_tiny` twice, the same command: the first run
    builds the missing tiny model, the second finds its files. Building draws from its own random state, so both
    runs log the same metrics (they differed at every step when the builder reseeded the global generator)."""
    model = tmp_path / "tiny_qwen2_vl"
    common = [f"model.path={model}", "train.max_steps=2", "train.save_every=0", "warm_start.steps=2",
              "rollout.prompts_per_step=2", "rollout.group_size=2", "log.eval_every=0", "log.sample_every=0",
              "data.eval_size=4"]
    rows = {}
    for name in ("builds", "loads"):
        assert (model / "config.json").is_file() == (name == "loads")
        proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", str(ROOT / "configs/vlm/grpo_tiny_shapes.yaml"),
                               f"output_dir={tmp_path / name}", *common], cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[name] = [without_time(r) for r in metrics_rows(tmp_path / name)]
    assert len(rows["builds"]) == 2
    assert_same_path(rows["builds"], rows["loads"], why="same command and model files, one process each")


# ------------------------------------------------------------------ non-finite rewards and updates

from mmrl.rewards import RewardModel, RewardOutput, register  # noqa: E402


@register("_test_nan_text")
class _NanText(RewardModel):
    """A custom reward gone wrong: NaN for response 1 of every batch (response length mod 3 for the others)."""

    name, kind = "_test_nan_text", "text"

    def __init__(self, device=None):
        pass

    def score_texts(self, completions, metadata, prompts):
        s = torch.tensor([float(len(c) % 3) for c in completions])
        s[1] = float("nan")
        return RewardOutput(s, {})


_LORA = ("model.lora.rank=4", "model.train_vision=false", "warm_start.steps=0",
         "log.sample_every=0", "optim.lr=1e-2")


def _strict_rows(out):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in lines]


def test_nan_reward_error_or_drop_sample(tiny_path, tmp_path):
    from safetensors.torch import load_file

    from mmrl.run.files import NonFiniteError

    with pytest.raises(NonFiniteError, match=r"reward '_test_nan_text' returned a non-finite score \(nan\) for sample "
                                             r"1 of 8 \(prompt 0, response 1: .*\).*reward.on_nonfinite=drop_sample"):
        grpo.train(_cfg(tiny_path, tmp_path / "err", "reward.name=_test_nan_text", "train.max_steps=1", *_LORA))
    assert not (tmp_path / "err" / "checkpoints" / "step_1").exists()
    # drop_sample: response 1 leaves its group (3 responses left); the run trains on and saves finite adapters
    # (today's main: NaN in every saved LoRA tensor)
    out = tmp_path / "drop"
    grpo.train(_cfg(tiny_path, out, "reward.name=_test_nan_text", "reward.on_nonfinite=drop_sample", *_LORA))
    rows = _strict_rows(out)
    assert [r["reward/nonfinite_samples"] for r in rows] == [1, 1]
    assert all(r["policy/grad_norm"] > 0 and r["train/skipped_updates"] == 0 for r in rows)
    lora = load_file(out / "checkpoints/step_2/adapters/default/adapter_model.safetensors")
    assert lora and all(bool(torch.isfinite(v).all()) for v in lora.values())


def test_nonfinite_loss_skips_update_then_stops(tiny_path, tmp_path, monkeypatch):
    from mmrl.core import POLICY_LOSSES
    from mmrl.run.files import NonFiniteError

    real_loss, real_update, unchanged = POLICY_LOSSES["ppo_clip"], grpo.policy_update, []

    def nan_loss(*args, **kwargs):
        loss, m = real_loss(*args, **kwargs)
        return loss * float("nan"), m

    def spy(model, batch, optimizer, params, *args, **kwargs):  # are the trained tensors bit-identical after it?
        before = [p.detach().clone() for p in params]
        try:
            return real_update(model, batch, optimizer, params, *args, **kwargs)
        finally:
            unchanged.append(all(torch.equal(p.detach(), b) for p, b in zip(params, before)))

    monkeypatch.setitem(POLICY_LOSSES, "ppo_clip", nan_loss)
    monkeypatch.setattr(grpo, "policy_update", spy)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"2 consecutive updates had a non-finite loss/gradient at step 2 "):
        grpo.train(_cfg(tiny_path, out, "train.max_steps=3", "update.max_skipped_updates=2", *_LORA))
    assert unchanged == [True, True]
    (row,) = _strict_rows(out)  # step 1: one mini-batch, skipped; its NaN gradient norm is logged as null
    assert row["train/skipped_updates"] == 1 and row["policy/grad_norm"] is None


if __name__ == "__main__":  # the 2-rank worker of test_two_rank_policy_update_equals_one_rank_on_combined_batch
    if sys.argv[1] == "update":
        spawn_ranks(_update_worker, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "ddp")


def test_cpgd_advantage_and_loss_train_end_to_end(tiny_path, tmp_path, monkeypatch):
    """`algo.advantage: cpgd` + `algo.policy_loss: cpgd` (LightRFT's CPGD row) reach the recipe: a tiny run uses the
    registered CPGD loss for every micro-batch and trains with finite policy metrics (the loss itself is checked
    against cpgd_loss in test_policy_update_loss_registry_and_token_advantages)."""
    import mmrl.core.cpgd as cpgd
    from mmrl.core.losses import POLICY_LOSSES
    from mmrl.vlm.grpo import train

    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return cpgd.registered_cpgd_loss(*a, **kw)

    monkeypatch.setitem(POLICY_LOSSES, "cpgd", counted)
    out = tmp_path / "cpgd"
    train(_cfg(tiny_path, out, "algo.policy_loss=cpgd", "algo.advantage=cpgd", "update.epochs=2"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(calls) >= 2 * 2 * 2  # 2 steps x 2 epochs x >= 2 micro-batches of 3 rows out of 8
    assert all(math.isfinite(r["policy/loss"]) and math.isfinite(r["policy/grad_norm"]) for r in rows)


def test_running_reward_norm_is_applied_and_checkpointed(tiny_path, tmp_path):
    """`reward.running_norm` (LightRFT): the statistics grow with every reward seen (8 per step here) and go into
    the checkpoint, so a resumed run continues them."""
    from mmrl.run.directory import Run
    from mmrl.vlm.grpo import train

    out = tmp_path / "rn"
    train(_cfg(tiny_path, out, "reward.running_norm=true", "train.save_every=1"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/running_count"] for r in rows] == [8, 16]
    state = Run.load_state(out / "checkpoints" / "step_2")
    assert state["stateful"]["reward_norm"]["count"] == 16
    train(_cfg(tiny_path, out, "reward.running_norm=true", "train.save_every=1", "train.max_steps=3"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/running_count"] for r in rows] == [8, 16, 24]


def test_bypass_policy_gradient_correction_by_hand():
    """policy_loss=reinforce with the correction in the loss (bypass): w = min(pi / pi_rollout, 2) from the current
    policy per token, a token outside [1/3, 3] rejected (no gradient, still in the token-mean normaliser), so the
    loss is -sum(w * A * logp) / 6 and its gradient -w * A / 6 on kept tokens."""
    from mmrl.training.config import RolloutCorrectionConfig
    from mmrl.vlm.batch import RolloutBatch
    from mmrl.vlm.update import MicroBatch, PolicyGradientLoss

    rollout = torch.tensor([[-1.0, -1.0, -3.0], [-0.5, -0.5, -0.5]])
    ones = torch.ones(2, 3, dtype=torch.bool)
    z = torch.zeros(2, 4, dtype=torch.long)
    batch = RolloutBatch(input_ids=z, attention_mask=z + 1, position_ids=torch.zeros(3, 2, 4, dtype=torch.long),
                         mm_token_type_ids=z, prompt_lens=torch.tensor([1, 1]), response_lens=torch.tensor([3, 3]),
                         prompt_len=1, response_mask=ones, loss_mask=ones, mm=[{}, {}],
                         advantages=torch.tensor([1.0, -2.0]), old_logprobs=rollout, rollout_logprobs=rollout)
    logp = torch.tensor([[-1.0, -2.0, -0.1], [-0.5, -0.5, -0.5]], requires_grad=True)
    corr = RolloutCorrectionConfig(is_level="token", is_threshold=2.0, rs_level="token", rs_threshold=3.0)
    fn = PolicyGradientLoss("reinforce", correction=corr)
    loss, m = fn(MicroBatch(batch, logp, None, mini_tokens=6.0, mini_rows=2, scale=1.0, placeholder=False))
    w = torch.tensor([[1.0, math.exp(-1.0), 0.0], [1.0, 1.0, 1.0]])  # e^2.9 > 3: rejected; e^-1 > 1/3: kept
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3])
    assert float(loss.detach()) == pytest.approx(float(-(w * adv * logp.detach()).sum() / 6), rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -w * adv / 6, atol=1e-7)
    assert m["rollout/correction/rollout_rs_masked_fraction"] == pytest.approx(1 / 6)
    assert m["rollout/correction/rollout_is_max"] == pytest.approx(math.exp(2.9), rel=1e-5)
    # without the correction: plain REINFORCE, every token at weight 1
    logp.grad = None
    PolicyGradientLoss("reinforce")(MicroBatch(batch, logp, None, 6.0, 2, 1.0, False))[0].backward()
    assert torch.allclose(logp.grad, -adv / 6)


def test_update_metrics_reduce_max_min_and_mean_over_micro_batches():
    """Per-micro-batch metrics: *_max (ratio_max, the bypass correction's rollout_is_max) and drift by max, *_min by
    min, the rest by mean."""
    from mmrl.vlm.update import UpdateResult

    res = UpdateResult(values={"policy/ratio_max": [1.5, 3.0], "rollout/correction/rollout_is_max": [2.0, 7.0],
                               "rollout/correction/rollout_is_min": [0.5, 0.25], "policy/loss": [1.0, 3.0]})
    got = res.metrics()
    assert got["policy/ratio_max"] == 3.0 and got["rollout/correction/rollout_is_max"] == 7.0
    assert got["rollout/correction/rollout_is_min"] == 0.25 and got["policy/loss"] == 2.0


def test_bypass_correction_in_the_recipe_and_its_config_check(tiny_path, tmp_path):
    """old_logprobs=rollout + policy_loss=reinforce + rollout_correction trains and logs the per-micro-batch
    correction metrics (HF rollouts: weights ~1); with ppo_clip the same settings fail at start-up (the correction
    would do nothing)."""
    from mmrl.vlm.grpo import train

    bypass = ("algo.old_logprobs=rollout", "algo.rollout_correction.is_level=sequence",
              "algo.rollout_correction.rs_level=token")
    with pytest.raises(ValueError, match="the correction would do nothing"):
        train(_cfg(tiny_path, tmp_path / "bad", *bypass))
    out = tmp_path / "pg"
    train(_cfg(tiny_path, out, *bypass, "algo.policy_loss=reinforce"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("time/old_logprob_s" not in r for r in rows)  # bypass: no old-log-prob pass
    for r in rows:
        assert abs(r["rollout/correction/rollout_is_mean"] - 1.0) < 1e-4
        assert r["rollout/correction/rollout_rs_masked_fraction"] == 0.0
        assert math.isfinite(r["policy/loss"]) and r["policy/clipfrac"] == 0.0


def test_rollout_correction_section_weights_masks_and_reaches_the_recipe(tiny_path, tmp_path):
    """`algo.rollout_correction` (verl's TIS/MIS): the section's apply() is core.rollout_correction with its
    settings (hand-checked: ratio e^1 capped at 2, ratio e^-3 masked by the veto), and a recipe run logs the
    correction metrics; HF rollouts sample with the trainer's own log-probs, so every weight there is ~1."""
    from mmrl.training.config import RolloutCorrectionConfig
    from mmrl.vlm.grpo import train

    sec = RolloutCorrectionConfig(is_level="token", is_threshold=2.0, rs_level="none", veto_threshold=0.1)
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, -2.0], [3.0, 0.0, 0.0]])
    w, keep, m = sec.apply(old, rollout, torch.ones(2, 3, dtype=torch.bool))
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 1.0], [math.exp(-3.0), 1.0, 1.0]]))
    assert keep.tolist() == [[True] * 3, [False] * 3]  # a token with ratio e^-3 < 0.1 vetoes its row
    assert all(k.startswith("rollout/correction/") for k in m)
    with pytest.raises(ValueError, match=r"algo.rollout_correction.is_threshold: expected a finite number > 1, got 1.0"):
        RolloutCorrectionConfig(is_threshold=1.0)
    out = tmp_path / "rc"
    train(_cfg(tiny_path, out, "algo.rollout_correction.is_level=token", "algo.rollout_correction.rs_level=sequence",
               "algo.old_logprobs=recompute"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert abs(r["rollout/correction/rollout_is_mean"] - 1.0) < 1e-4
        assert r["rollout/correction/rollout_rs_masked_fraction"] == 0.0
        assert r["time/old_logprob_s"] > 0  # decoupled: the old-log-prob pass ran
