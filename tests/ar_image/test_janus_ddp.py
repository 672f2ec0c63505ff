"""janus_grpo on 2 CPU processes over gloo (torchrun, DDP with LoRA).

* With rollouts made rank-independent (each prompt's images drawn from a stream of (sampler position, prompt ids),
  whichever rank draws them), 2 ranks give the one-process run's metrics rows within float tolerance: the same
  global prompts, advantages of the all-gathered rewards, DDP's average = the global batch's gradient, metrics
  reduced over the ranks. (Unpatched, each rank samples from its own (seed, rank, step) stream, as every recipe.)
* 2 ranks stopped at a checkpoint and resumed equal the uninterrupted 2-rank run (rank 0 alone logs and writes).
* The one-line refusals: FSDP, rollout ranks, a prompt count the ranks cannot split.

Run as a script (`torchrun ... this_file KEY=VALUE ...`): the tiny recipe with the rank-independent rollouts.
"""

from __future__ import annotations

import re
import sys
import zlib
from pathlib import Path

import pytest
import torch

from mmrl.testing import RESUMED_RUN, assert_close_across_paths, assert_same_path, metrics_rows, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
DROP = ("time/", "perf/")  # wall clock; FLOPs are counted per process


def _args(path, out, *extra):
    return [f"model.path={path}", "model.lora.rank=4", "model.lora.alpha=8",
            f"output_dir={out}", "device=cpu", "seed=2", "rollout.prompts_per_step=4", "rollout.group_size=3",
            "optim.lr=3e-2", "update.micro_batch_size=16",
            "algo.kl.coef=0.1", "log.sample_every=0", "train.max_steps=2", "train.save_every=1",
            "dist.backend=gloo", *extra]


def _rows(out):
    return [{k: v for k, v in r.items() if not k.startswith(DROP)} for r in metrics_rows(out)]


def _fixed_rollouts() -> None:
    """Training rollouts drawn from a generator seeded by (the sampler's position at the step's draw, the prompt):
    the same samples of a prompt in one process and on whichever rank holds it (crc32: str hashes differ by process)."""
    from mmrl.ar_image.cot import SemanticCoT
    from mmrl.ar_image.janus import JanusPolicy
    from mmrl.pipelines.data import PromptSampler

    where = [0]
    draw, sample, cot_rollout = PromptSampler.next, JanusPolicy.sample, SemanticCoT.rollout

    def next_(self, n):
        where[0] = self.epoch * 1_000_003 + self.index
        return draw(self, n)

    def sample_(self, ids, n, generator=None, attention_mask=None):
        if generator is None:  # the training rollout (grids and evaluation bring their own)
            generator = torch.Generator().manual_seed(where[0] * 1_000_003 + zlib.crc32(ids.cpu().numpy().tobytes()))
        return sample(self, ids, n, generator, attention_mask)

    def rollout_(self, prompt, n, generator=None):  # rollout.semantic_cot: the CoT and its images from one stream
        if generator is None:
            generator = torch.Generator().manual_seed(where[0] * 1_000_003 + zlib.crc32(prompt.encode()))
        return cot_rollout(self, prompt, n, generator)

    PromptSampler.next, JanusPolicy.sample, SemanticCoT.rollout = next_, sample_, rollout_


def _train(*args):
    from mmrl.ar_image import grpo
    from mmrl.config import load_config

    return grpo.train(load_config(str(ROOT / "configs/ar_image/janus_grpo_tiny.yaml"), list(args)))


def _torchrun(*args, timeout=300):
    return run_torchrun(list(args), cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mmrl.tiny import build_tiny_janus

    return build_tiny_janus(tmp_path_factory.mktemp("janus") / "janus", seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("cot", [False, True], ids=["image", "semantic_cot"])
def test_two_ranks_equal_one_process_with_the_same_rollouts(tiny, tmp_path, monkeypatch, cot):
    """Micro-batches of 2 rows (of 6 per rank, 12 in one process): the gradient accumulates over micro-steps and
    all-reduces once per update (DDP no_sync on the wrapped training pass)."""
    extra = ["rollout.semantic_cot=true", "rollout.cot.max_tokens=6"] if cot else []
    extra += ["update.micro_batch_size=2"]
    two = _torchrun(__file__, *_args(tiny, tmp_path / "two", *extra))
    assert two.returncode == 0, f"torchrun failed:\n{two.stdout[-2000:]}\n{two.stderr[-5000:]}"
    assert "[mmrl] dist.strategy: auto -> ddp (2 processes launched)" in two.stdout
    from mmrl.ar_image.cot import SemanticCoT
    from mmrl.ar_image.janus import JanusPolicy
    from mmrl.pipelines.data import PromptSampler

    monkeypatch.setattr(PromptSampler, "next", PromptSampler.next)  # restored after the test
    monkeypatch.setattr(JanusPolicy, "sample", JanusPolicy.sample)
    monkeypatch.setattr(SemanticCoT, "rollout", SemanticCoT.rollout)
    _fixed_rollouts()
    _train(*_args(tiny, tmp_path / "one", *extra))
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]  # rank 0 alone logs
    assert_close_across_paths(two, one, what="2 ranks vs 1 process, the same rollouts")
    diff = max(abs(a[k] - b[k]) for a, b in zip(two, one) for k in a if isinstance(a[k], float))
    print(f"[janus ddp{' cot' if cot else ''}] max |metric diff| 2 ranks vs 1 process: {diff:.2e}; grad norms "
          f"{[round(r['policy/grad_norm'], 6) for r in one]}")
    assert all(r["policy/grad_norm"] > 0 and r["reward/std"] > 0 for r in one)
    assert not cot or all(1 <= r["cot/length"] <= 6 for r in one)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_1", "step_2"]


@pytest.mark.slow
def test_two_ranks_resume_exactly(tiny, tmp_path):
    """Unpatched: each rank samples from its (seed, rank, step) stream, so the resumed run needs no per-rank state;
    grids and evaluation (rank 0) in the uninterrupted run only."""
    shown = ["log.sample_every=1", "log.num_samples=2", "log.eval_every=1", "log.eval_images=2",
             "log.eval_max_prompts=2", f"data.eval_prompts={ROOT / 'assets/prompts/shapes_eval.txt'}"]
    full, part = tmp_path / "full", tmp_path / "part"
    for out, extra in ((full, shown), (part, ["train.max_steps=1"]), (part, [])):
        proc = _torchrun("-m", "mmrl.cli", "train", str(ROOT / "configs/ar_image/janus_grpo_tiny.yaml"),
                         *_args(tiny, out, *extra))
        assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    assert "resumed from" in proc.stdout
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rows]  # noqa: E731
    a, b = _rows(full), _rows(part)
    assert [r["step"] for r in b] == [1, 2]
    assert_same_path(drop(a), drop(b), why=RESUMED_RUN + "; the rollouts' streams are (seed, rank, step)")
    assert all(0 <= r["eval/reward/mean"] <= 1 for r in a)
    assert sorted(p.name for p in (full / "samples").glob("*.png")) == [
        f"{kind}_{s:06d}.png" for kind in ("eval_step", "step") for s in range(3)]


def test_fsdp_and_rollout_ranks_are_refused(tiny, tmp_path):
    from mmrl.ar_image import grpo

    with pytest.raises(ValueError, match=r"^dist.strategy: janus_grpo runs in one process or data parallel, "
                                         r"expected 'auto', 'none' or 'ddp', got 'fsdp'$"):
        _train(*_args(tiny, tmp_path / "run", "dist.strategy=fsdp"))
    with pytest.raises(ValueError, match=r"^dist.rollout_ranks: janus_grpo has no rollout ranks \(every rank trains\), "
                                         r"expected 0, got 1$"):
        _train(*_args(tiny, tmp_path / "run", "dist.rollout_ranks=1"))
    assert not (tmp_path / "run").exists() and grpo.Config().dist.strategy == "auto"


@pytest.mark.slow
def test_prompts_the_ranks_cannot_split_are_one_line(tiny, tmp_path):
    proc = _torchrun("-m", "mmrl.cli", "train", str(ROOT / "configs/ar_image/janus_grpo_tiny.yaml"),
                     *_args(tiny, tmp_path / "run", "rollout.prompts_per_step=3"), timeout=120)
    assert proc.returncode != 0
    assert ("mmrl: error: rollout.prompts_per_step=3 (global, over all processes) must be divisible by the number "
            "of processes (2)") in proc.stderr
    assert not re.search(r'File ".*/mmrl/', proc.stderr)  # (torchrun's own launcher prints its traceback)
    assert not (tmp_path / "run").exists()  # refused before the run directory and the model


if __name__ == "__main__":  # one torchrun rank: the recipe with rank-independent rollouts
    _fixed_rollouts()
    _train(*sys.argv[1:])
