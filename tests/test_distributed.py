"""mmrl.distributed on 2 real CPU processes (gloo).

One fixture runs this file as a script, which starts 2 ranks with ``torch.multiprocessing.spawn``
(MASTER_ADDR=127.0.0.1, a free port). Each rank runs every distributed check once and saves its results;
the tests below compare them with single-process computations done here:

* all_gather_tensor with uneven first dims (3 and 5 rows) + local_slice;
* gather_group_rewards -> group_advantages -> local_slice equals group_advantages on the whole batch,
  for a group split across ranks (scope="global") and for per-rank ids (scope="rank");
* shard determinism (even and padded);
* ONE AdamW step of a tiny SD3 transformer with a PolicyStates LoRA, loss = core clipped_policy_loss of
  Flow-GRPO SDE-step log-probs with group advantages from all-gathered rewards, uneven local batches
  (4 + 2, rank 0 accumulating 2 micro-batches under no_sync; and 6 + 0, rank 1 joining with a zero-weight
  micro-batch) under DDP, and (3 + 3) under FSDP2:
  parameters equal the single-process step on the combined batch of 6;
* rank 0 alone writes the checkpoint; a later 1-process run resumes from it exactly.
A second test runs ``torchrun --standalone --nproc_per_node 2 -m mmrl.distributed`` (the self-check).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from mmrl.config import RunConfig
from mmrl.distributed import DistConfig
from mmrl.testing import assert_close_across_paths, child_env, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
N, C, H = 6, 4, 8  # global batch, latent channels, latent side
GROUPS = [0, 0, 0, 1, 1, 1]  # group 1 spans rank 0 (row 3) and rank 1 (rows 4-5) in the DDP split
DDP_SPLIT = [4, 2]
FSDP_SPLIT = [3, 3]
LR = 1e-3  # Adam's first step is ~lr * sign(g): param differences scale with lr


# ---------------------------------------------------------------------------------------------- shared model code


def build_policy(seed: int = 0):
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates

    torch.manual_seed(seed)
    tr = SD3Transformer2DModel(sample_size=H, patch_size=2, in_channels=C, num_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                               pooled_projection_dim=32, out_channels=C, pos_embed_max_size=32).eval()
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                     target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    torch.manual_seed(seed + 1)
    return PolicyStates(tr, cfg)


def global_batch():
    """Fixed inputs every process builds identically: latents, sigmas, prompt embeddings, SDE noise."""
    g = torch.Generator().manual_seed(1234)
    return {"x": torch.randn(N, C, H, H, generator=g), "enc": torch.randn(N, 5, 32, generator=g),
            "pooled": torch.randn(N, 32, generator=g), "noise": torch.randn(N, C, H, H, generator=g),
            "sigma": torch.full((N,), 0.8), "sigma_next": torch.full((N,), 0.6)}


def step_logprob(model, b, rows, x_next=None):
    from mmrl.diffusion.sde import sde_step_with_logprob

    v = model(hidden_states=b["x"][rows], encoder_hidden_states=b["enc"][rows], pooled_projections=b["pooled"][rows],
              timestep=b["sigma"][rows] * 1000).sample
    return sde_step_with_logprob(b["x"][rows], v, b["sigma"][rows], b["sigma_next"][rows], noise_level=0.7,
                                 prev_sample=x_next, noise=b["noise"][rows] if x_next is None else None)


def rollout(model, b, rows):
    with torch.no_grad():
        out = step_logprob(model, b, rows)
    reward = -out.prev_sample.mean(dim=(1, 2, 3))  # a latent statistic (CALIBRATION.md: decoded pixels are flat)
    return out.prev_sample, out.log_prob, reward


def train_loss(model, b, rows, x_next, old_lp, adv):
    from mmrl.core.losses import clipped_policy_loss

    cur = step_logprob(model, b, rows, x_next)
    loss, _ = clipped_policy_loss(cur.log_prob, old_lp, adv, clip_low=0.2, clip_high=0.2)
    return loss


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=1e-4)


# ---------------------------------------------------------------------------------------------- the 2 ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy_step(ctx, strategy: str, split: list[int], micro: int):
    """One distributed RL step; returns (trainable params after the step, grads before it, optimizer, states, info).

    A rank whose share is empty still joins the gradient all-reduce with one zero-weight micro-batch (the
    pattern README_SCALE.md gives the recipes)."""
    from mmrl.core.advantages import group_advantages

    states = build_policy()
    b = global_batch()
    start = sum(split[:ctx.rank])
    rows = torch.arange(start, start + split[ctx.rank])
    model = ctx.wrap_model(states.model, strategy)
    # DDP keeps the parameter objects: PolicyStates' list (its order is what checkpoints rely on). FSDP2
    # replaces them with sharded DTensors: collect after wrapping.
    params = states.trainable_parameters() if strategy != "fsdp" else [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params)
    if len(rows):
        x_next, old_lp, reward = rollout(model, b, rows)
    else:
        reward = torch.zeros(0)
    r_all, g_all = ctx.gather_group_rewards(reward, torch.tensor(GROUPS)[rows])
    adv = ctx.local_slice(group_advantages(r_all, g_all))
    scale = ctx.loss_scale(len(rows))
    chunks = torch.split(torch.arange(len(rows)), micro)
    if len(rows) == 0:  # idle rank: a zero-weight micro-batch on any row keeps the all-reduce paired
        rows, chunks, scale = torch.tensor([0]), (torch.tensor([0]),), 0.0
        x_next, old_lp, _ = rollout(model, b, rows)
        adv = torch.zeros(1)
    for i, c in enumerate(chunks):
        with ctx.no_sync(model, sync=i == len(chunks) - 1):
            loss = train_loss(model, b, rows[c], x_next[c], old_lp[c], adv[c])
            (loss * len(c) / len(rows) * scale).backward()
    grads = {}
    inner = ctx.unwrap(model)
    for name, p in inner.named_parameters():
        if p.requires_grad:
            gr = p.grad
            grads[name] = (gr.full_tensor() if hasattr(gr, "full_tensor") else gr).detach().clone()
    ctx.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ctx.full_state_dict(model), grads, opt, states, {"r_all": r_all, "adv_local": adv}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MMRL_NO_PROGRESS="1")
    torch.set_num_threads(1)
    from mmrl.config import RunConfig
    from mmrl.core.advantages import group_advantages
    from mmrl.distributed import DistContext
    from mmrl.run.directory import Run

    ctx = DistContext.init("auto")
    res: dict = {"rank": ctx.rank, "world_size": ctx.world_size, "device": str(ctx.device), "backend": ctx.backend}

    # uneven gather: rank r holds 3 + 2r rows
    local = torch.arange((3 + 2 * rank) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    res["gathered"] = ctx.all_gather_tensor(local)
    res["gather_sizes"] = list(ctx.last_gather_sizes)
    res["slice_back"] = torch.equal(ctx.local_slice(res["gathered"]), local)
    res["objects"] = ctx.all_gather_object(("r", rank))
    res["broadcast"] = ctx.broadcast_object({"from": rank})
    res["mean"] = ctx.all_reduce_mean(torch.tensor([float(rank), 2.0 * rank]))

    # rewards split 5 + 3, group 1 spans both ranks
    rewards = torch.tensor([0.1, 0.9, 0.4, 2.0, -1.0, 0.5, 0.3, 1.7])
    gids = torch.tensor([7, 7, 7, 3, 3, 3, 9, 9])
    rows = slice(0, 5) if rank == 0 else slice(5, 8)
    r_all, g_all = ctx.gather_group_rewards(rewards[rows], gids[rows])
    res["rewards_all"], res["gids_all"] = r_all, g_all
    res["adv_local"] = ctx.local_slice(group_advantages(r_all, g_all))
    # scope="rank": local ids 0/1 on each rank
    r_loc = torch.tensor([1.0, 2.0, 3.0, 5.0]) + rank
    g_loc = torch.tensor([0, 0, 1, 1])
    r2, g2 = ctx.gather_group_rewards(r_loc, g_loc, scope="rank")
    res["rank_scope_gids"] = g2
    res["rank_scope_adv"] = ctx.local_slice(group_advantages(r2, g2))

    res["shard_even"] = ctx.shard(list(range(8)))
    res["shard_pad"] = ctx.shard(list("abcde"), pad=True)
    try:
        ctx.shard(list(range(5)))
        res["shard_error"] = None
    except ValueError as e:
        res["shard_error"] = str(e)
    res["loss_scale"] = ctx.loss_scale(4 if rank == 0 else 2)
    res["max_int"] = ctx.max_int(3 + 4 * rank)
    res["any_rank"] = (ctx.any_rank(rank == 1), ctx.any_rank(False))

    # DDP step, uneven 4 + 2, rank 0 accumulates 2 micro-batches
    t0 = time.perf_counter()
    params, grads, opt, states, info = _policy_step(ctx, "ddp", DDP_SPLIT, micro=2)
    res["ddp_params"], res["ddp_grads"], res["ddp_info"] = params, grads, info
    res["ddp_s"] = time.perf_counter() - t0

    # rank-0-only checkpoint of the DDP result, other ranks wait
    cfg = RunConfig(algorithm="test", output_dir=str(Path(out) / "run"))
    run = Run(cfg) if ctx.is_main else None
    with ctx.checkpoint(run, 1) as d:
        res["ckpt_dir_given"] = d is not None
        if d is not None:
            states.save(Path(d) / "adapters")
            Run.save_state(d, optimizer=opt.state_dict(), data={"index": N})
    res["ckpt_complete_after_barrier"] = (Path(out) / "run" / "checkpoints" / "step_1" / "COMPLETE").is_file()

    # DDP step where rank 1 has nothing (6 + 0): it contributes a zero-weight micro-batch
    params, grads, _, _, _ = _policy_step(ctx, "ddp", [6, 0], micro=3)
    res["idle_params"], res["idle_grads"] = params, grads

    # FSDP2 step, 3 + 3 (FSDP needs the same number of forwards on every rank)
    t0 = time.perf_counter()
    params, grads, _, _, _ = _policy_step(ctx, "fsdp", FSDP_SPLIT, micro=3)
    res["fsdp_params"], res["fsdp_grads"] = params, grads
    res["fsdp_s"] = time.perf_counter() - t0

    torch.save(res, Path(out) / f"rank{rank}.pt")
    ctx.barrier()
    ctx.close()


# ---------------------------------------------------------------------------------------------- single process


def _single_process_step():
    from mmrl.core.advantages import group_advantages

    states = build_policy()
    b = global_batch()
    rows = torch.arange(N)
    params = states.trainable_parameters()
    opt = make_optimizer(params)
    x_next, old_lp, reward = rollout(states.model, b, rows)
    adv = group_advantages(reward, torch.tensor(GROUPS))
    train_loss(states.model, b, rows, x_next, old_lp, adv).backward()
    names = {id(p): n for n, p in states.model.named_parameters()}
    grads = {names[id(p)]: p.grad.detach().clone() for p in params}
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    after = {names[id(p)]: p.detach().clone() for p in params}
    return after, grads, opt, reward, adv


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    t0 = time.perf_counter()
    env = child_env()
    proc = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, f"2-rank run failed:\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    print(f"[test_distributed] 2-rank spawn wall {wall:.1f}s; ddp step {res[0]['ddp_s']:.2f}s, "
          f"fsdp step {res[0]['fsdp_s']:.2f}s")
    return out, res


@pytest.fixture(scope="module")
def single():
    torch.manual_seed(0)
    return _single_process_step()


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_context_basics(two_ranks):
    _, res = two_ranks
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu" for r in res)
    assert res[0]["objects"] == res[1]["objects"] == [("r", 0), ("r", 1)]
    assert res[0]["broadcast"] == res[1]["broadcast"] == {"from": 0}
    assert res[0]["max_int"] == res[1]["max_int"] == 7
    assert res[0]["any_rank"] == res[1]["any_rank"] == (True, False)
    for r in res:
        assert torch.equal(r["mean"], torch.tensor([0.5, 1.0], dtype=r["mean"].dtype))


@pytest.mark.slow
def test_all_gather_tensor_uneven(two_ranks):
    _, res = two_ranks
    expected = torch.cat([torch.arange(6.0).view(3, 2), torch.arange(10.0).view(5, 2) + 100])
    for r in res:
        assert r["gather_sizes"] == [3, 5]
        assert torch.equal(r["gathered"], expected)
        assert r["slice_back"]


@pytest.mark.slow
def test_gather_group_rewards_gives_global_advantages(two_ranks):
    from mmrl.core.advantages import group_advantages

    _, res = two_ranks
    rewards = torch.tensor([0.1, 0.9, 0.4, 2.0, -1.0, 0.5, 0.3, 1.7])
    gids = torch.tensor([7, 7, 7, 3, 3, 3, 9, 9])
    for r in res:
        assert torch.equal(r["rewards_all"], rewards) and torch.equal(r["gids_all"], gids)
    full = group_advantages(rewards, gids)
    assert_close_across_paths(torch.cat([res[0]["adv_local"], res[1]["adv_local"]]), full, what="2 processes vs 1")
    # group 3 = rewards [2.0, -1.0, 0.5] split 2 + 1 over the ranks: mean 0.5, std 1.5 (hand-computed)
    assert res[0]["adv_local"][3].item() == pytest.approx((2.0 - 0.5) / (1.5 + 1e-6), abs=1e-6)
    assert res[1]["adv_local"][0].item() == 0.0
    # rank 0 normalising alone would see [2.0, -1.0]: mean 0.5, std 2.1213 -> 0.7071 instead of 1.0
    local_only = group_advantages(rewards[:5], gids[:5])[3]
    assert local_only.item() == pytest.approx(1.5 / (4.5 ** 0.5 + 1e-6), abs=1e-6)


@pytest.mark.slow
def test_gather_group_rewards_rank_scope(two_ranks):
    from mmrl.core.advantages import group_advantages

    _, res = two_ranks
    assert torch.equal(res[0]["rank_scope_gids"], torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    r_all = torch.tensor([1.0, 2.0, 3.0, 5.0, 2.0, 3.0, 4.0, 6.0])
    full = group_advantages(r_all, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    assert_close_across_paths(torch.cat([res[0]["rank_scope_adv"], res[1]["rank_scope_adv"]]), full,
                              what="2 processes vs 1")


@pytest.mark.slow
def test_shard_is_contiguous_and_deterministic(two_ranks):
    from mmrl.distributed import DistContext

    _, res = two_ranks
    assert res[0]["shard_even"] == [0, 1, 2, 3] and res[1]["shard_even"] == [4, 5, 6, 7]
    assert res[0]["shard_pad"] == (["a", "b", "c"], [True, True, True])
    assert res[1]["shard_pad"] == (["d", "e", "e"], [True, True, False])
    assert "cannot be split evenly over 2 ranks" in res[0]["shard_error"]
    # the same rule evaluated without processes (rank/world given) gives the same slices
    for rank in range(2):
        ctx = DistContext(rank=rank, world_size=2)
        assert ctx.shard(list(range(8))) == res[rank]["shard_even"]
    # loss_scale: world * n_local / n_global = 2 * 4 / 6 and 2 * 2 / 6
    assert res[0]["loss_scale"] == pytest.approx(8 / 6) and res[1]["loss_scale"] == pytest.approx(4 / 6)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_ddp_step_equals_single_process_step(two_ranks, single):
    _, res = two_ranks
    after, grads, _, reward, adv = single
    torch.testing.assert_close(res[0]["ddp_info"]["r_all"], reward, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([res[0]["ddp_info"]["adv_local"], res[1]["ddp_info"]["adv_local"]]), adv,
                               rtol=0, atol=1e-6)
    g = max(v.abs().max().item() for v in grads.values())
    assert g > 1e-4  # the step is not trivially zero
    for r in res:
        dg, dp = _max_diff(r["ddp_grads"], grads), _max_diff(r["ddp_params"], after)
        print(f"[ddp rank {r['rank']}] max |grad diff| {dg:.2e} (max |grad| {g:.2e}), max |param diff| {dp:.2e}")
        assert dg < 1e-5 * g  # fp32 summation order (DDP buckets, FSDP reduce-scatter)
        assert dp < 1e-6


@pytest.mark.slow
def test_ddp_step_with_an_idle_rank_equals_single_process_step(two_ranks, single):
    _, res = two_ranks
    after, grads, *_ = single
    g = max(v.abs().max().item() for v in grads.values())
    for r in res:
        dg, dp = _max_diff(r["idle_grads"], grads), _max_diff(r["idle_params"], after)
        print(f"[ddp 6+0 rank {r['rank']}] max |grad diff| {dg:.2e}, max |param diff| {dp:.2e}")
        assert dg < 1e-5 * g
        assert dp < 1e-6


@pytest.mark.slow
def test_fsdp_step_equals_single_process_step(two_ranks, single):
    _, res = two_ranks
    after, grads, *_ = single
    g = max(v.abs().max().item() for v in grads.values())
    for r in res:
        dg, dp = _max_diff(r["fsdp_grads"], grads), _max_diff(r["fsdp_params"], after)
        print(f"[fsdp rank {r['rank']}] max |grad diff| {dg:.2e} (max |grad| {g:.2e}), max |param diff| {dp:.2e}")
        assert dg < 1e-5 * g  # fp32 summation order (DDP buckets, FSDP reduce-scatter)
        assert dp < 1e-6


@pytest.mark.slow
def test_rank0_checkpoint_and_single_process_resume(two_ranks, single):
    from mmrl.run.directory import Run
    from mmrl.run.files import list_checkpoints

    out, res = two_ranks
    assert res[0]["ckpt_dir_given"] and not res[1]["ckpt_dir_given"]
    assert res[0]["ckpt_complete_after_barrier"] and res[1]["ckpt_complete_after_barrier"]
    ckpts = list_checkpoints(out / "run" / "checkpoints")
    assert [s for s, _ in ckpts] == [1]
    assert not list((out / "run" / "checkpoints").glob(".tmp-*"))
    # resume in ONE process: adapters + optimizer + data position
    states = build_policy(seed=5)  # different init: everything must come from the checkpoint
    states.load(ckpts[0][1] / "adapters")
    opt = make_optimizer(states.trainable_parameters())
    state = Run.load_state(ckpts[0][1])
    opt.load_state_dict(state["optimizer"])
    assert state["data"] == {"index": N}
    names = {id(p): n for n, p in states.model.named_parameters()}
    loaded = {names[id(p)]: p.detach() for p in states.trainable_parameters()}
    assert _max_diff(loaded, res[0]["ddp_params"]) == 0.0
    after, _, opt_single, *_ = single
    assert _max_diff(loaded, after) < 1e-6
    # optimizer moments equal the single-process run's (same parameter order)
    for p_ckpt, p_single in zip(opt.param_groups[0]["params"], opt_single.param_groups[0]["params"]):
        s1, s2 = opt.state[p_ckpt], opt_single.state[p_single]
        assert float(s1["step"]) == float(s2["step"]) == 1.0
        torch.testing.assert_close(s1["exp_avg"], s2["exp_avg"], rtol=0, atol=1e-7)


def test_single_process_context_is_identity(monkeypatch):
    from mmrl.distributed import DistConfig, DistContext, rank_seed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = DistContext.init("auto", device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.enabled, ctx.device.type) == (0, 1, True, False, "cpu")
    t = torch.arange(5.0)
    assert ctx.all_gather_tensor(t) is t and ctx.last_gather_sizes == [5]
    assert torch.equal(ctx.local_slice(t * 2), t * 2)
    r, g = ctx.gather_group_rewards(t, torch.tensor([0, 0, 1, 1, 1]))
    assert torch.equal(r, t)
    assert ctx.shard([1, 2, 3]) == [1, 2, 3] and ctx.loss_scale(7) == 1.0
    m = torch.nn.Linear(2, 2)
    assert ctx.wrap_model(m, "ddp") is m and ctx.wrap_model(m, "fsdp") is m
    with ctx.no_sync(m), ctx.main_process_first():
        pass
    assert ctx.all_gather_object("x") == ["x"] and ctx.broadcast_object(3) == 3
    assert ctx.max_int(4) == 4 and ctx.any_rank(True) and not ctx.any_rank(False)
    assert rank_seed(0, 0, 0) != rank_seed(0, 1, 0) != rank_seed(0, 0, 1)
    assert ctx.rank_seed(3, 2) == rank_seed(3, 0, 2)
    with pytest.raises(ValueError, match="dist.strategy"):
        DistConfig(strategy="zero3")
    with pytest.raises(ValueError, match="dist.backend"):
        DistContext.init("mpi")
    with pytest.raises(ValueError, match="scope"):
        ctx.gather_group_rewards(t, t.long(), scope="node")


@dataclass
class _RecipeCfg(RunConfig):
    dist: DistConfig = field(default_factory=DistConfig)
    """Multi-process training."""


def test_dist_config_embeds_in_a_recipe_config():
    from mmrl.config import apply_overrides, field_docs, from_dict, to_yaml

    Cfg = _RecipeCfg
    cfg = from_dict(Cfg, {"dist": {"strategy": "ddp", "find_unused_parameters": True}})
    assert cfg.dist.strategy == "ddp" and cfg.dist.backend == "auto"
    apply_overrides(cfg, ["dist.backend=gloo"])
    assert cfg.dist.backend == "gloo"
    assert set(field_docs(DistConfig)) == {"strategy", "backend", "find_unused_parameters", "checkpoint",
                                           "sequence_parallel", "rollout_ranks"}
    assert "# torch.distributed backend" in to_yaml(cfg)
    with pytest.raises(ValueError, match="dist.strategy"):
        from_dict(Cfg, {"dist": {"strategy": "deepspeed"}})
    with pytest.raises(ValueError, match=r"dist.checkpoint: expected one of \['auto', 'sharded', 'full'\], got 'dcp'"):
        from_dict(Cfg, {"dist": {"checkpoint": "dcp"}})
    # sharded by default only under FSDP with several processes; explicit values hold everywhere
    assert [DistConfig(strategy=s).sharded_checkpoints(w) for s, w in (("fsdp", 2), ("fsdp", 1), ("ddp", 2))] == \
        [True, False, False]
    assert DistConfig(checkpoint="sharded").sharded_checkpoints(1) and not DistConfig(
        strategy="fsdp", checkpoint="full").sharded_checkpoints(4)


@pytest.mark.skipif(not (Path(sys.executable).parent / "torchrun").exists(), reason="torchrun not in the venv")
def test_torchrun_two_processes(tmp_path):
    env = child_env()
    t0 = time.perf_counter()
    proc = run_torchrun(["-m", "mmrl.distributed"], cwd=ROOT, env=env, timeout=120)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("MMRL_DIST_CHECK "))
    out = json.loads(line.split(" ", 1)[1])
    print(f"[test_distributed] torchrun 2 procs wall {wall:.1f}s")
    assert out["world_size"] == 2 and out["backend"] == "gloo"
    assert out["gather_sizes"] == [1, 2] and out["gather_rows"] == [0.0, 1.0, 1.0]
    assert out["local_slice_ok"] and out["rank_mean"] == 0.5 and out["shard"] == [0, 1]
    assert out["objects"] == [{"rank": 0}, {"rank": 1}]
    # LockstepForwards on an FSDP2 model: rank 0 runs 1 real forward, rank 1 runs 3; rank 0 pairs the extra 2 with
    # dummies, so both ran 3 forwards (a hang or a collective mismatch would fail the launch) and outputs are exact
    assert out["lockstep_all"] == [[1, 2, True], [3, 0, True]]
    # plain-c10d gather of uneven Shard(0) DTensors is exact; clip_grad_norm on FSDP2 gradients = torch's on one copy
    assert out["full_tensor_exact"] is True
    got, want = out["clip_norm"]
    assert want > 0.5 and abs(got - want) <= 1e-5 * want, (got, want)  # the norm exceeds 0.5: clipping happened
    assert out["clip_grads_close"] is True


# ---------------------------------------------------------------------------------------------- script entry


if __name__ == "__main__":
    out_dir = sys.argv[1]
    if os.path.isdir(out_dir):
        for f in Path(out_dir).glob("rank*.pt"):
            f.unlink()
        shutil.rmtree(Path(out_dir) / "run", ignore_errors=True)
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
