"""Audio rewards (`mmrl.rewards.audio`): loudness computed by hand on sines, the `audio=` slot of a composite beside
a video reward, and the one-line errors."""

import math

import pytest
import torch

from mmrl.rewards import load
from mmrl.rewards.audio import check_audio_rewards, takes_audio
from mmrl.rewards.latent import needs_pixels
from mmrl.rewards.video import sample_video

SR = 8000


def _sine(amplitude, hz, n=800):
    """`n` samples at 8 kHz: 500 Hz and 2 kHz make whole cycles, so each sits on one FFT bin."""
    return amplitude * torch.sin(2 * math.pi * hz * torch.arange(n) / SR)


def test_audio_loudness_by_hand():
    """Mean power of a sine of amplitude A is A^2 / 2: 0.5 -> 0.125 -> 10 log10(0.125) = -9.031 dB; 0.5 at 500 Hz +
    0.25 at 2 kHz -> 0.125 + 0.03125 = 0.15625 (-8.062 dB); the band 100-1000 Hz keeps only the first (-9.031 dB),
    1500-4000 Hz only the second (0.03125: -15.051 dB); silence -100 dB; a stereo pair averages its channels."""
    one, two = _sine(0.5, 500), _sine(0.5, 500) + _sine(0.25, 2000)
    stereo = torch.stack([one, torch.zeros(800)])  # (0.125 + 0) / 2 = 0.0625: -12.041 dB
    batch = torch.stack([torch.stack([one, one]), torch.stack([two, two]), torch.zeros(2, 800), stereo])
    r = load("audio_loudness")
    assert r.kind == "audio" and takes_audio(r) and not needs_pixels(r)
    out = r(audio=batch, sample_rate=SR)
    torch.testing.assert_close(out.scores, torch.tensor([-9.0309, -8.0618, -100.0, -12.0412]), atol=1e-3, rtol=0)
    torch.testing.assert_close(out.details["power"], torch.tensor([0.125, 0.15625, 0.0, 0.0625]), atol=1e-6, rtol=0)
    low = load("audio_loudness", low_hz=100, high_hz=1000)
    assert low.name == "audio_loudness(100-1000 Hz)"
    torch.testing.assert_close(low(audio=torch.stack([one, two]), sample_rate=SR).scores,
                               torch.tensor([-9.0309, -9.0309]), atol=1e-3, rtol=0)  # [B, S]: one channel
    high = load("audio_loudness", low_hz=1500)
    torch.testing.assert_close(high(audio=two[None], sample_rate=SR).details["power"], torch.tensor([0.03125]),
                               atol=1e-6, rtol=0)
    full = load("audio_loudness", low_hz=0, high_hz=SR / 2)  # the whole band through the FFT = the plain mean power
    torch.testing.assert_close(full(audio=batch, sample_rate=SR).scores, out.scores, atol=1e-4, rtol=0)


def test_composite_hands_sound_to_audio_components():
    """A video reward + an audio reward: each gets its own input; the sum is weighted as usual. A composite of audio
    components only needs no pixels."""
    videos = torch.stack([sample_video(frames=3, size=16, seed=s) for s in range(2)])
    audio = torch.stack([_sine(0.5, 500), _sine(0.1, 500)])[:, None]
    mixed = load({"motion_amount": 1.0, "audio_loudness": 0.5})
    assert mixed.kind == "video" and takes_audio(mixed) and needs_pixels(mixed)
    out = mixed(images=videos, audio=audio, sample_rate=SR)
    alone = load("audio_loudness")(audio=audio, sample_rate=SR).scores
    torch.testing.assert_close(out.details["audio_loudness"], alone)
    torch.testing.assert_close(out.scores, out.details["motion_amount"] + 0.5 * alone)
    only = load({"audio_loudness": 1.0})
    assert only.kind == "audio" and not needs_pixels(only)
    assert not takes_audio(load({"motion_amount": 1.0}))
    with pytest.raises(ValueError, match=r"^reward 'audio_loudness' scores sound: pass audio=<waveforms \[B, C, S\]> "
                                         r"and sample_rate=<Hz>"):
        mixed(images=videos)


def test_audio_inputs_are_one_line():
    r = load("audio_loudness")
    with pytest.raises(ValueError, match=r"^reward 'audio_loudness': sample_rate must be a positive number of Hz, "
                                         r"got None$"):
        r(audio=torch.zeros(1, 1, 8))
    with pytest.raises(ValueError, match=r"^reward 'audio_loudness': expected waveforms \[B, C, S\] with B, S > 0, "
                                         r"got \(1, 1, 1, 8\)$"):
        r(audio=torch.zeros(1, 1, 1, 8), sample_rate=SR)
    with pytest.raises(ValueError, match=r"^reward 'audio_loudness': waveforms must be finite floats, got "
                                         r"torch.float32 with 1 non-finite values$"):
        r(audio=torch.tensor([[0.0, float("nan")]]), sample_rate=SR)
    with pytest.raises(ValueError, match=r"^audio_loudness: need 0 <= low_hz < high_hz, got low_hz=900, "
                                         r"high_hz=100$"):
        load("audio_loudness", low_hz=900, high_hz=100)


def test_audio_reward_of_a_family_without_sound_is_refused():
    """At config load (model_index.json read, no weights) and on a loaded model: one line naming the component."""
    comps = {"pick": {"reward": "motion_amount"}, "loud": {"reward": "audio_loudness", "weight": 0.1}}
    check_audio_rewards(comps, lambda: ("ltx2", True), "/m/ltx2")
    asked = []
    check_audio_rewards({"motion_amount": 1.0}, lambda: asked.append(1), "/m")  # no audio reward: never asked
    assert asked == []
    with pytest.raises(ValueError, match=r"^reward\.components\.loud scores sound, but model\.path '/m/wan' \(wan\) "
                                         r"makes none; audio rewards need an audio-video family \(LTX2Pipeline\)$"):
        check_audio_rewards(comps, lambda: ("wan", False), "/m/wan")
    with pytest.raises(ValueError, match=r"^reward\.components\.audio_loudness scores sound"):
        check_audio_rewards(load({"audio_loudness": 1.0}).components, lambda: ("sd3", False), "/m/sd3")


def test_reward_cli_refuses_sound_in_one_line(tmp_path, capsys):
    """`mmrl reward score|serve` take image files: an audio reward, by name or inside a YAML composite, is refused."""
    import argparse
    import json

    from PIL import Image

    from mmrl.rewards.cli import add_reward_subparsers

    Image.new("RGB", (16, 16)).save(tmp_path / "a.png")
    (tmp_path / "mix.yaml").write_text(json.dumps({"audio_loudness": 1.0, "jpeg_compressibility": 1.0}))
    for argv in (["score", "audio_loudness"], ["serve", "audio_loudness", "--port", "0"],
                 ["score", str(tmp_path / "mix.yaml")]):
        parser = argparse.ArgumentParser(prog="mmrl")
        add_reward_subparsers(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["reward", *argv, "--images", str(tmp_path / "a.png")] if argv[0] == "score"
                                 else ["reward", *argv])
        with pytest.raises(SystemExit):
            args.func(args)
        assert capsys.readouterr().err.splitlines()[-1].endswith(
            "scores sound, not images: `mmrl reward score|serve` take image files only; call it from Python "
            "(load(...)(audio=..., sample_rate=...)) or name it in a recipe's reward.components")


def test_recipe_with_an_audio_reward_for_a_silent_family_fails_before_loading(tmp_path):
    """A recipe's start (reads model_index.json only: no weights here, nothing loaded or written): one line naming
    the component."""
    import json

    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train

    (tmp_path / "wan").mkdir()
    (tmp_path / "wan" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    d = {"algorithm": "flow_grpo", "output_dir": str(tmp_path / "run"), "model": {"path": str(tmp_path / "wan")},
         "data": {"train_prompts": str(prompts)}, "rollout": {"num_frames": 5},
         "reward": {"components": {"motion_amount": 1.0, "loud": {"reward": "audio_loudness", "weight": 0.1}}}}
    with pytest.raises(ValueError, match=rf"^reward\.components\.loud scores sound, but model\.path "
                                         rf"'{tmp_path / 'wan'}' \(wan\) makes none; audio rewards need an "
                                         rf"audio-video family \(LTX2Pipeline\)$"):
        train(load_config(d))
    assert not (tmp_path / "run").exists()
