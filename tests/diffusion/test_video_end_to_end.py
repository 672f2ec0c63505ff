"""Video end to end through the commands docs/video.md shows: `mmrl tiny DIR`, `mmrl train` of the tiny Wan video
config on 2 processes (DDP, gloo) resumed by one, and `mmrl eval` of the checkpoint; plus `mmrl eval`'s video
report against an independent recomputation of its rewards."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl.testing import child_env, metrics_rows, run_torchrun

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/diffusion/flow_grpo_wan_tiny.yaml"


@pytest.mark.slow
def test_docs_video_commands_two_processes_resume_and_eval(tmp_path):
    from mmrl import cli
    from mmrl.pipelines.videos import read_video

    tiny = tmp_path / "tiny"
    assert cli.main(["tiny", str(tiny)]) == 0  # mmrl tiny runs/tiny
    out = tmp_path / "run"
    args = [CONFIG, f"model.path={tiny / 'wan'}", f"output_dir={out}", "train.save_every=1", "rollout.num_steps=3",
            "log.sample_every=1", "log.eval_every=0", "dist.backend=gloo"]
    env = child_env()
    two = run_torchrun(["-m", "mmrl.cli", "train", *args, "train.max_steps=2", "dist.strategy=ddp"], cwd=REPO, env=env)
    assert two.returncode == 0, f"torchrun failed:\n{two.stdout[-2000:]}\n{two.stderr[-5000:]}"
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["diag/logprob_drift"] < 1e-4 and r["train/updates"] == 1 for r in rows)
    assert {"reward/motion_amount", "reward/jpeg_per_frame"} <= set(rows[0])
    frames = read_video(out / "samples" / "step_000001.mp4")
    assert frames.shape[0] == 5  # every frame of the 5-frame samples, tiled into one grid video
    one = subprocess.run([sys.executable, "-m", "mmrl.cli", "train", *args, "train.max_steps=3"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, f"resume failed:\n{one.stdout[-2000:]}\n{one.stderr[-5000:]}"
    assert "resumed from" in one.stdout and [r["step"] for r in metrics_rows(out)] == [1, 2, 3]
    # mmrl eval configs/diffusion/flow_grpo_wan_tiny.yaml --checkpoint runs/flow_grpo_wan_tiny
    ev = tmp_path / "eval"
    assert cli.main(["eval", CONFIG, "--checkpoint", str(out), "--out", str(ev), "--max-prompts", "2",
                     f"model.path={tiny / 'wan'}", "rollout.eval_num_steps=2"]) == 0
    report = json.loads((ev / "eval_report.json").read_text())
    assert report["policy"]["step"] == 3 and report["sampling"]["num_frames"] == 5
    assert report["files"]["grid"] == "eval_grid.mp4" and read_video(ev / "eval_grid.mp4").shape[0] == 5
    assert [read_video(ev / f).shape for p in report["per_prompt"] for f in p["images"]] == [(5, 32, 32, 3)] * 2


def test_eval_scores_videos_as_an_independent_recomputation(tmp_path, tiny_wan_path):
    """`mmrl eval` on a video model: each prompt's video (its own seeded noise) rounded to 8 bits is what the rewards
    score; recomputing the sampler and the rewards by hand gives the report's numbers."""
    from mmrl import rewards
    from mmrl.config import load_config
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups
    from mmrl.eval import run_eval
    from mmrl.eval.harness import prompt_seed

    cfg = load_config(REPO / CONFIG, [f"model.path={tiny_wan_path}", f"output_dir={tmp_path / 'run'}",
                                      "rollout.eval_num_steps=2"])
    report = run_eval(cfg, None, out=tmp_path / "ev", max_prompts=2)
    m = load_flow_model(tiny_wan_path, num_frames=5, max_sequence_length=16)
    reward = rewards.load(dict(cfg.reward.components))
    for i, p in enumerate(report["per_prompt"]):
        gen = torch.Generator().manual_seed(prompt_seed(cfg.seed, i))
        traj = sample_groups(m, m.encode_prompts([p["prompt"]]), 1, num_steps=2, height=32, width=32,
                             guidance_scale=1.0, noise_level=0.0, generator=gen)
        u8 = (traj.images.clamp(0, 1) * 255).round() / 255
        assert traj.images.shape == (1, 5, 3, 32, 32)
        assert p["reward"][0] == pytest.approx(reward(images=u8, prompts=[p["prompt"]]).scores.item(), abs=1e-6)
    assert report["compositional"]["checked"] == 2  # the shapes check runs on each video's first frame
