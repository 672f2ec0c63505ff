"""mmrl.training: per-sample reward validation, the optimizer-update guard, the finite-weights check before a
checkpoint, and strict-JSON metrics (NaN/inf -> null)."""

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from torch import nn

from mmrl.config import ConfigError, RunConfig, TrainConfig, load_config
from mmrl.run.checkpoint import check_finite_weights
from mmrl.run.directory import Run
from mmrl.run.files import NonFiniteError
from mmrl.training import NONFINITE_KEY, SKIPPED_KEY, UpdateConfig, UpdateGuard, check_rewards, finite_stats, group_keep


def strict_rows(path):
    """Every line of a metrics.jsonl parsed by a strict JSON parser (NaN / Infinity literals rejected)."""

    def reject(name):
        raise ValueError(f"non-standard JSON constant {name} in {path}")

    return [json.loads(line, parse_constant=reject) for line in open(path).read().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ rewards


def test_check_rewards_error_names_component_and_sample():
    scores = torch.tensor([0.5, float("nan"), 0.2, float("inf")])
    details = {"pickscore": torch.tensor([0.5, 0.1, 0.2, 0.3]), "ocr": torch.tensor([0.0, float("nan"), 0.0, 0.0])}
    with pytest.raises(NonFiniteError, match=r"reward component 'ocr' \(of 'composite'\) returned a non-finite "
                                             r"score \(nan\) for sample 1 of 4 \(prompt 'a cat'\); 2 of 4"):
        check_rewards(scores, details, "error", reward="composite", components=["pickscore", "ocr"],
                      labels=["prompt 'a dog'", "prompt 'a cat'", "x", "y"])
    # a plain reward (no components): the reward's own name; inf is non-finite too
    with pytest.raises(NonFiniteError, match=r"reward 'remote' returned a non-finite score \(inf\) for sample 0 of 2"):
        check_rewards(torch.tensor([float("inf"), 1.0]), {}, reward="remote")
    assert issubclass(NonFiniteError, ValueError)  # the CLI prints it as one line (exit 2)
    with pytest.raises(ValueError, match=r"reward.on_nonfinite: expected one of \['error', 'drop_sample'\]"):
        check_rewards(torch.zeros(2), None, "skip")


def test_check_rewards_drop_sample_mask_and_metric():
    keep, m = check_rewards(torch.tensor([1.0, float("nan"), -float("inf"), 2.0]), None, "drop_sample")
    assert keep.tolist() == [True, False, False, True] and m == {NONFINITE_KEY: 2}
    keep, m = check_rewards(torch.tensor([1.0, 2.0]), None, "error")
    assert keep.tolist() == [True, True] and m == {}
    stats = finite_stats(torch.tensor([1.0, float("nan"), 3.0]))  # float32 in, float32 statistics
    assert stats["reward/mean"] == 2.0 and stats["reward/std"] == pytest.approx(math.sqrt(2), rel=1e-6)


def test_group_keep_drops_sample_and_groups_left_too_small():
    valid = torch.tensor([True, False, True, True, False, True, True, True])
    groups = torch.tensor([7, 7, 7, 3, 3, 9, 9, 9])
    # group 7 keeps 2 of 3, group 3 is left with one sample (nothing kept), group 9 is whole
    assert group_keep(valid, groups).tolist() == [True, False, True, False, False, True, True, True]
    assert group_keep(valid, groups, min_size=1).tolist() == valid.tolist()
    assert group_keep(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long)).numel() == 0


# ------------------------------------------------------------------------------------------ update guard


def _model_and_opt():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _backward(model, scale=1.0):
    loss = model(torch.ones(4, 3)).pow(2).mean() * scale
    loss.backward()
    return loss.detach(), float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))


def test_non_finite_gradient_skips_update_and_keeps_weights_bit_identical():
    model, opt = _model_and_opt()
    guard = UpdateGuard(max_skipped=3)
    loss, gn = _backward(model)
    assert guard.step(opt, [loss], gn, step=1)  # a finite update is applied
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    loss, gn = _backward(model, scale=float("nan"))  # NaN loss -> NaN gradients
    assert not math.isfinite(gn)
    assert not guard.step(opt, [loss], gn, step=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # bit-identical
    assert all(torch.equal(opt_before[k], v) for k, v in opt.state[model.weight].items())  # Adam state untouched
    assert all(p.grad is None for p in model.parameters())  # the NaN gradients are gone
    assert guard.pop_metrics() == {SKIPPED_KEY: 1} and guard.pop_metrics() == {SKIPPED_KEY: 0}
    # a finite loss with an infinite gradient norm is skipped too; a finite update resets the count
    assert not guard.step(opt, [torch.tensor(1.0)], float("inf"), step=3) and guard.consecutive == 2
    loss, gn = _backward(model)
    assert guard.step(opt, [loss], gn, step=4) and guard.consecutive == 0


def test_n_skips_in_a_row_stop_with_the_last_checkpoint(tmp_path):
    run = Run(RunConfig(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig()))
    with run.checkpoint(4) as d:
        (d / "x").write_text("1")
    model, opt = _model_and_opt()
    guard = UpdateGuard(max_skipped=2, run=run)
    assert not guard.step(opt, [1.0, float("nan")], 0.5, step=7)  # a NaN micro-batch loss
    with pytest.raises(NonFiniteError, match=r"2 consecutive updates had a non-finite loss/gradient at step 8 .*"
                                             r"last complete checkpoint: .*step_4"):
        guard.step(opt, [1.0], float("nan"), step=8)
    with pytest.raises(ValueError, match="update.max_skipped_updates must be >= 1"):
        UpdateGuard(max_skipped=0)
    with pytest.raises(ValueError, match="update.max_skipped_updates: expected >= 1"):
        UpdateConfig(max_skipped_updates=0)


def _guard_worker(ctx, out):
    """Only rank 1 sees a NaN loss: both ranks must skip (and then both apply the next, finite update)."""
    model, opt = _model_and_opt()
    guard = UpdateGuard(max_skipped=3, ctx=ctx)
    first = guard.step(opt, [float("nan") if ctx.rank == 1 else 1.0], 0.5, step=1)
    second = guard.step(opt, [1.0], 0.5, step=2)
    torch.save({"first": first, "second": second}, f"{out}/rank{ctx.rank}.pt")


def test_update_guard_decision_is_the_same_on_every_rank(tmp_path):
    from mmrl.testing import spawn_ranks

    spawn_ranks(_guard_worker, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert got == [{"first": False, "second": True}] * 2


# ------------------------------------------------------------------------------------------ checkpoints


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


def test_no_checkpoint_with_non_finite_weights(tmp_path):
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates

    torch.manual_seed(0)
    states = PolicyStates(_Tiny(), LoraConfig(r=2, lora_alpha=4, target_modules=["proj"]), old=True)
    run = Run(RunConfig(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig()))
    check_finite_weights(states, step=1, run=run)  # finite: passes
    states.save(tmp_path / "ok")
    assert (tmp_path / "ok" / "default").is_dir()
    with torch.no_grad():
        states.state_tensors("old")["proj.lora_A.weight"][0, 0] = float("nan")
    assert states.nonfinite_tensors() == ["old:proj.lora_A.weight"]
    with pytest.raises(NonFiniteError, match=r"step 3: 1 policy tensor\(s\) hold NaN/inf \(first: "
                                             r"old:proj.lora_A.weight\); checkpoint step_3 was not written; "
                                             r"last complete checkpoint: none"):
        check_finite_weights(states, step=3, run=run)
    with pytest.raises(ValueError, match=r"PolicyStates.save: 1 tensor\(s\) hold NaN/inf"):
        states.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # nothing written


# ------------------------------------------------------------------------------------------ metrics.jsonl


def test_metrics_jsonl_is_strict_json(tmp_path):
    run = Run(RunConfig(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig()))
    row = run.log(1, {"reward/mean": float("nan"), "a": float("inf"), "b": -float("inf"),
                      "c": torch.tensor(float("nan")), "d": torch.tensor([1.0, float("nan"), float("inf")]),
                      "e": [[1.0, float("nan")], (2.0, math.inf)],
                      "f": np.float32("nan"), "g": np.array([np.inf, 3.0]), "h": {"x": float("nan")}, "i": 2,
                      "j": "text", "k": np.int64(5), "l": 0.5})
    run.log(2, {"reward/mean": 1.5})
    rows = strict_rows(run.metrics_path)
    assert rows[0] == {"step": 1, "reward/mean": None, "a": None, "b": None, "c": None, "d": [1.0, None, None],
                       "e": [[1.0, None], [2.0, None]], "f": None, "g": [None, 3.0], "h": {"x": None}, "i": 2,
                       "j": "text", "k": 5, "l": 0.5}
    assert rows[0] == row and rows[1] == {"step": 2, "reward/mean": 1.5}
    assert run.read_metrics() == rows


def test_config_keys():
    cfg = load_config({"algorithm": "flow_grpo", "reward": {"on_nonfinite": "drop_sample"},
                       "update": {"max_skipped_updates": 5}})
    assert cfg.reward.on_nonfinite == "drop_sample" and cfg.update.max_skipped_updates == 5
    with pytest.raises(ValueError, match="update.max_skipped_updates: expected >= 1"):  # a CLI override is checked too
        load_config({"algorithm": "nft"}, ["update.max_skipped_updates=0"])
    for algo in ("flow_grpo", "dpo", "nft", "vlm_grpo", "vlm_multiturn"):  # one name for the setting
        with pytest.raises(ConfigError, match="unknown config key 'train.max_skipped_updates'"):
            load_config({"algorithm": algo}, ["train.max_skipped_updates=5"])
    for algo in ("flow_grpo", "dpo", "nft", "vlm_grpo", "vlm_multiturn"):
        assert load_config({"algorithm": algo}).reward.on_nonfinite == "error"
        with pytest.raises(ConfigError, match=r"reward.on_nonfinite: expected one of \['error', 'drop_sample'\]"):
            load_config({"algorithm": algo, "reward": {"on_nonfinite": "ignore"}})
