"""Both VLM recipes with ``rollout.engine=vllm`` on vLLM's CPU build: 2 steps, then a resumed run to step 3.

Each step the trainer recomputes the old log-probs of the engine's samples; ``diag/logprob_drift`` (max |trainer -
vLLM| over the sampled tokens) stays at float rounding only if the engine holds the trainer's weights at every
rollout: after the format warm start, after each update, and after a resume (the new engine loaded the base
checkpoint; the checkpoint's weights are sent before the first rollout). vlm_grpo trains every weight including
the vision tower (its fixed eval images are seen again every evaluation: the encoder cache must be reset);
vlm_multiturn trains LoRA on q/v only, token-in/token-out with an image per turn."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

DRIFT_TOL = 1e-4  # vLLM vs the HF forward on the same weights (measured ~1e-6)
VLLM_KW = {"enforce_eager": True, "max_model_len": 512}


def _grpo_cfg(path, out, *overrides):
    from mmrl.config import load_config

    base = {
        "algorithm": "vlm_grpo", "output_dir": str(out), "device": "cpu", "seed": 3,
        "model": {"path": str(path), "lora": {"rank": 0}, "train_vision": True},
        "data": {"kind": "shapes", "template": "{question}", "colors": ["red", "green", "blue", "yellow"],
                 "shape_size": [0.5, 0.7], "eval_size": 4},
        "rollout": {"engine": "vllm", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4,
                    "vllm_kwargs": VLLM_KW},
        "update": {"micro_batch_size": 4}, "algo": {"kl": {"coef": 0.05}, "entropy_coef": 0.01},  # entropy: a gradient even if rewards tie
        "warm_start": {"steps": 2, "batch_size": 4, "lr": 1e-2},
        "log": {"sample_every": 0, "eval_every": 1},
        "train": {"max_steps": 2, "save_every": 1}, "optim": {"lr": 1e-3},
    }
    return load_config(base, list(overrides))


def _check_rows(rows, steps, drift_key="diag/logprob_drift"):
    assert [r["step"] for r in rows] == steps
    for r in rows:
        if r["step"] == 0:
            continue
        assert r[drift_key] <= DRIFT_TOL, (r["step"], r[drift_key])
        assert r["rollout/weight_sync/tensors"] > 0 and r["time/weight_sync_s"] >= 0


def test_vlm_grpo_with_vllm_trains_and_resumes(tiny32, tmp_path, capsys):
    from mmrl.testing import metrics_rows
    from mmrl.vlm import grpo

    out = tmp_path / "run"
    grpo.train(_grpo_cfg(tiny32, out))
    assert (out / "checkpoints/step_2/COMPLETE").is_file()
    assert "eval accuracy before RL" in capsys.readouterr().out
    summary = grpo.train(_grpo_cfg(tiny32, out, "train.max_steps=3"))  # resumes from step 2 (resume=auto)
    assert "eval accuracy before RL" not in capsys.readouterr().out  # resumed, not restarted
    rows = metrics_rows(out)
    _check_rows(rows, [1, 2, 3])
    print("[vllm recipes] vlm_grpo drift per step: " + ", ".join(f"{r['diag/logprob_drift']:.1e}" for r in rows))
    assert any(r["policy/grad_norm"] > 0 for r in rows)  # it trained
    # every tensor: full fine-tuning of the language model and the vision tower
    from safetensors import safe_open

    with safe_open(str(tiny32 / "model.safetensors"), "pt") as f:
        assert rows[-1]["rollout/weight_sync/tensors"] == len(list(f.keys()))
    assert "eval_accuracy_last" in summary


def _mt_cfg(path, out, **train):
    from mmrl.config import load_config

    d = {"algorithm": "vlm_multiturn", "output_dir": str(out), "seed": 0, "device": "cpu", "num_threads": 1,
         "model": {"path": str(path), "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
         "env": {"tasks": {"grid_puzzle": {"width": 5, "max_turns": 2}}, "eval_episodes": 2, "max_workers": 2},
         "rollout": {"engine": "vllm", "prompts_per_step": 2, "group_size": 2, "max_turns": 2, "max_new_tokens": 3,
                     "max_seq_len": 256, "vllm_kwargs": {"enforce_eager": True}},
         # entropy bonus: a gradient even when the tiny policy's returns tie
         "algo": {"advantage": "turn_grpo", "dynamic_sampling": False, "entropy_coef": 0.01}, "optim": {"lr": 0.01},
         "warm_start": {"steps": 1, "batch_size": 4}, "update": {"micro_batch_size": 2, "mini_batch_size": 2},
         "train": {"max_steps": 2, "save_every": 1, **train}}
    return load_config(d)


def test_vlm_multiturn_with_vllm_trains_and_resumes_exactly(tiny32, tmp_path):
    """Per-request seeds make vLLM's sampling a function of (seed, step, request): the interrupted and resumed run
    equals the uninterrupted one (same episodes, same rewards, same adapters)."""
    from safetensors.torch import load_file

    from mmrl.testing import assert_same_path, metrics_rows, without_time
    from mmrl.vlm.multiturn import train

    train(_mt_cfg(tiny32, tmp_path / "a", max_steps=3))
    train(_mt_cfg(tiny32, tmp_path / "b"))
    train(_mt_cfg(tiny32, tmp_path / "b", max_steps=3))  # resumes from step 2
    a, b = metrics_rows(tmp_path / "a"), metrics_rows(tmp_path / "b")
    _check_rows(b, [0, 1, 2, 3])
    print("[vllm recipes] vlm_multiturn drift per step: " + ", ".join(f"{r['diag/logprob_drift']:.1e}" for r in b[1:]))
    assert b[1]["rollout/tokens/env_mean"] > 0 and b[1]["rollout/episode/turns_mean"] >= 1
    assert b[1]["rollout/weight_sync/tensors"] == 2 * 6  # q/k/v weights + biases of the 2 layers (LoRA on q, v)
    # (the interrupted run evaluated at its last step 2: eval/ keys differ there)
    strip = lambda r: {k: v for k, v in without_time(r).items() if not k.startswith("eval/")}  # noqa: E731
    assert_same_path([strip(r) for r in a], [strip(r) for r in b],
                     why="the resumed run replays the same seeded requests and updates on the same kernels")
    wa = load_file(tmp_path / "a/checkpoints/step_3/adapters/default/adapter_model.safetensors")
    wb = load_file(tmp_path / "b/checkpoints/step_3/adapters/default/adapter_model.safetensors")
    assert_same_path(wa, wb, why="same updates on the same kernels")
    assert max(float(v.abs().max()) for k, v in wa.items() if "lora_B" in k) > 1e-3  # the adapters trained


def test_vlm_grpo_with_vllm_in_the_rollout_process(tiny32, tmp_path):
    """`rollout.worker=process` with `rollout.engine=vllm`: the rollout process builds its own vLLM engine and its
    weights follow every push through the weight syncer. At max_staleness 0 every batch is made with the trainer's
    current weights: the trainer's recomputed log-probs equal vLLM's (drift at float rounding) at every step; at
    max_staleness 1 (decoupled PPO with token-level IS weights) the run trains and resumes from its checkpoint with
    the batch in flight saved."""
    from mmrl.testing import metrics_rows
    from mmrl.vlm import grpo

    sync = tmp_path / "k0"
    grpo.train(_grpo_cfg(tiny32, sync, "rollout.worker=process", "rollout.max_staleness=0", "train.max_steps=3",
                         "log.eval_every=0"))
    rows = metrics_rows(sync)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2, 3]
    for r in (r for r in rows if r["step"] > 0):
        assert r["diag/logprob_drift"] <= DRIFT_TOL, (r["step"], r["diag/logprob_drift"])
        assert r["rollout/staleness/max"] == 0
    print("[vllm recipes] rollout process, k=0, drift per step: "
          + ", ".join(f"{r['diag/logprob_drift']:.1e}" for r in rows if r["step"] > 0))
    stale = tmp_path / "k1"
    over = ("rollout.worker=process", "rollout.max_staleness=1", "algo.rollout_correction.is_level=token",
            "log.eval_every=0")
    grpo.train(_grpo_cfg(tiny32, stale, *over))
    grpo.train(_grpo_cfg(tiny32, stale, *over, "train.max_steps=3"))  # resumes from step 2
    rows = [r for r in metrics_rows(stale) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["rollout/staleness/max"] for r in rows) == 1 and any(r["policy/grad_norm"] > 0 for r in rows)


def test_vlm_grpo_with_vllm_on_a_rollout_rank(tiny32, tmp_path):
    """`rollout.worker=ranks` with `rollout.engine=vllm` under torchrun (2 gloo ranks): the rollout rank builds its
    own in-process vLLM engine (it joins no process group of the world, so vLLM makes its own) and its weights follow
    every push over the rank channel. At max_staleness 0 the trainer's recomputed log-probs equal vLLM's (drift at
    float rounding) at every step; at max_staleness 1 the run trains and resumes with the batch in flight saved."""
    from mmrl.config import to_yaml
    from mmrl.testing import metrics_rows, run_torchrun

    def launch(out, *overrides):
        cfg = tmp_path / f"{out.name}.yaml"  # (the test's config as a file: torchrun starts `mmrl train` on it)
        cfg.write_text(to_yaml(_grpo_cfg(tiny32, out, "rollout.worker=ranks", "dist.rollout_ranks=1",
                                         "log.eval_every=0", *overrides)))
        proc = run_torchrun(["-m", "mmrl.cli", "train", str(cfg)], timeout=600)
        assert proc.returncode == 0, proc.stderr[-6000:]
        return [r for r in metrics_rows(out) if r["step"] > 0]

    rows = launch(tmp_path / "k0", "rollout.max_staleness=0", "train.max_steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["diag/logprob_drift"] <= DRIFT_TOL, (r["step"], r["diag/logprob_drift"])
        assert r["rollout/staleness/max"] == 0
    print("[vllm recipes] rollout rank, k=0, drift per step: "
          + ", ".join(f"{r['diag/logprob_drift']:.1e}" for r in rows))
    over = ("rollout.max_staleness=1", "algo.rollout_correction.is_level=token")
    launch(tmp_path / "k1", *over)
    rows = launch(tmp_path / "k1", *over, "train.max_steps=3")  # resumes from step 2
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["rollout/staleness/max"] for r in rows) == 1 and any(r["policy/grad_norm"] > 0 for r in rows)


def test_vlm_grpo_with_vllm_on_glm4v_and_internvl(family_name, family32, tmp_path):
    """GLM-4.1V, InternVL 3 and 3.5: 2 steps of vlm_grpo with LoRA on the decoder and the vision tower; the engine
    holds the trainer's weights at every rollout (drift at float rounding after the warm start and each update)."""
    from mmrl.testing import metrics_rows
    from mmrl.vlm import grpo

    out = tmp_path / "run"
    grpo.train(_grpo_cfg(family32(family_name), out, "model.lora.rank=4", "warm_start.params=[]",
                         "log.eval_every=0"))
    rows = metrics_rows(out)
    _check_rows(rows, [1, 2])
    print(f"[vllm recipes] vlm_grpo {family_name} drift per step: "
          + ", ".join(f"{r['diag/logprob_drift']:.1e}" for r in rows))
    assert any(r["policy/grad_norm"] > 0 for r in rows)
