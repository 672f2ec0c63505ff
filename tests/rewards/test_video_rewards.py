"""Video rewards: per-frame image rewards with aggregation, temporal consistency, motion amount (hand-computed
values), the inputs they take and the one-line errors for the wrong kind of input."""

import pytest
import torch

from mmrl import rewards
from mmrl.pipelines.videos import write_video
from mmrl.rewards.video import sample_video


def _uniform_video(levels, size=8):
    """Frames of one grey level each: [F, 3, size, size]."""
    return torch.stack([torch.full((3, size, size), float(v)) for v in levels])


def test_motion_amount_hand_values():
    # mean |frame[t+1] - frame[t]| per pair: levels 0 -> 0.5 -> 0.5 -> 1.0: pairs 0.5, 0, 0.5 -> mean 1/3
    out = rewards.load("motion_amount")(images=torch.stack([_uniform_video([0, 0.5, 0.5, 1.0]),
                                                            _uniform_video([0.2] * 4)]))
    assert torch.allclose(out.scores, torch.tensor([1 / 3, 0.0]))
    assert torch.allclose(out.details["pairs"][0], torch.tensor([0.5, 0.0, 0.5]))
    faster = rewards.load("motion_amount")(images=torch.stack([sample_video(speed=1), sample_video(speed=3)]))
    assert faster.scores[1] > faster.scores[0] > 0


def test_temporal_consistency_pixels_hand_values():
    """Pixel features: cos of adjacent frames. A = left half white, B = right half white: cos(A, A) = 1,
    cos(A, B) = 0, so A, A, B scores (1 + 0) / 2."""
    a = torch.zeros(3, 32, 32)
    a[:, :, :16] = 1.0
    b = a.flip(-1)
    out = rewards.load("temporal_consistency")(images=torch.stack([a, a, b]).unsqueeze(0))
    assert torch.allclose(out.details["pairs"], torch.tensor([[1.0, 0.0]]), atol=1e-6)
    assert torch.allclose(out.scores, torch.tensor([0.5]), atol=1e-6)


def test_temporal_consistency_clip_features(tmp_path):
    """features=clip: the cosine of a local CLIP's normalised image embeddings of adjacent frames."""
    from mmrl.rewards.image._common import HFClip
    from mmrl.tiny import build_tiny_clip

    clip_dir = build_tiny_clip(tmp_path / "clip")
    video = sample_video(frames=4, size=32)
    out = rewards.load("temporal_consistency", features="clip", weights=str(clip_dir))(images=video[None])
    emb = HFClip(clip_dir, clip_dir, "t", "t").image_embeds(video)
    expected = (emb[1:] * emb[:-1]).sum(-1)
    assert torch.allclose(out.details["pairs"][0], expected, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="no weights path given"):
        rewards.load("temporal_consistency", features="clip")


@pytest.mark.parametrize("aggregate, expected", [("mean", lambda s: s.mean(1)), ("min", lambda s: s.amin(1)),
                                                 ("max", lambda s: s.amax(1)), ("frame", lambda s: s[:, 2])])
def test_video_frames_aggregates_an_image_reward(aggregate, expected):
    """Every frame scored by the image reward on its own (as one image batch), then aggregated per video."""
    videos = torch.stack([sample_video(frames=4, size=32, seed=s, speed=3) for s in range(2)])
    videos[1, 3] = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))  # one noisy frame
    jpeg = rewards.load("jpeg_compressibility")
    per_frame = torch.stack([jpeg(images=v).scores for v in videos])  # [2, 4]
    out = rewards.load("video_frames", image_reward="jpeg_compressibility", aggregate=aggregate, frame=2)(
        images=videos)
    assert torch.allclose(out.scores, expected(per_frame))
    if aggregate != "frame":
        assert torch.allclose(out.details["frames"], per_frame)


def test_video_frames_repeats_prompts_per_frame_and_every_kth_frame():
    """A prompt-conditioned image reward sees each video's prompt on each of its frames; `every` subsamples."""
    red = torch.zeros(3, 16, 16)
    red[0] = 1.0
    blue = red.roll(2, dims=0)
    video = torch.stack([red, blue, red, blue, red])[None].repeat(2, 1, 1, 1, 1)
    prompts = ["a white circle on a red background", "a white circle on a blue background"]
    out = rewards.load("video_frames", image_reward="prompt_color", aggregate="mean", every=2)(
        images=video, prompts=prompts)
    assert out.details["frames"].shape == (2, 3)  # frames 0, 2, 4: all red
    colour = rewards.load("prompt_color")
    expected = torch.stack([colour(images=video[i, ::2], prompts=[prompts[i]] * 3).scores.mean() for i in range(2)])
    assert torch.allclose(out.scores, expected) and out.scores[0] > out.scores[1]


def test_video_rewards_take_files_and_uint8(tmp_path):
    video = sample_video(frames=5, size=16)
    path = write_video(video, tmp_path / "a.gif")
    from_file = rewards.load("motion_amount")(images=[str(path)])
    u8 = (video * 255).round().to(torch.uint8)[None]
    assert torch.allclose(from_file.scores, rewards.load("motion_amount")(images=u8).scores, atol=1e-6)


def test_wrong_kind_of_input_is_one_line():
    videos = torch.stack([sample_video(frames=3, size=16)] * 2)
    with pytest.raises(ValueError, match=r"^reward 'jpeg_compressibility' scores images \[B, 3, H, W\], got videos "
                                         r"\(2, 3, 3, 16, 16\).*load\('video_frames', image_reward="
                                         r"'jpeg_compressibility'"):
        rewards.load("jpeg_compressibility")(images=videos)
    with pytest.raises(ValueError, match=r"^reward 'motion_amount' scores videos \[B, F, 3, H, W\], got images"):
        rewards.load("motion_amount")(images=torch.rand(2, 3, 16, 16))
    with pytest.raises(ValueError, match="needs videos of >= 2 frames, got 1"):
        rewards.load("temporal_consistency")(images=videos[:, :1])
    with pytest.raises(ValueError, match=r"frame 5 is outside the 3 frames"):
        rewards.load("video_frames", image_reward="jpeg_compressibility", aggregate="frame", frame=5)(images=videos)
    with pytest.raises(ValueError, match=r"aggregate must be one of \['mean', 'min', 'max', 'frame'\]"):
        rewards.load("video_frames", image_reward="jpeg_compressibility", aggregate="median")
    with pytest.raises(ValueError, match=r"image_reward 'motion_amount' scores video, not images"):
        rewards.load("video_frames", image_reward="motion_amount")
    with pytest.raises(ValueError, match=r"mixes image components \['jpeg_compressibility'\] with video components "
                                         r"\['motion_amount'\]"):
        rewards.load({"jpeg_compressibility": 1.0, "motion_amount": 1.0})
    with pytest.raises(ValueError, match=r"float videos must be in \[0, 1\]"):
        rewards.load("motion_amount")(images=videos * 2)


def test_composite_of_video_rewards():
    videos = torch.stack([sample_video(frames=4, size=16, seed=s) for s in range(2)])
    comp = rewards.load({"motion_amount": -1.0, "frames": {"reward": "video_frames",
                                                           "image_reward": "jpeg_compressibility", "weight": 0.5}})
    assert comp.kind == "video"
    out = comp(images=videos)
    motion = rewards.load("motion_amount")(images=videos).scores
    frames = rewards.load("video_frames", image_reward="jpeg_compressibility")(images=videos).scores
    assert torch.allclose(out.scores, -motion + 0.5 * frames)


def test_recipe_reward_kind_matches_the_rollout():
    """A recipe whose rollout makes videos refuses an image reward at start-up (and the other way round)."""
    from mmrl.diffusion.scoring import load_reward_fn

    with pytest.raises(ValueError, match=r"^reward.components.pickscore scores images, but rollout.num_frames=5 "
                                         r"makes videos; score them per frame: pickscore: \{reward: video_frames"):
        load_reward_fn({"pickscore": {"weight": 1.0, "reward": "jpeg_compressibility"}}, "cpu", num_frames=5)
    with pytest.raises(ValueError, match=r"^reward.components.motion_amount scores videos, but rollout.num_frames=1"):
        load_reward_fn({"motion_amount": 1.0}, "cpu", num_frames=1)
    assert load_reward_fn({"motion_amount": 1.0}, "cpu", num_frames=5).kind == "video"
