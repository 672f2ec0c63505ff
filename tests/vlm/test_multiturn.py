"""Multi-turn rollout on the tiny Qwen2-VL, loss masks, credit assignment by hand, truncation, resume."""

from __future__ import annotations

import math
import time

import pytest
import torch

from mmrl.testing import RESUMED_RUN, assert_same_path, child_env, run_torchrun, without_time
from mmrl.vlm.credit import episode_returns, informative_groups, token_advantages, turn_advantages
from mmrl.vlm.envs import Env, EnvManager, Observation, register_env, turn_discounted_return
from mmrl.vlm.episode_train import episode_batch
from mmrl.vlm.episodes import ChatFormat, Episode, Turn, encode_observation, rollout_episodes
from mmrl.vlm.rollout import HFRolloutEngine, SamplingParams
from mmrl.vlm.update import MicroBatch, PolicyGradientLoss


def policy_loss(model, episodes, adv, pad_id, *, temperature, clip_low, clip_high, normalizer, entropy_coef=0.0,
                vision_cache=None):
    """The recipe's training loss of one micro-batch of episodes (episode_batch -> forward -> PolicyGradientLoss,
    as mmrl.vlm.update.policy_update runs it), + the max |log p - rollout log p| over policy tokens as "drift"."""
    batch = episode_batch(model, episodes, pad_id, adv)
    logp, ent = batch.forward_logprobs(model, temperature, with_entropy=entropy_coef > 0,
                                       entropy_grad=entropy_coef > 0, vision_cache=vision_cache)
    loss, m = PolicyGradientLoss("ppo_clip", clip_low, clip_high, entropy_coef=entropy_coef)(
        MicroBatch(batch, logp, ent, normalizer, len(episodes), 1.0, False))
    m["drift"] = float(((logp.detach() - batch.old_logprobs).abs() * batch.loss_mask).max())
    return loss, m


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mmrl.tiny import build_tiny_qwen2_vl
    from mmrl.vlm.common import load_policy

    torch.set_num_threads(1)
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("mt") / "qwen2_vl")
    model, processor = load_policy(path)
    return path, model, processor


def _rollout(tiny, specs, max_turns=2, max_seq_len=512, max_new_tokens=3, scheduling="lockstep", seed=0):
    _, model, processor = tiny
    engine, fmt = HFRolloutEngine(model, processor), ChatFormat(processor)
    with EnvManager(2) as mgr:
        eps = rollout_episodes(engine, fmt, mgr, specs, SamplingParams(max_new_tokens=max_new_tokens, seed=seed),
                               max_turns=max_turns, max_seq_len=max_seq_len, scheduling=scheduling)
    return eps, fmt


GRID = {"width": 5, "max_turns": 4}


def _far_specs(n=2):  # start and goal 4 cells apart: never solved in 2 turns
    return [{"task": "grid_puzzle", "seed": i, "group": 0, "env_kwargs": GRID,
             "task_kwargs": {"start": (0, 0), "goal": (4, 0)}} for i in range(n)]


# ---------------------------------------------------------------------------------------------- rollout

def test_two_episode_two_turn_rollout_layout(tiny):
    _, model, processor = tiny
    eps, fmt = _rollout(tiny, _far_specs())
    tok = processor.tokenizer
    img = tok.convert_tokens_to_ids("<|image_pad|>")
    for ep in eps:
        assert ep.end_reason == "max_turns" and len(ep.turns) == 2 and not ep.success
        assert len(ep.ids) == len(ep.loss_mask) == len(ep.old_logprobs)
        # the mask is exactly the two responses
        want = [0] * len(ep.ids)
        for t in ep.turns:
            want[t.start:t.end] = [1] * (t.end - t.start)
        assert ep.loss_mask == want and ep.loss_mask[:ep.prompt_len] == [0] * ep.prompt_len
        assert all(lp == 0.0 for lp, m in zip(ep.old_logprobs, ep.loss_mask) if not m)
        assert all(lp < 0 for lp, m in zip(ep.old_logprobs, ep.loss_mask) if m)
        # both observations' images are in the sequence: 5 pads each (140x28 board, 28 px per token)
        assert len(ep.mm) == 2 and ep.ids.count(img) == 10
        assert ep.merged_mm()["image_grid_thw"].tolist() == [[1, 2, 10], [1, 2, 10]]
        assert [t.anchor for t in ep.turns][0] == ((0, 0), (4, 0))
        text = tok.decode(ep.ids)
        assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant\n") == 2
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
        # the environment segment between the turns closes the assistant turn exactly once
        seg = tok.decode(ep.ids[ep.turns[0].end:ep.turns[1].start])
        assert seg.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n<|vision_start|>" in seg
        closing = tok.decode(ep.ids[ep.turns[0].start:ep.turns[0].end]) + seg
        assert closing.count("<|im_end|>") == 2  # end of the assistant turn + end of the user turn
    # rollout log-probs equal the trainer's recomputation over the full trajectories
    from mmrl.vlm.common import compute_logprobs

    lps, _ = compute_logprobs(model, [e.ids[:e.prompt_len] for e in eps], [e.ids[e.prompt_len:] for e in eps],
                              [e.merged_mm() for e in eps], tok.pad_token_id)
    for ep, lp in zip(eps, lps):
        m = torch.tensor(ep.loss_mask[ep.prompt_len:], dtype=torch.bool)
        assert (lp - torch.tensor(ep.old_logprobs[ep.prompt_len:]))[m].abs().max() < 1e-4


def test_rollout_is_reproducible_and_independent_scheduling_completes(tiny):
    a, _ = _rollout(tiny, _far_specs(3), seed=5)
    b, _ = _rollout(tiny, _far_specs(3), seed=5)
    assert [e.ids for e in a] == [e.ids for e in b]
    c, _ = _rollout(tiny, _far_specs(3), seed=5, scheduling="independent")
    for ep in c:
        assert ep.end_reason == "max_turns" and len(ep.turns) == 2
        assert sum(ep.loss_mask) == sum(t.end - t.start for t in ep.turns)


@register_env("_test_mt_flaky")
class FlakyEnv(Env):
    """Seed 1 raises on its first step; seed 2 is slow; all end after 2 turns."""

    stop_strings = ("<|im_end|>",)
    max_turns = 2

    def reset(self, seed, **task):
        self.seed, self.t = seed, 0
        return Observation(f"Say hello {seed}.", anchor=("start",))

    def step(self, action_text):
        self.t += 1
        if self.seed == 1:
            raise RuntimeError("env crashed")
        if self.seed == 2:
            time.sleep(0.3)
        return Observation("Again."), float(self.t), self.t >= 2, {}


@pytest.mark.parametrize("scheduling", ["lockstep", "independent"])
def test_env_error_ends_only_its_episode(tiny, scheduling):
    specs = [{"task": "_test_mt_flaky", "seed": s, "group": 0} for s in range(3)]
    eps, _ = _rollout(tiny, specs, scheduling=scheduling)
    assert [e.end_reason for e in eps] == ["done", "error", "done"]
    assert "RuntimeError: env crashed" in eps[1].error and len(eps[1].turns) == 1 and eps[1].turns[0].reward == 0
    assert [t.reward for t in eps[0].turns] == [1.0, 2.0] and [t.reward for t in eps[2].turns] == [1.0, 2.0]
    assert eps[0].mm == []  # text-only environment


def test_truncation_marks_and_cuts_observations(tiny):
    _, _, processor = tiny
    fmt = ChatFormat(processor)
    env_obs = Observation("You moved left. Move the red square to the green circle. Answer left or right.")
    full, cut = encode_observation(fmt, env_obs, False, [], 10**6)
    assert not cut
    short, cut = encode_observation(fmt, env_obs, False, [], len(full.input_ids) - 5)
    assert cut and len(short.input_ids) <= len(full.input_ids) - 5
    assert "<|im_start|>assistant\n" in processor.tokenizer.decode(short.input_ids)  # framing kept, text cut
    none, cut = encode_observation(fmt, env_obs, False, [], 3)
    assert none is None and cut
    # in a rollout: room for the first prompt and one response only -> the episode ends "truncated"
    eps, _ = _rollout(tiny, _far_specs(1), max_turns=4)
    p0 = eps[0].prompt_len
    eps, _ = _rollout(tiny, _far_specs(1), max_turns=4, max_seq_len=p0 + 3 + 8)
    ep = eps[0]
    assert ep.end_reason == "truncated" and len(ep.turns) == 1 and len(ep.ids) <= p0 + 3


# ---------------------------------------------------------------------------------------------- loss mask

def test_environment_tokens_get_no_gradient(tiny):
    _, model, processor = tiny
    eps, _ = _rollout(tiny, _far_specs())
    adv = token_advantages(eps, torch.tensor([[1.0, -0.5], [-1.0, 0.25]]))
    captured = {}

    def keep_logits(module, inputs, output):  # returns None: the output is not replaced
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(keep_logits)
    try:
        model.zero_grad()
        loss, m = policy_loss(model, eps, adv, processor.tokenizer.pad_token_id, temperature=1.0, clip_low=0.2,
                              clip_high=0.2, normalizer=sum(e.policy_tokens for e in eps))
        loss.backward()
    finally:
        handle.remove()
    g = captured["logits"].grad  # [B, T + 1, V]; row t predicts response token t
    for b, ep in enumerate(eps):
        mask = torch.tensor(ep.loss_mask[ep.prompt_len:], dtype=torch.bool)
        T = len(mask)
        rows = g[b, :T].abs().sum(-1)
        assert torch.all(rows[~mask] == 0) and torch.all(rows[mask] > 0)
        assert torch.all(g[b, T:] == 0)  # padding / the extra last row
    assert m["drift"] < 1e-4
    # garbage at environment positions (rollout log-probs, advantages) changes nothing
    bad = []
    for ep, a in zip(eps, adv):
        ep2 = Episode(**{k: getattr(ep, k) for k in ep.__dataclass_fields__})
        ep2.old_logprobs = [lp if mk else float("nan") for lp, mk in zip(ep.old_logprobs, ep.loss_mask)]
        bad.append(ep2)
    adv_bad = [torch.where(torch.tensor(e.loss_mask[e.prompt_len:], dtype=torch.bool), a, torch.tensor(1e9))
               for e, a in zip(eps, adv)]
    with torch.no_grad():
        kw = dict(temperature=1.0, clip_low=0.2, clip_high=0.2, normalizer=10.0)
        l1, _ = policy_loss(model, eps, adv, processor.tokenizer.pad_token_id, **kw)
        l2, _ = policy_loss(model, bad, adv_bad, processor.tokenizer.pad_token_id, **kw)
    assert float(l1) == float(l2) and math.isfinite(float(l1))
    # entropy bonus: lowers the loss by coef * mean entropy over policy tokens, and carries gradient
    l3, m3 = policy_loss(model, eps, adv, processor.tokenizer.pad_token_id, entropy_coef=0.1, **kw)
    assert m3["policy/entropy"] > 0 and l3.requires_grad
    n_tok = sum(e.policy_tokens for e in eps)
    assert float(l3.detach()) == pytest.approx(float(l1) - 0.1 * m3["policy/entropy"] * n_tok / 10.0, rel=1e-5)


# ---------------------------------------------------------------------------------------------- credit assignment

def _ep(i, group, rewards, anchors, start=10):
    ep = Episode(index=i, task="t", seed=0, group=group, prompt_len=start)
    pos = start
    for r, a in zip(rewards, anchors):
        ep.turns.append(Turn(pos, pos + 2, reward=r, anchor=a))
        pos += 5  # 2 response tokens + 3 environment tokens
    ep.ids = [0] * pos
    return ep


def test_turn_discount_gigpo_and_grpo_by_hand():
    """gamma = 0.5. Episode A: rewards [0, 1], anchors [X, Y]; B: [0, 0, 1], anchors [X, X, Y] (same task).
    Turn returns G: A = [0.5, 1], B = [0.25, 0.5, 1]; episode returns R = G_1 = [0.5, 0.25].
    Episode GRPO: mean 0.375, std (n-1) = 0.125 * sqrt(2) -> A_ep = [+1/sqrt2, -1/sqrt2].
    Anchor X steps: returns [0.5, 0.25, 0.5], mean 5/12, std = sqrt((1/144 + 4/144 + 1/144) / 2) = 1/sqrt(48)
      -> [(1/12) sqrt48, -(2/12) sqrt48, (1/12) sqrt48] = [0.57735, -1.15470, 0.57735]; anchor Y: equal -> 0.
    GiGPO (omega 1) = A_ep + A_step. Turn GRPO: all five returns [0.5, 1, 0.25, 0.5, 1], mean 0.65,
      std = sqrt(0.45 / 4) = 0.335410 -> (G - 0.65) / std."""
    eps = [_ep(0, 0, [0, 1], ["X", "Y"]), _ep(1, 0, [0, 0, 1], ["X", "X", "Y"])]
    s2 = 1 / math.sqrt(2)
    assert episode_returns(eps, 0.5).tolist() == [0.5, 0.25]
    assert episode_returns(eps, 0.5)[1] == turn_discounted_return([0, 0, 1], 0.5)
    grpo = turn_advantages(eps, "grpo", 0.5)
    assert torch.allclose(grpo, torch.tensor([[s2, s2, 0], [-s2, -s2, -s2]]), atol=1e-5)
    step_x = [1 / 12 * math.sqrt(48), -2 / 12 * math.sqrt(48), 1 / 12 * math.sqrt(48)]
    gig = turn_advantages(eps, "gigpo", 0.5, omega=1.0)
    want = torch.tensor([[s2 + step_x[0], s2, 0], [-s2 + step_x[1], -s2 + step_x[2], -s2]])
    assert torch.allclose(gig, want, atol=1e-5)
    half = turn_advantages(eps, "gigpo", 0.5, omega=0.5)
    assert torch.allclose(half[0, 0], torch.tensor(s2 + 0.5 * step_x[0]), atol=1e-5)
    std = math.sqrt(0.45 / 4)
    tg = turn_advantages(eps, "turn_grpo", 0.5)
    want = torch.tensor([[(0.5 - .65) / std, (1 - .65) / std, 0],
                         [(0.25 - .65) / std, (0.5 - .65) / std, (1 - .65) / std]])
    assert torch.allclose(tg, want, atol=1e-5)
    # None anchors never form step groups: only the episode term remains
    eps_none = [_ep(0, 0, [0, 1], [None, None]), _ep(1, 0, [0, 0, 1], [None, None, None])]
    assert torch.allclose(turn_advantages(eps_none, "gigpo", 0.5), grpo, atol=1e-6)
    # token advantages: each turn's value on its 2 response tokens, 0 on environment tokens
    tok = token_advantages(eps, gig)
    assert tok[0].tolist()[:7] == pytest.approx([float(gig[0, 0])] * 2 + [0] * 3 + [float(gig[0, 1])] * 2)
    with pytest.raises(ValueError, match="gigpo"):
        turn_advantages(eps, "ppo", 0.5)


def test_informative_groups_drop_zero_variance():
    eps = [_ep(0, 7, [1], ["a"]), _ep(1, 7, [1], ["a"]), _ep(2, 3, [0], ["a"]), _ep(3, 3, [1], ["a"]),
           _ep(4, 5, [0, 1], ["a", "b"]), _ep(5, 5, [1], ["a"])]
    # returns (gamma 0.9): group 7 [1, 1] (dropped), group 3 [0, 1], group 5 [0.9, 1]
    assert informative_groups(eps, episode_returns(eps, 0.9)) == [3, 5]


# ---------------------------------------------------------------------------------------------- recipe

def _recipe_cfg(out, model_path, **sections):
    from mmrl.config import load_config

    d = {"algorithm": "vlm_multiturn", "output_dir": str(out), "seed": 0, "device": "cpu", "num_threads": 1,
         "model": {"path": str(model_path)},
         "env": {"tasks": {"grid_puzzle": {"width": 5, "max_turns": 2}}, "eval_episodes": 2, "max_workers": 2},
         "rollout": {"prompts_per_step": 2, "group_size": 2, "max_turns": 2, "max_new_tokens": 3, "max_seq_len": 256},
         "algo": {"advantage": "turn_grpo", "dynamic_sampling": False}, "optim": {"lr": 0.01},
         "warm_start": {"steps": 1, "batch_size": 4}, "update": {"micro_batch_size": 2, "mini_batch_size": 2},
         "train": {"max_steps": 2, "save_every": 1}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return load_config(d)


def test_checkpoint_resume_equals_uninterrupted_run(tiny, tmp_path):
    import json

    from safetensors.torch import load_file

    from mmrl.vlm.multiturn import train

    path = tiny[0]
    train(_recipe_cfg(tmp_path / "a", path))
    train(_recipe_cfg(tmp_path / "b", path, train={"max_steps": 1}))
    assert (tmp_path / "b/checkpoints/step_1/COMPLETE").is_file()
    summary = train(_recipe_cfg(tmp_path / "b", path))  # resumes from step 1
    wa = load_file(tmp_path / "a/checkpoints/step_2/adapters/default/model.safetensors")
    wb = load_file(tmp_path / "b/checkpoints/step_2/adapters/default/model.safetensors")
    init = load_file(path / "model.safetensors")
    assert_same_path(wa, wb, why=RESUMED_RUN)
    assert not torch.equal(wa["lm_head.weight"], init["lm_head.weight"])  # the run did train
    rows = {name: [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("a", "b")}
    assert [r["step"] for r in rows["b"]] == [0, 1, 2]  # no step repeated after the resume
    assert_same_path(without_time(rows["a"][-1]), without_time(rows["b"][-1]), why=RESUMED_RUN)
    last = rows["a"][-1]
    for key in ("rollout/episode/turns_mean", "rollout/episode/turns_max", "rollout/episode/done_rate",
                "rollout/episode/max_turns_rate", "rollout/episode/truncated_rate", "rollout/tokens/policy_mean",
                "rollout/tokens/env_mean", "reward/success_rate/grid_puzzle",
                "reward/mean", "reward/std", "diag/logprob_drift", "policy/clipfrac", "policy/approx_kl",
                "time/generation_s", "time/environment_s", "time/preprocessing_s", "eval/success_rate"):
        assert key in last, key
    assert last["diag/logprob_drift"] < 1e-4 and "eval_after" in summary


def test_packing_trains_like_the_padded_run(tiny, tmp_path, monkeypatch):
    """`update.packing: true` in vlm_multiturn (episodes with observations and a board image per turn, packed into
    rows of the longest episode or into one row): the padded run's rewards, losses equal to float precision."""
    import json

    from mmrl.vlm.batch import RolloutBatch
    from mmrl.vlm.multiturn import train

    packed_rows, pack = [], RolloutBatch.pack

    def recording_pack(batch, *a, **kw):
        out = pack(batch, *a, **kw)
        packed_rows.append(out[0]["input_ids"])
        return out

    monkeypatch.setattr(RolloutBatch, "pack", recording_pack)
    rows = {}
    for name, update in (("padded", {}), ("bins", {"packing": True}),
                         ("one_row", {"packing": True, "pack_length": 10 ** 6})):
        packed_rows.clear()
        train(_recipe_cfg(tmp_path / name, tiny[0], update={**update}, train={"max_steps": 2, "save_every": 0}))
        rows[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][1:]
        # the forwards ran packed (or not): several episodes in a row only when one row was asked for
        assert bool(packed_rows) == (name != "padded")
        assert name != "one_row" or all(r.shape[0] == 1 for r in packed_rows)
    assert len(rows["padded"]) == 2
    for name in ("bins", "one_row"):
        for a, b in zip(rows["padded"], rows[name]):
            assert a["reward/mean"] == b["reward/mean"]
            assert a["rollout/tokens/policy_mean"] == b["rollout/tokens/policy_mean"]
            assert a["policy/loss"] == pytest.approx(b["policy/loss"], abs=1e-5)
            assert a["diag/logprob_drift"] == pytest.approx(b["diag/logprob_drift"], abs=1e-5)


def test_configs_load_and_bad_values_fail():
    from pathlib import Path

    from mmrl.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[2] / "configs" / "vlm"
    for name in ("multiturn_grid_tiny", "multiturn_math_tiny", "multiturn_grid_qwen25vl_3b"):
        cfg = load_config(root / f"{name}.yaml")
        assert cfg.algorithm == "vlm_multiturn"
    with pytest.raises(ConfigError, match="unknown config key 'rollout.turns'"):
        load_config({"algorithm": "vlm_multiturn", "rollout": {"turns": 3}})
    from mmrl.vlm.multiturn import check_config

    with pytest.raises(ValueError, match="unknown environment 'mazee'"):
        check_config(load_config({"algorithm": "vlm_multiturn", "env": {"tasks": {"mazee": {}}}}))
    with pytest.raises(ValueError, match="algo.advantage"):
        check_config(load_config({"algorithm": "vlm_multiturn", "algo": {"advantage": "ppo"}}))


PREFIXES = ("reward/", "policy/", "kl/", "train/", "rollout/", "eval/", "time/", "diag/", "cost/", "dist/", "perf/")


def test_logged_metric_names_and_selectable_policy_loss(tiny, tmp_path):
    """Every key a tiny run logs has one of the shared prefixes (KL, entropy and drop_sample on, so their keys
    appear); algo.policy_loss=gspo trains on the same rollouts with the sequence-level ratio."""
    import json

    from mmrl.vlm.multiturn import train

    rows = {}
    for loss in ("ppo_clip", "gspo"):
        train(_recipe_cfg(tmp_path / loss, tiny[0], train={"max_steps": 1, "save_every": 0},
                          algo={"kl": {"coef": 0.05}, "entropy_coef": 0.01, "policy_loss": loss},
                          reward={"on_nonfinite": "drop_sample"}, log={"eval_every": 1}))
        rows[loss] = [json.loads(l) for l in (tmp_path / loss / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows["ppo_clip"] for k in r if k != "step"}
    assert {"kl/ref", "policy/entropy", "policy/loss", "reward/nonfinite_samples", "train/skipped_updates",
            "rollout/dynamic/kept_groups", "reward/success_rate", "eval/success_rate"} <= keys
    assert not [k for k in keys if not k.startswith(PREFIXES)]
    ppo, gspo = rows["ppo_clip"][1], rows["gspo"][1]
    assert ppo["reward/mean"] == gspo["reward/mean"]  # same rollouts (the update comes after)
    assert ppo["policy/loss"] != gspo["policy/loss"]


def test_evaluations_are_not_counted_as_training_flops(tiny, tmp_path):
    """A greedy evaluation after step 1 (log.eval_every: 1) leaves every step's perf/tflops_per_step as in a run
    that evaluates only at the end (it was counted in the next step's row)."""
    import json

    from mmrl.vlm.multiturn import train

    rows = {}
    for every in (0, 1):
        train(_recipe_cfg(tmp_path / str(every), tiny[0], log={"eval_every": every},
                          train={"max_steps": 2, "save_every": 0}))
        rows[every] = [json.loads(x) for x in (tmp_path / str(every) / "metrics.jsonl").read_text().splitlines()]
    assert "eval/success_rate" in rows[1][1] and "eval/success_rate" not in rows[0][1]  # step 1 evaluated
    assert [r["perf/tflops_per_step"] for r in rows[1][1:]] == [r["perf/tflops_per_step"] for r in rows[0][1:]]
    assert rows[1][2]["reward/mean"] == rows[0][2]["reward/mean"]


def test_unknown_keys_and_choices_are_config_errors():
    from mmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="unknown config key 'train.lr'"):
        load_config({"algorithm": "vlm_multiturn"}, ["train.lr=0.1"])
    with pytest.raises(ConfigError,
                       match=r"algo.policy_loss: expected one of \['ppo_clip', 'gspo', 'cpgd', 'reinforce'\]"):
        load_config({"algorithm": "vlm_multiturn", "algo": {"policy_loss": "ppo"}})
    with pytest.raises(ValueError, match=r"update.mini_batch_size=3 must divide the rollout batch .* = 4"):
        from mmrl.vlm.multiturn import check_config

        check_config(load_config({"algorithm": "vlm_multiturn", "rollout": {"prompts_per_step": 2, "group_size": 2},
                                  "update": {"mini_batch_size": 3}}))
    # "async" is the rollout process only: episodes that advance on their own are `rollout.episode_scheduling`
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.async_mode' .*'episode_scheduling'"):
        load_config({"algorithm": "vlm_multiturn"}, ["rollout.async_mode=true"])
    cfg = load_config({"algorithm": "vlm_multiturn"}, ["rollout.episode_scheduling=independent"])
    assert cfg.rollout.episode_scheduling == "independent"
    # a partial section keeps the recipe's defaults (LoRA alpha 32 on the attention projections, lr 1e-3)
    cfg = load_config({"algorithm": "vlm_multiturn", "model": {"lora": {"rank": 4}}, "optim": {"weight_decay": 0.1}})
    assert (cfg.model.lora.alpha, cfg.model.lora.target_modules[0], cfg.optim.lr) == (32, "q_proj", 1e-3)


@pytest.mark.slow
def test_grid_demo_success_rate_rises(tiny, tmp_path):
    """The CPU demo recipe, shortened to 85 RL steps (1.5-3 min on 2 busy cores): greedy success on fixed
    evaluation boards goes from one-direction guessing (0.5) to solving most boards."""
    import json
    from pathlib import Path

    from mmrl.config import load_config
    from mmrl.vlm.multiturn import train

    root = Path(__file__).resolve().parents[2] / "configs" / "vlm"
    cfg = load_config(root / "multiturn_grid_tiny.yaml", [
        f"output_dir={tmp_path}", f"model.path={tiny[0]}", "train.max_steps=85", "log.eval_every=0",
        "train.save_every=0", "env.eval_episodes=32"])
    summary = train(cfg)
    before = summary["eval_before"]["eval/success_rate"]
    after = summary["eval_after"]["eval/success_rate"]
    # measured (seed 0): greedy 0.5 -> 0.75 on 32 boards at step 85 (1.0 on 64 boards from step 75 in the
    # 150-step recipe); sampled success over steps 1-10 ~0.19 -> steps 76-85 ~0.91
    assert before <= 0.6 and after >= 0.7, (before, after)
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    first = sum(r["reward/success_rate"] for r in rows[:10]) / 10
    last = sum(r["reward/success_rate"] for r in rows[-10:]) / 10
    assert last > first + 0.3, (first, last)
    assert max(r["diag/logprob_drift"] for r in rows) < 1e-3


# ---------------------------------------------------------------------------------------------- vision cache

def test_vision_cache_logprobs_equal_on_two_turn_episodes_with_images(tiny):
    """Old/ref-style no-grad log-probs and the training loss with cached image features equal the plain path
    on 2-turn episodes that show a board image in both turns."""
    from mmrl.vlm.common import VisionCache, compute_logprobs, vision_tower

    _, model, processor = tiny
    eps, _ = _rollout(tiny, _far_specs())
    assert all(len(ep.mm) == 2 and ep.merged_mm()["image_grid_thw"].shape[0] == 2 for ep in eps)
    assert eps[0].merged_mm() is eps[0].merged_mm()  # one tensor per episode: the cache key stays valid
    pad = processor.tokenizer.pad_token_id
    args = ([e.ids[:e.prompt_len] for e in eps], [e.ids[e.prompt_len:] for e in eps], [e.merged_mm() for e in eps], pad)
    plain, _ = compute_logprobs(model, *args, micro_batch_size=1)
    cache = VisionCache(model)
    cached, _ = compute_logprobs(model, *args, micro_batch_size=1, vision_cache=cache)
    again, _ = compute_logprobs(model, *args, micro_batch_size=2, vision_cache=cache)  # a second pass: all hits
    for ep, a, b, c in zip(eps, plain, cached, again):  # every position after the first prompt (both turns)
        assert a.numel() == len(ep.ids) - ep.prompt_len and (a - b).abs().max() < 1e-6 and (a - c).abs().max() < 1e-6
    assert cache.vision_calls == 2 and cache.hits == 2  # once per episode image set, however many passes
    kw = dict(temperature=1.0, clip_low=0.2, clip_high=0.28, normalizer=12.0)
    adv = [torch.ones(len(e.ids) - e.prompt_len) for e in eps]
    # training pass, vision tower trainable: the cache refuses itself (features need gradients)
    refused = VisionCache(model)
    policy_loss(model, eps, adv, pad, vision_cache=refused, **kw)
    assert refused.vision_calls == 0
    # training pass, vision tower frozen: same loss and gradients with the cached features
    visual = list(vision_tower(model).parameters())
    flags = [p.requires_grad for p in visual]
    try:
        for p in visual:
            p.requires_grad_(False)
        grads = []
        for vc in (None, VisionCache(model)):
            model.zero_grad(set_to_none=True)
            loss, _ = policy_loss(model, eps, adv, pad, vision_cache=vc, **kw)
            loss.backward()
            grads.append((float(loss.detach()), model.lm_head.weight.grad.clone()))
            assert vc is None or vc.vision_calls == 1
        assert abs(grads[0][0] - grads[1][0]) < 1e-6 and (grads[0][1] - grads[1][1]).abs().max() < 1e-6
    finally:
        for p, f in zip(visual, flags):
            p.requires_grad_(f)
        model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- several processes

def test_episode_gather_one_process():
    from mmrl.distributed import DistContext
    from mmrl.vlm.episodes import gather_episodes, light

    ep = _ep(0, 4, [0.5, 1.0], [("a", 1), ("b", 2)])
    ep.mm = [{"pixel_values": torch.ones(2, 3)}]
    lite = light(ep)  # what other ranks receive: no vision tensors, turns/anchors/group/token counts kept
    assert lite.mm == [] and lite.turns == ep.turns and lite.group == 4 and lite.loss_mask == ep.loss_mask
    assert gather_episodes(DistContext(), [ep]) == ([ep], [0])


@pytest.mark.slow
def test_torchrun_two_processes_ddp_then_one_process_resume(tiny, tmp_path):
    """2 processes (gloo, DDP) train 2 steps; step 1 equals a 1-process run of the same global batch (greedy
    rollouts, so both sample the same episodes): same rewards, same global gradient norm; then 1 process resumes
    the 2-process run to step 3. ~30 s on 2 busy cores."""
    import json
    from pathlib import Path

    from mmrl.config import load_config
    from mmrl.vlm.multiturn import train

    root = Path(__file__).resolve().parents[2]
    cfg_path = root / "configs" / "vlm" / "multiturn_grid_tiny.yaml"
    # rank 0 rolls out a grid group (2 turns, images), rank 1 a one-turn visual QA group: unequal token shares,
    # so the loss scaling is exercised
    tasks = ("env.tasks={grid_puzzle: {width: 5, max_turns: 2}, "
             "math_feedback: {source: shapes, max_turns: 1, image_size: 56}}")
    common = [f"model.path={tiny[0]}", tasks, "train.max_steps=2", "train.save_every=1", "warm_start.steps=1",
              "warm_start.batch_size=4", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_turns=2",
              "rollout.temperature=0", "env.eval_episodes=1", "update.micro_batch_size=1", "update.mini_batch_size=2",
              "algo.dynamic_sampling=false", "algo.advantage=turn_grpo", "update.max_grad_norm=1e9",
              "dist.strategy=ddp"]
    env = child_env()
    out2 = tmp_path / "ddp"
    proc = run_torchrun(["-m", "mmrl.cli", "train", str(cfg_path), f"output_dir={out2}", *common], cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows2 = [json.loads(l) for l in (out2 / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows2] == [0, 1, 2]  # rank 0 alone logs
    assert (out2 / "checkpoints/step_2/COMPLETE").is_file() and (out2 / "samples/step_000001.txt").is_file()
    assert rows2[1]["rollout/dynamic/episodes_sampled"] == 4 and rows2[1]["diag/logprob_drift"] < 1e-4
    assert rows2[1]["rollout/tokens/policy_mean"] == 4.5  # rank 0: 2 x 6 policy tokens, rank 1: 2 x 3 (unequal shares)
    assert rows2[1]["dist/placeholder_minibatches"] == 0
    # one process, same global batch: identical statistics and gradient (loss scaling + global advantages)
    one = train(load_config(cfg_path, [*common, f"output_dir={tmp_path / 'one'}", "train.max_steps=1"]))
    assert one["eval_after"]
    row1 = [json.loads(l) for l in (tmp_path / "one/metrics.jsonl").read_text().splitlines()][1]
    for key in ("reward/mean", "rollout/tokens/policy_mean", "policy/loss", "policy/clipfrac", "policy/approx_kl"):
        assert row1[key] == pytest.approx(rows2[1][key], rel=1e-5, abs=1e-7), key
    assert row1["policy/grad_norm"] == pytest.approx(rows2[1]["policy/grad_norm"], rel=1e-5)
    # the 2-process run resumes in one process
    train(load_config(cfg_path, [*common, f"output_dir={out2}", "train.max_steps=3", "dist.strategy=none"]))
    rows = [json.loads(l) for l in (out2 / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and (out2 / "checkpoints/step_3/COMPLETE").is_file()
    assert rows[:3] == rows2


SKEW_ENV = """
from mmrl.vlm.envs import Env, Observation, register_env


@register_env("_mt_skew")
class SkewEnv(Env):
    \"\"\"One text turn; even seeds reward the response text (informative groups), odd seeds always 0.\"\"\"

    stop_strings = ("<|im_end|>",)
    max_turns = 1

    def reset(self, seed, **task):
        self.seed = seed
        return Observation(f"Task {seed}: say something.", anchor=("task", seed % 2))

    def step(self, action_text):
        r = (sum(map(ord, action_text)) % 5) / 4 if self.seed % 2 == 0 else 0.0
        return Observation(""), r, True, {}
"""


@pytest.mark.slow
def test_torchrun_dynamic_sampling_rank_without_groups_runs_placeholders(tiny, tmp_path):
    """2 processes, DAPO dynamic sampling: rank 0 gets the even seeds (informative groups), rank 1 the odd ones
    (all returns 0, dropped), so rank 1 has no episode to train on and joins each all-reduce with a zero-weight
    micro-batch; both ranks run the same refill rounds (decided on gathered returns) and finish. ~12 s."""
    import json
    import os
    from pathlib import Path

    (tmp_path / "_mt_skew_env.py").write_text(SKEW_ENV)
    root = Path(__file__).resolve().parents[2]
    env = child_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(root), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "run"
    proc = run_torchrun(
        ["-m", "mmrl.cli", "train", str(root / "configs/vlm/multiturn_grid_tiny.yaml"), f"output_dir={out}", f"model.path={tiny[0]}",
         "env.modules=[_mt_skew_env]", "env.tasks={_mt_skew: {}}", "env.eval_episodes=1", "train.max_steps=2",
         "train.save_every=0", "warm_start.steps=0", "update.micro_batch_size=2", "update.mini_batch_size=2",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_new_tokens=4",
         "algo.advantage=gigpo", "algo.dynamic_sampling=true", "algo.max_resample_rounds=2", "dist.strategy=ddp",
         "dist.find_unused_parameters=true"],  # text only: the (trainable) vision tower gets no gradient
        cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # step 1, round 1: seeds 0 (rank 0, kept) and 1 (rank 1, dropped); round 2 refills 1 group, rounded up to one
    # per rank: seeds 2 (kept) and 3 (dropped) -> 2 groups kept, both on rank 0. (Step 2 needed 3 rounds: one even
    # group happened to tie; every refill round is 1 group per rank.)
    assert rows[1]["rollout/dynamic/rounds"] == 2
    for r in rows[1:]:
        assert r["rollout/dynamic/kept_groups"] == 2
        assert r["rollout/dynamic/episodes_sampled"] == 4 * r["rollout/dynamic/rounds"]
        assert r["dist/placeholder_minibatches"] == 2  # rank 1: both mini-batches of the step
        assert r["diag/logprob_drift"] < 1e-4 and r["policy/grad_norm"] > 0


# ---------------------------------------------------------------------------------------- non-finite turn rewards

import threading  # noqa: E402


@register_env("_test_mt_nan")
class NanRewardEnv(Env):
    """One text turn; of every 4 training steps (seeds < 10^6, counted over all instances) the 2nd has a NaN
    reward: exactly one episode per RL step of 2 groups x 2 episodes. Evaluation seeds get 0."""

    stop_strings = ("<|im_end|>",)
    max_turns = 1
    calls = 0
    lock = threading.Lock()

    def reset(self, seed, **task):
        self.seed = seed
        return Observation(f"Task {seed}: say something.", anchor=("task",))

    def step(self, action_text):
        if self.seed >= 10**6:
            return Observation(""), 0.0, True, {}
        with NanRewardEnv.lock:
            NanRewardEnv.calls += 1
            k = NanRewardEnv.calls
        return Observation(""), float("nan") if k % 4 == 2 else (sum(map(ord, action_text)) % 5) / 4, True, {}


def test_nan_turn_reward_error_or_drop_sample(tiny, tmp_path):
    import json

    from safetensors.torch import load_file

    from mmrl.run.files import NonFiniteError
    from mmrl.vlm.multiturn import train

    # one environment worker: the steps run in episode order, so the same episode gets the NaN every time
    sections = dict(env={"tasks": {"_test_mt_nan": {}}, "max_workers": 1},
                    warm_start={"steps": 0}, train={"save_every": 0})
    NanRewardEnv.calls = 0
    with pytest.raises(NonFiniteError, match=r"reward 'environment _test_mt_nan' returned a non-finite score \(nan\) "
                                             r"for sample \d of 4 \(episode \d of group \d, seed \d, turn 1\)"):
        train(_recipe_cfg(tmp_path / "err", tiny[0], **sections))
    NanRewardEnv.calls = 0  # drop_sample: the NaN episode's group is left with one episode and is not trained on
    out = tmp_path / "drop"
    train(_recipe_cfg(out, tiny[0], reward={"on_nonfinite": "drop_sample"}, **sections))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in lines]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["reward/nonfinite_samples"] == 1 and math.isfinite(r["reward/mean"])
        assert r["rollout/dynamic/kept_groups"] == 1 and math.isfinite(r["policy/grad_norm"])
    assert any(r["policy/grad_norm"] > 0 for r in rows[1:])  # trained on the group left whole
    weights = load_file(out / "checkpoints/step_2/adapters/default/model.safetensors")
    assert all(bool(torch.isfinite(v).all()) for v in weights.values())


def test_gigpo_episode_statistics_per_step_row_in_the_recipe_credit():
    """algo.gigpo_episode_stats=step (verl-agent's default): the episode part's mean/std run over turn rows. Same
    episodes as above: rows carry R = [0.5, 0.5 | 0.25, 0.25, 0.25]; row mean 0.35, unbiased row std
    sqrt((2 * 0.0225 + 3 * 0.01) / 4) = sqrt(0.01875); with scale_by_std=False (verl-agent's mean_norm) R - 0.35."""
    eps = [_ep(0, 0, [0, 1], ["X", "Y"]), _ep(1, 0, [0, 0, 1], ["X", "X", "Y"])]
    step_x = [1 / 12 * math.sqrt(48), -2 / 12 * math.sqrt(48), 1 / 12 * math.sqrt(48)]
    sd = math.sqrt(0.01875)
    a, b = 0.15 / sd, -0.1 / sd
    rows = turn_advantages(eps, "gigpo", 0.5, omega=1.0, episode_stats="step")
    want = torch.tensor([[a + step_x[0], a, 0], [b + step_x[1], b + step_x[2], b]])
    assert torch.allclose(rows, want, atol=1e-5)
    mean_norm = turn_advantages(eps, "gigpo", 0.5, omega=0.0, scale_by_std=False, episode_stats="step")
    assert torch.allclose(mean_norm, torch.tensor([[0.15, 0.15, 0], [-0.1, -0.1, -0.1]]), atol=1e-6)
    from mmrl.config import load_config

    cfg = load_config({"algorithm": "vlm_multiturn", "algo": {"gigpo_episode_stats": "step", "scale_by_std": False}})
    assert cfg.algo.gigpo_episode_stats == "step"
