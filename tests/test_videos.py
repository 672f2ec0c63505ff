"""Video samples in a run: MP4 files (PyAV / H.264) that decode back to the frames, animated GIFs, grids with
captions, and the trackers (TensorBoard GIF images, W&B videos)."""

import io
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.pipelines.videos import gif_bytes, read_video, to_uint8_frames, write_video
from mmrl.rewards.video import sample_video
from mmrl.run.directory import Run
from mmrl.run.plots import save_video_grid
from mmrl.training import TrackersConfig


@dataclass
class _Cfg(RunConfig):
    log: TrackersConfig = field(default_factory=TrackersConfig)


def test_mp4_round_trip_keeps_frames_and_content(tmp_path):
    """An MP4 holds every frame at the size written (odd sizes padded by an edge row for yuv420p) and decodes to
    nearly the same pixels (H.264 at crf 18 on a smooth clip: small error)."""
    video = sample_video(frames=6, size=32)
    path = write_video(video, tmp_path / "clip.mp4", fps=8)
    back = read_video(path)
    assert back.shape == (6, 32, 32, 3) and back.dtype == np.uint8
    assert np.abs(back.astype(float) - to_uint8_frames(video).astype(float)).mean() < 4.0
    odd = write_video(torch.rand(3, 3, 15, 17), tmp_path / "odd.mp4")
    assert read_video(odd).shape == (3, 16, 18, 3)
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_gif_is_lossless_for_few_colours(tmp_path):
    video = sample_video(frames=4, size=16)
    frames = to_uint8_frames(video)
    assert read_video(write_video(video, tmp_path / "clip.gif")).shape == (4, 16, 16, 3)
    from PIL import Image

    gif = Image.open(io.BytesIO(gif_bytes(frames, fps=10)))
    assert gif.n_frames == 4 and gif.info["duration"] == 100 and gif.info["loop"] == 0


def test_bad_video_inputs_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"expected a float tensor \[F, 3, H, W\] in \[0, 1\], got \(2, 3, 8\)"):
        to_uint8_frames(torch.rand(2, 3, 8))
    with pytest.raises(ValueError, match="expected a .mp4 or .gif file name"):
        write_video(torch.rand(2, 3, 8, 8), tmp_path / "x.avi")
    with pytest.raises(FileNotFoundError, match="video file not found"):
        read_video(tmp_path / "missing.mp4")
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    with pytest.raises(ValueError, match="junk.mp4: not a readable video"):
        read_video(tmp_path / "junk.mp4")
    with pytest.raises(ValueError, match=r"expected videos \[N, F, 3, H, W\]"):
        save_video_grid(torch.rand(2, 3, 8, 8), None, tmp_path / "g.mp4")


def test_video_grid_tiles_every_frame(tmp_path):
    """Each frame of the grid MP4 is the N videos' frames side by side (cells scaled to >= 128 px) with captions."""
    videos = torch.stack([sample_video(frames=3, size=16, seed=s) for s in range(3)])
    path = save_video_grid(videos, ["a", "b", "c"], tmp_path / "grid.mp4")
    frames = read_video(path)
    assert frames.shape == (3, 128 + 12 + 4, 3 * 128, 3)  # one 12-px caption line under the cells
    cell = frames[1, :128, 128:256].astype(float)  # video 1, frame 1, scaled x8 with nearest neighbours
    expected = np.kron(to_uint8_frames(videos[1])[1].astype(float), np.ones((8, 8, 1)))
    assert np.abs(cell - expected).mean() < 6.0


def test_run_saves_video_samples_and_sends_them_to_trackers(tmp_path, monkeypatch):
    """Run.save_samples with videos [N, F, 3, H, W]: samples/step_N.mp4; TensorBoard gets one animated GIF of the
    grid per step in its image tab, W&B one MP4 video per sample."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _Cfg(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig(),
               log=TrackersConfig(trackers=["tensorboard", "wandb"]))
    run = Run(cfg)
    videos = torch.stack([sample_video(frames=4, size=16, seed=s) for s in range(2)])
    path = run.save_samples(2, videos, ["r=0.1 a", "r=0.2 b"])
    assert path == run.dir / "samples" / "step_000002.mp4" and read_video(path).shape[0] == 4
    assert run.save_samples(3, videos, None, name="eval_step_000003.png").suffix == ".mp4"
    run.finish()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.dir / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert sorted(acc.Tags()["images"]) == ["samples/eval", "samples/rollout"]
    from PIL import Image

    gif = Image.open(io.BytesIO(acc.Images("samples/rollout")[0].encoded_image_string))
    assert gif.format == "GIF" and gif.n_frames == 4 and gif.size == (2 * 128, 128)  # 2 cells scaled x8
    gif.seek(1)  # frame 1 of the grid: the second clip's frame 1 in the right-hand cell
    cell = np.asarray(gif.convert("RGB"))[:, 128:].astype(float)
    expected = np.kron(to_uint8_frames(videos[1])[1].astype(float), np.ones((8, 8, 1)))
    assert np.abs(cell - expected).mean() < 12.0  # GIF: a 256-colour palette
    media = list((run.dir / "wandb").glob("offline-run-*/files/media/videos/samples/rollout_*.mp4"))
    assert len(media) == 2 and all(read_video(m).shape == (4, 16, 16, 3) for m in media)


def _tone(hz, rate=16000, n=1600, amplitude=0.5):
    return amplitude * torch.sin(2 * torch.pi * hz * torch.arange(n) / rate)


def test_sound_is_written_as_wav_and_as_the_mp4_track(tmp_path):
    """A waveform [C, S] -> 16-bit WAV (samples x 32767, rounded; beyond [-1, 1] clipped) and an AAC track in the MP4
    (mono and stereo; 16 kHz kept, 12.5 kHz, which AAC does not take, resampled to 48 kHz)."""
    import wave

    import av

    from mmrl.pipelines.videos import write_wav

    x = torch.stack([_tone(440), 2 * _tone(880)])  # the second channel peaks at 1.0 (clipped to 32767)
    path = write_wav(x, 16000, tmp_path / "a.wav")
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (2, 2, 16000, 1600)
        pcm = np.frombuffer(w.readframes(1600), "<i2").reshape(1600, 2).T
    assert np.array_equal(pcm, np.round(np.clip(x.numpy(), -1, 1) * 32767).astype(np.int16))
    video = sample_video(frames=6, size=16)
    for sound, rate, layout, kept in [(x, 16000, "stereo", 16000), (x[:1], 12500, "mono", 48000)]:
        clip = write_video(video, tmp_path / f"{layout}.mp4", fps=24, audio=sound, sample_rate=rate)
        with av.open(str(clip)) as c:
            a = c.streams.audio[0]
            assert (a.codec_context.name, a.rate, a.layout.name) == ("aac", kept, layout)
            assert sum(f.samples for f in c.decode(audio=0)) >= 1600 * kept // rate  # (+ AAC's priming frames)
        assert read_video(clip).shape == (6, 16, 16, 3)
    with pytest.raises(ValueError, match=r"^audio: expected a waveform \[C, S\] with 1 or 2 channels, got \(3, 8\)$"):
        write_wav(torch.zeros(3, 8), 16000, tmp_path / "b.wav")
    with pytest.raises(ValueError, match=r"expected a .mp4 file name$"):
        write_video(video, tmp_path / "x.gif", audio=x, sample_rate=16000)


def test_run_saves_each_sample_with_its_sound(tmp_path):
    """Run.save_samples with `audio`: the grid as before, plus step_N_s<i>.wav and step_N_s<i>.mp4 (the sample with
    its sound) per sample; images (one frame) get the WAV only."""
    run = Run(_Cfg(algorithm="toy", output_dir=str(tmp_path / "run"), train=TrainConfig()))
    videos = torch.stack([sample_video(frames=4, size=16, seed=s) for s in range(2)])
    audio = torch.stack([_tone(440), _tone(660)])[:, None]
    path = run.save_samples(1, videos, ["a", "b"], audio=audio, sample_rate=16000, fps=24.0)
    assert path.name == "step_000001.mp4"
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["step_000001.mp4", "step_000001_s0.mp4", "step_000001_s0.wav", "step_000001_s1.mp4",
                     "step_000001_s1.wav"]
    import av

    with av.open(str(path.parent / "step_000001_s1.mp4")) as c:
        assert [s.type for s in c.streams] == ["video", "audio"] and c.streams.video[0].average_rate == 24
    run.save_samples(2, videos[:, 0], None, audio=audio, sample_rate=16000)
    assert sorted(p.name for p in path.parent.glob("step_000002*")) == [
        "step_000002.png", "step_000002_s0.wav", "step_000002_s1.wav"]
    with pytest.raises(ValueError, match=r"^save_samples: audio must be \[N, C, S\] for the 2 samples with a "
                                         r"sample_rate, got \(1, 1, 1600\) at 16000$"):
        run.save_samples(3, videos, None, audio=audio[:1], sample_rate=16000)
    run.finish()
