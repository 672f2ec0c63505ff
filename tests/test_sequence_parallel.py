"""Sequence parallelism (`dist.sequence_parallel`, mmrl.distributed.sequence): on 4 gloo processes (2 data-parallel
groups of 2 processes that split each forward) the forward and backward of a tiny Wan 2.1, Wan 2.2 A14B, Qwen-Image
and FLUX.1 transformer, a Flow-GRPO rollout and one Flow-GRPO update equal one process; `mmrl train` under torchrun
with 2 processes splitting every forward; the one-line refusals. The 4-process part runs this file as a script
(torch.multiprocessing.spawn), as tests/diffusion/test_flow_grpo.py does."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl.testing import assert_close_across_paths, child_env, spawn_ranks

REPO = Path(__file__).resolve().parents[1]
PROMPTS = str(REPO / "assets" / "prompts" / "shapes_train.txt")
FORWARD_CASES = ("wan21", "wan22_a14b", "qwen_image", "flux")  # tiny_cases() names: every supported family
P, G = 2, 2  # Flow-GRPO: prompts, videos per prompt


def _forward_backward(path, ctx):
    """The velocity of a tiny family transformer on 2 fixed rows, and every parameter's gradient of its mean
    square (under sequence parallelism: this process's share)."""
    from mmrl.diffusion.models import load_flow_model
    from mmrl.distributed import sequence

    model = load_flow_model(path, num_frames=5) if "wan" in str(path) else load_flow_model(path)
    # Qwen-Image: 15 text tokens, padded to 16 under the split
    embeds = model.encode_prompts(["a red circle", "a red circle on a blue square background now"])
    x = model.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(1))
    tr = model.transformer
    tr.requires_grad_(True)
    if ctx.sp > 1:
        sequence.apply(tr, ctx, model.family)
    v = model.transformer_velocity(x, torch.tensor([0.95, 0.4]), embeds, 1.0)  # Wan 2.2 A14B: one row per expert
    v.square().mean().backward()
    return v.detach(), {n: p.grad.detach().clone() for n, p in tr.named_parameters() if p.grad is not None}


def _flow_grpo_cfg(path):
    from mmrl.config import load_config

    return load_config({"algorithm": "flow_grpo", "output_dir": "/tmp/unused", "seed": 3,
                        "model": {"path": str(path), "lora": {"rank": 4, "alpha": 8}, "max_sequence_length": 16},
                        "data": {"train_prompts": PROMPTS},
                        "rollout": {"prompts_per_step": P, "height": 32, "width": 32, "num_frames": 5, "num_steps": 3,
                                    "group_size": G, "guidance_scale": 1.0, "timestep_fraction": 0.99},
                        "update": {"micro_batch_size": 2, "mini_batch_size": 0, "max_grad_norm": 0.0},
                        "algo": {"kl": {"coef": 0.04}, "ema": False}, "optim": {"lr": 1e-3},
                        "reward": {"components": {"jpeg_compressibility": 1.0}}, "log": {"sample_every": 0}})


def _flow_grpo_step(path, ctx, strategy="ddp"):
    """A Flow-GRPO rollout of the tiny Wan (fixed noise, the whole batch) and one update with fixed rewards on this
    data-parallel rank's prompts (as test_flow_grpo's equality test) under `strategy`: the trajectory and the LoRA
    weights before and after."""
    from mmrl.core.prompt_stats import PerPromptStatTracker
    from mmrl.diffusion.common import build_policy_states, load_recipe_model
    from mmrl.diffusion.grpo_update import train_on_rollout
    from mmrl.diffusion.loop import TrainingParts
    from mmrl.diffusion.sampling import Trajectory, sample_groups
    from mmrl.diffusion.scoring import global_advantages
    from mmrl.distributed import sequence
    from mmrl.runtime import seed_everything

    cfg = _flow_grpo_cfg(path)
    s = cfg.rollout
    model = load_recipe_model(cfg, torch.device("cpu"), torch.float32)
    seed_everything(0)  # identical LoRA init everywhere
    states = build_policy_states(model, cfg.model, old=False, ref=True)
    initial = ctx.full_state_dict(states.model)
    sequence.apply(states.model, ctx, model.family)
    cfg.dist.strategy = strategy
    model.transformer = ctx.wrap_model(states.model, strategy)
    if strategy == "fsdp":
        states.refresh()  # the sharded parameters
    params = states.trainable_parameters()
    # plain SGD, no clipping: the step is proportional to the gradient, so a gradient off by the group size shows
    opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    prompts_all = [x.strip() for x in Path(PROMPTS).read_text().splitlines()[:P]]
    full = sample_groups(model, model.encode_prompts(prompts_all), G, num_steps=s.num_steps, height=s.height,
                         width=s.width, guidance_scale=s.guidance_scale, noise_level=s.noise_level,
                         timestep_fraction=s.timestep_fraction, generator=torch.Generator().manual_seed(7))
    k = P // ctx.world_size
    pi, rows = torch.arange(ctx.rank * k, (ctx.rank + 1) * k), torch.arange(ctx.rank * k * G, (ctx.rank + 1) * k * G)
    traj = Trajectory(latents=full.latents[rows], log_probs=full.log_probs[rows], sigmas=full.sigmas,
                      sde_mask=full.sde_mask, train_steps=full.train_steps,
                      prompt_index=full.prompt_index[rows] - ctx.rank * k, embeds=full.embeds.select(pi))
    scores = torch.tensor([0.1, 0.9, 2.0, -1.0])[rows]
    prompts = [prompts_all[i] for i in full.prompt_index[rows].tolist()]
    adv, keep, _ = global_advantages(ctx, PerPromptStatTracker("group"), prompts, scores, cfg.algo.adv_clip_max, True)
    torch.manual_seed(100)
    out = train_on_rollout(TrainingParts(cfg, ctx, model, states, opt, sched, params), 0, traj, adv, keep)
    return {"latents": full.latents, "log_probs": full.log_probs, "loss": out["policy/loss"],
            "params": ctx.full_state_dict(states.model), "initial": initial}


def _worker(ctx, paths, out_dir):
    from mmrl.distributed.sequence import data_parallel_view

    view = data_parallel_view(ctx, 2)
    res = {"view": (view.rank, view.world_size, view.is_main, view.processes)}
    res["forward"] = {case: _forward_backward(p, view) for case, p in paths.items()}
    res["step"] = {strategy: _flow_grpo_step(paths["wan21"], view, strategy) for strategy in ("ddp", "fsdp")}
    torch.save(res, Path(out_dir) / f"rank{ctx.rank}.pt")


@pytest.fixture(scope="module")
def mesh_2x2(tmp_path_factory):
    """4 gloo processes: 2 data-parallel groups (DDP over all 4) of 2 processes splitting each forward."""
    from mmrl.diffusion.models import tiny_cases

    out = tmp_path_factory.mktemp("sp")
    cases = tiny_cases()
    paths = {c: str(cases[c].build_at(out / c)) for c in FORWARD_CASES}
    return paths, _spawn(paths, out, 4)


def _spawn(paths, out, world):
    proc = subprocess.run([sys.executable, __file__, repr(paths), str(out), str(world)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{world}-rank run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_split_forward_and_backward_equal_one_process(mesh_2x2, case):
    from mmrl.distributed import DistContext

    paths, ranks = mesh_2x2
    v1, g1 = _forward_backward(paths[case], DistContext())
    for r in ranks:  # every process ends with the whole output (gathered after proj_out)
        assert_close_across_paths(r["forward"][case][0], v1, what=f"{case}: velocity, 2-way split vs 1 process")
    for a, b in ((0, 1), (2, 3)):  # each group's 2 gradient shares sum to the whole gradient
        ga, gb = ranks[a]["forward"][case][1], ranks[b]["forward"][case][1]
        assert set(ga) == set(gb) == set(g1)
        assert_close_across_paths({n: ga[n] + gb[n] for n in g1}, g1,
                                  what=f"{case}: gradients, sum of the 2 shares vs 1 process")
    # a share is a real part, not the whole gradient
    name = max(g1, key=lambda n: g1[n].abs().max().item())
    assert (ranks[0]["forward"][case][1][name] - g1[name]).abs().max() > 1e-4 * g1[name].abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_flow_grpo_rollout_and_update_equal_one_process(mesh_2x2, strategy):
    """Each group rolls out the whole batch (its forwards split in 2) and trains on its prompt; DDP (or FSDP2) over
    the 4 processes with the loss scaled by the group size gives the one-process update on both prompts."""
    from mmrl.distributed import DistContext

    paths, ranks = mesh_2x2
    assert [r["view"] for r in ranks] == [(0, 2, True, 4), (0, 2, False, 4), (1, 2, False, 4), (1, 2, False, 4)]
    one = _flow_grpo_step(paths["wan21"], DistContext())
    for r in ranks:
        s = r["step"][strategy]
        assert_close_across_paths(s["latents"], one["latents"], what="rollout latents, 2 x 2 vs 1 process")
        assert_close_across_paths(s["log_probs"], one["log_probs"], what="rollout log-probs, 2 x 2 vs 1 process")
        assert_close_across_paths(s["params"], one["params"], what="LoRA weights after one update, 2 x 2")
    moved = max((p - one["initial"][k]).abs().max().item() for k, p in one["params"].items())
    assert moved > 1e-3  # the update is not trivially zero


@pytest.mark.slow
def test_torchrun_cli_flow_grpo_wan_split_over_two_processes(tmp_path, tiny_wan_path):
    """`mmrl train` under torchrun with dist.sequence_parallel=2: one data-parallel group of 2 processes runs the
    whole step (rollout, update, held-out evaluation, sample grid, checkpoint) with every Wan forward split."""
    import json

    from mmrl.testing import run_torchrun

    out = tmp_path / "run"
    proc = run_torchrun(["-m", "mmrl.cli", "train", "configs/diffusion/flow_grpo_wan_tiny.yaml",
                         f"model.path={tiny_wan_path}", f"output_dir={out}", "train.max_steps=1",
                         "train.save_every=1", "log.eval_every=1", "log.sample_every=1", "log.eval_max_prompts=2",
                         "dist.sequence_parallel=2"], cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    assert "[mmrl] dist.strategy: auto -> ddp (2 processes launched)" in proc.stdout
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["train/updates"] == 1 and row["policy/grad_norm"] > 0 and "eval/reward/mean" in row
    assert (out / "checkpoints" / "step_1" / "COMPLETE").is_file()
    assert (out / "samples" / "step_000001.mp4").is_file()


# ------------------------------------------------------------------------------------------------ refusals


def test_heads_not_divisible_is_one_line(tiny_wan):
    from mmrl.distributed.sequence import check_model

    with pytest.raises(ValueError) as e:
        check_model(tiny_wan.transformer, 4, "wan")
    assert str(e.value) == ("dist.sequence_parallel=4: wan's transformer has 2 attention heads, not divisible by 4 "
                            "(each process takes heads / 4); use a divisor of 2")
    with pytest.raises(ValueError, match=r"^dist.sequence_parallel=2: family 'sd3' is not supported \(supported: "
                                         r"wan, qwen_image, flux\); set dist.sequence_parallel=1$"):
        check_model(tiny_wan.transformer, 2, "sd3")


def test_tokens_not_divisible_are_one_line_and_qwen_text_is_padded():
    from mmrl.distributed.sequence import _token_check

    wan = _token_check(2, "wan", (1, 2, 2))
    with pytest.raises(ValueError) as e:  # 1 x (2 / 2) x (6 / 2) = 3 video tokens
        wan(None, (), {"hidden_states": torch.zeros(1, 16, 1, 2, 6)})
    assert str(e.value) == ("dist.sequence_parallel=2: this wan forward has 3 image/video tokens, not divisible by 2; "
                            "choose rollout.height/width/num_frames (or model.max_sequence_length) so that it is")
    with pytest.raises(ValueError, match=r"this flux forward has 5 text tokens, not divisible by 2"):
        _token_check(2, "flux", None)(None, (), {"hidden_states": torch.zeros(1, 4, 8),
                                                "encoder_hidden_states": torch.zeros(1, 5, 8)})
    texts, mask = torch.ones(2, 5, 3), torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    _, kw = _token_check(4, "qwen_image", None)(None, (), {"hidden_states": torch.zeros(2, 8, 4),
                                                          "encoder_hidden_states": texts,
                                                          "encoder_hidden_states_mask": mask})
    assert kw["encoder_hidden_states"].shape == (2, 8, 3) and torch.equal(kw["encoder_hidden_states"][:, :5], texts)
    assert kw["encoder_hidden_states_mask"].tolist() == [[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]


def test_config_and_layout_checks():
    from mmrl.distributed import DistConfig
    from mmrl.distributed.sequence import check_layout, check_recipe

    with pytest.raises(ValueError, match=r"^dist.sequence_parallel: expected an integer >= 1, got 0$"):
        DistConfig(sequence_parallel=0)
    with pytest.raises(ValueError, match=r"^dist.sequence_parallel=2: the number of processes \(3\) must be "
                                         r"divisible by it"):
        check_layout(2, 3)
    cfg = _flow_grpo_cfg("unused")
    cfg.dist.sequence_parallel, cfg.rollout.worker = 2, "process"
    with pytest.raises(ValueError, match=r"^dist.sequence_parallel=2 with rollout.worker=process is not supported"):
        check_recipe(cfg, 2)
    cfg.rollout.worker = "ranks"  # the rollout rank is outside the groups too
    with pytest.raises(ValueError, match=r"^dist.sequence_parallel=2 with rollout.worker=ranks is not supported: "
                                         r"the rollout rank has no process group"):
        check_recipe(cfg, 2)
    cfg.rollout.worker, cfg.algorithm = "inline", "nft"
    with pytest.raises(ValueError, match=r"^dist.sequence_parallel=2: recipe 'nft' is not supported \(supported: "
                                         r"flow_grpo\); set dist.sequence_parallel=1$"):
        check_recipe(cfg, 2)


def test_mfu_counts_every_process_of_a_group(monkeypatch):
    """A group's split forward is metered once (on its whole inputs) but runs on all its processes' devices: MFU
    divides by every process's peak, not by the data-parallel ranks' only."""
    from types import SimpleNamespace

    from mmrl.perf import meter

    model = torch.nn.Linear(2, 2)
    setattr(model, meter._METER_ATTR, SimpleNamespace(pop=lambda: 1e12))
    monkeypatch.setenv("MMRL_PEAK_TFLOPS", "1")
    ctx = SimpleNamespace(enabled=False, world_size=1, processes=2)  # one group of 2 processes
    assert meter.perf_metrics(ctx, model, 0.5, "cpu")["perf/mfu"] == pytest.approx(1.0)  # 1 TFLOP / 0.5 s / 2 x 1


@pytest.fixture(scope="module")
def tiny_wan_path(tmp_path_factory):
    from mmrl.diffusion.models import tiny_cases

    return tiny_cases()["wan21"].build_at(tmp_path_factory.mktemp("wan") / "pipe")


@pytest.fixture(scope="module")
def tiny_wan(tiny_wan_path):
    from mmrl.diffusion.models import load_flow_model

    return load_flow_model(tiny_wan_path, num_frames=5)


if __name__ == "__main__":
    import ast

    spawn_ranks(_worker, ast.literal_eval(sys.argv[1]), sys.argv[2], world=int(sys.argv[3]))
