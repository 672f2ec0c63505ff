"""VideoAlign / VideoReward (`videoalign`, alias `videoreward`) on the tiny checkpoint in the authors' layout: loading,
the three heads and their sum, normalisation from model_config.json, LoRA merged, frame sampling, batched == one by
one, one-line errors, and a 1-step tiny Wan Flow-GRPO run scored by it. Parity with the authors' own inference code
is benchmarks/parity/videoalign.py (it needs their pinned transformers in a side venv; numbers in docs/rewards.md)."""

import json
import shutil

import pytest
import torch

from mmrl import rewards
from mmrl.rewards.video import sample_video
from mmrl.rewards.video_align import merge_lora, sample_frames

PROMPTS = ["a red square moves to the right", "a cat on a chair", "blue circles"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from mmrl.tiny import build_tiny_videoalign

    return build_tiny_videoalign(tmp_path_factory.mktemp("videoalign") / "VideoReward")


@pytest.fixture(scope="module")
def videos():
    return torch.stack([sample_video(frames=5, size=32, seed=s, speed=1 + s) for s in range(3)])


@pytest.fixture(scope="module")
def reward(ckpt):
    return rewards.load("videoalign", weights=str(ckpt), batch_size=8)


def test_heads_in_details_overall_is_their_sum_and_head_picks_one(ckpt, videos, reward):
    out = reward(images=videos, prompts=PROMPTS)
    d = out.details
    assert set(d) == {"vq", "mq", "ta", "overall"} and all(d[k].shape == (3,) for k in d)
    assert torch.allclose(d["overall"], d["vq"] + d["mq"] + d["ta"]) and torch.equal(out.scores, d["overall"])
    assert len({round(float(x), 6) for x in out.scores}) == 3  # the videos / prompts change the scores
    mq = rewards.load("videoreward", weights=str(ckpt), head="mq")(images=videos, prompts=PROMPTS)
    assert torch.allclose(mq.scores, d["mq"], atol=1e-5)


def test_normalisation_uses_the_checkpoint_statistics(ckpt, videos, reward):
    """normalize=True (the authors' use_norm default): (raw - <H>_mean) / <H>_std from model_config.json's
    inference_config per head; overall = the sum of the normalised heads."""
    stats = json.loads((ckpt / "model_config.json").read_text())["inference_config"]
    raw = rewards.load("videoalign", weights=str(ckpt), normalize=False)(images=videos, prompts=PROMPTS).details
    norm = reward(images=videos, prompts=PROMPTS).details
    for h in ("vq", "mq", "ta"):
        want = (raw[h] - stats[f"{h.upper()}_mean"]) / stats[f"{h.upper()}_std"]
        assert torch.allclose(norm[h], want, atol=1e-5), h
    assert not torch.allclose(raw["overall"], norm["overall"], atol=1e-3)


def test_batched_equals_one_by_one(videos, reward):
    batched = reward(images=videos, prompts=PROMPTS)  # right padding: the prompts differ in length
    for i in range(3):
        one = reward(images=videos[i: i + 1], prompts=PROMPTS[i: i + 1])
        for k in ("vq", "mq", "ta", "overall"):
            assert abs(float(one.details[k][0]) - float(batched.details[k][i])) < 1e-5, (i, k)


def test_lora_is_merged_into_the_linear():
    """W' = W + lora_alpha / r * B @ A; base_layer names dropped; decoder moved under language_model; lm_head
    (tied to the embeddings, unused by the reward) left out."""
    a, b, w = torch.randn(2, 3), torch.randn(4, 2), torch.randn(4, 3)
    p = "base_model.model."
    state = {f"{p}model.layers.0.mlp.up_proj.base_layer.weight": w, f"{p}model.layers.0.mlp.up_proj.lora_A.default.weight": a,
             f"{p}model.layers.0.mlp.up_proj.lora_B.default.weight": b, f"{p}visual.merger.ln_q.weight": torch.ones(3),
             f"{p}lm_head.weight": torch.ones(2), f"{p}rm_head.weight": torch.ones(1, 3)}
    out = merge_lora(state, scale=2.0)
    assert set(out) == {"language_model.layers.0.mlp.up_proj.weight", "visual.merger.ln_q.weight", "rm_head.weight"}
    assert torch.allclose(out["language_model.layers.0.mlp.up_proj.weight"], w + 2.0 * b @ a)


def test_loaded_model_applies_the_lora_of_model_pth(ckpt, tmp_path, videos, reward):
    """Zeroing lora_B in model.pth changes the scores: the merged LoRA is part of the loaded weights."""
    copy = tmp_path / "zero_lora"
    shutil.copytree(ckpt, copy)
    pth = copy / "checkpoint-8" / "model.pth"
    state = torch.load(pth, weights_only=True)
    torch.save({k: (torch.zeros_like(v) if ".lora_B." in k else v) for k, v in state.items()}, pth)
    zero = rewards.load("videoalign", weights=str(copy))(images=videos, prompts=PROMPTS).scores
    assert (zero - reward(images=videos, prompts=PROMPTS).scores).abs().max() > 1e-3


def test_frames_sampled_at_2_fps_with_at_least_4():
    """The authors' smart_nframes: F / video_fps * fps, clamped to [4, F], rounded to an even count; indices
    round(linspace(0, F - 1, n))."""
    idx = torch.arange(81).view(81, 1, 1, 1)
    assert sample_frames(idx, 16.0, 2.0, None).flatten().tolist() == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]  # 10
    assert sample_frames(idx[:5], 16.0, 2.0, None).flatten().tolist() == [0, 1, 3, 4]  # 0.6 frames -> 4
    assert sample_frames(idx[:9], 16.0, 2.0, num_frames=7).flatten().tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="needs videos of >= 2 frames, got 1"):
        sample_frames(idx[:1], 16.0, 2.0, None)


def test_wrong_paths_and_arguments_fail_in_one_line(ckpt, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"weights path '.*nope' does not exist; download 'KlingTeam/VideoReward'"):
        rewards.load("videoalign", weights=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="has no model_config.json; expected the VideoReward layout"):
        rewards.load("videoalign", weights=str(tmp_path))
    hub_named = tmp_path / "hub_named"
    shutil.copytree(ckpt, hub_named, ignore=shutil.ignore_patterns("base"))
    cfg = json.loads((hub_named / "model_config.json").read_text())
    cfg["model_config"]["model_name_or_path"] = "Qwen/Qwen2-VL-2B-Instruct"  # as in the released checkpoint
    (hub_named / "model_config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match=r"base model 'Qwen/Qwen2-VL-2B-Instruct' .* is not a local directory; "
                                                r"download 'Qwen/Qwen2-VL-2B-Instruct' yourself and pass base="):
        rewards.load("videoalign", weights=str(hub_named))
    with pytest.raises(FileNotFoundError, match=r"step=3: no checkpoint-3 in .*; have \[8\]"):
        rewards.load("videoalign", weights=str(ckpt), step=3)
    with pytest.raises(ValueError, match=r"head must be one of \['vq', 'mq', 'ta', 'overall'\], got 'motion'"):
        rewards.load("videoalign", weights=str(ckpt), head="motion")
    with pytest.raises(ValueError, match="give fps .* or num_frames .*, not both; got fps=4, num_frames=8"):
        rewards.load("videoalign", weights=str(ckpt), fps=4, num_frames=8)
    from PIL import Image

    from mmrl.rewards.cli import main

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "p.txt").write_text("a cat\n")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):  # a directory without the VideoReward files
        main(["reward", "score", "videoalign", "--weights", str(tmp_path / "empty"), "--images", str(tmp_path / "a.png"),
              "--prompts", str(tmp_path / "p.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmrl reward: error: videoalign: ")
    assert err[0].endswith("empty' has no model_config.json; expected the VideoReward layout (model_config.json + "
                           "checkpoint-<step>/model.pth) of 'KlingTeam/VideoReward' (formerly KwaiVGI/VideoReward)")


def test_checkpoint_not_fitting_fails_in_one_line_naming_base(ckpt, tmp_path):
    """The shared Qwen-VL loader (mmrl.rewards.vlm_head) names the file and VideoAlign's own argument (base=): a
    model.pth without the PEFT wrapper, one whose embeddings do not fit the base tokenizer + 3 reward tokens."""
    copy = tmp_path / "bad"
    shutil.copytree(ckpt, copy)
    pth = copy / "checkpoint-8" / "model.pth"
    state = torch.load(pth, weights_only=True)
    torch.save({k[len("base_model.model."):]: v for k, v in state.items()}, pth)
    with pytest.raises(ValueError, match=r"^videoalign: '.*checkpoint-8/model.pth': keys do not start with "
                                         r"'base_model.model.' \(e.g. .*\); expected a PEFT-wrapped state dict$"):
        rewards.load("videoalign", weights=str(copy))
    emb = "base_model.model.model.embed_tokens.weight"
    n = state[emb].shape[0]
    torch.save({**state, emb: state[emb][:-1]}, pth)
    with pytest.raises(ValueError, match=rf"^videoalign: checkpoint '.*model.pth' has {n - 1} token embeddings, the "
                                         rf"tokenizer in '.*' with \['<\|VQ_reward\|>', '<\|MQ_reward\|>', "
                                         rf"'<\|TA_reward\|>'\] added has {n}; pass base= the base model"):
        rewards.load("videoalign", weights=str(copy))


def test_model_config_not_json_fails_in_one_line(tmp_path):
    (tmp_path / "model_config.json").write_text("{data_config: 1")
    with pytest.raises(ValueError, match=r"^videoalign: '.*model_config.json' is not valid JSON \(Expecting property "
                                         r"name enclosed in double quotes: line 1 column 2 \(char 1\)\)$"):
        rewards.load("videoalign", weights=str(tmp_path))


def test_prompt_holding_a_reward_token_is_refused(videos, reward):
    with pytest.raises(ValueError, match=r"^videoalign: row 1 holds 4 reward tokens, expected 3; a prompt must not "
                                         r"contain the reward token text itself$"):
        reward(images=videos[:2], prompts=["a cat", "a dog <|TA_reward|>"])


def test_bfloat16_runs_the_head_in_the_model_dtype(ckpt, videos, reward):
    """As the authors' model (rm_head inside it, loaded in one dtype); close to float32."""
    bf16 = rewards.load("videoalign", weights=str(ckpt), dtype="bfloat16")
    assert bf16.rm_head.weight.dtype == torch.bfloat16 == next(bf16.backbone.model.parameters()).dtype
    assert (bf16(images=videos, prompts=PROMPTS).scores - reward(images=videos, prompts=PROMPTS).scores).abs().max() < 0.1


def test_images_instead_of_videos_fail_in_one_line(reward):
    with pytest.raises(ValueError, match=r"reward 'videoalign' scores videos \[B, F, 3, H, W\], got images"):
        reward(images=torch.rand(2, 3, 32, 32), prompts=PROMPTS[:2])


def test_one_step_tiny_wan_flow_grpo_scored_by_videoalign(ckpt, tmp_path):
    """The tiny Wan video recipe trains one step with `videoalign` as its reward (each component logged)."""
    from pathlib import Path

    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train
    from mmrl.diffusion.models import tiny_cases
    from mmrl.testing import metrics_rows

    import yaml

    repo = Path(__file__).resolve().parents[2]
    wan = tiny_cases()["wan21"].build_at(tmp_path / "wan")
    data = yaml.safe_load((repo / "configs/diffusion/flow_grpo_wan_tiny.yaml").read_text())
    data["reward"]["components"] = {
        "videoalign": {"weight": 1.0, "weights": str(ckpt)},
        "videoalign_mq": {"reward": "videoalign", "head": "mq", "weight": 0.0, "weights": str(ckpt)}}
    cfg = load_config(data, [f"model.path={wan}", f"output_dir={tmp_path / 'run'}", "train.max_steps=1",
                             "rollout.num_steps=2", "rollout.group_size=2", "log.sample_every=0", "log.eval_every=0"])
    train(cfg)
    (row,) = metrics_rows(tmp_path / "run")
    assert row["step"] == 1 and {"reward/videoalign", "reward/videoalign_mq"} <= set(row)
    assert row["reward/videoalign"] != row["reward/videoalign_mq"]
