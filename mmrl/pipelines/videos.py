"""Videos in and out of a run: MP4 files a person can open, animated GIFs for TensorBoard, reading clips back.

Videos are float tensors [F, 3, H, W] in [0, 1] (a batch: [N, F, 3, H, W]), the layout video families decode to
and video rewards score.

- MP4 (H.264, yuv420p, crf 18) through PyAV, whose wheel ships FFmpeg with libx264 (PyAV is already installed as
  a dependency of qwen-vl-utils): opens in every browser and player, a few kB for a short clip. yuv420p needs even
  sizes, so odd frame sizes are padded by one edge row / column.
- GIF (Pillow) where a viewer only takes images: TensorBoard's image tab plays animated GIFs (torch's `add_video`
  would need moviepy, which this project does not install).
- `read_video(path)`: the frames of a video file (anything FFmpeg decodes, GIF included) as uint8 [F, H, W, 3].
- Sound (audio-video families, LTX-2): waveforms float [C, S] (1 or 2 channels, the vocoder's [-1, 1]) become a
  16-bit PCM WAV (`write_wav`, the standard library's `wave`) and an AAC track in the MP4 (`write_video(...,
  audio=, sample_rate=)`, PyAV's FFmpeg AAC encoder; a rate AAC does not take is resampled to 48 kHz in the MP4).
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

# source: diffusers' Wan examples export with export_to_video(output, fps=16); a sample of 81 frames is ~5 s
DEFAULT_FPS = 16
# sampling rates of the MPEG-4 AAC standard (ISO/IEC 14496-3 sampling_frequency_index), which FFmpeg's encoder takes
AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)


def to_uint8_frames(video: Any) -> np.ndarray:
    """A float [F, 3, H, W] tensor in [0, 1] (or a uint8 [F, H, W, 3] array) -> uint8 [F, H, W, 3]."""
    if isinstance(video, np.ndarray) and video.dtype == np.uint8 and video.ndim == 4 and video.shape[-1] == 3:
        return video
    if not isinstance(video, torch.Tensor) or video.dim() != 4 or video.shape[1] != 3:
        shape = tuple(video.shape) if hasattr(video, "shape") else type(video).__name__
        raise ValueError(f"video: expected a float tensor [F, 3, H, W] in [0, 1], got {shape}")
    arr = (video.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round()
    return arr.astype(np.uint8)


def encode_mp4(frames: np.ndarray, fps: float = DEFAULT_FPS, audio: Any = None, sample_rate: int | None = None
               ) -> bytes:
    """uint8 [F, H, W, 3] -> MP4 (H.264) bytes; with `audio` (a waveform [C, S], C = 1 or 2, at `sample_rate` Hz) an
    AAC track beside the video."""
    import av

    f, h, w, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")  # yuv420p: even sizes
    wave = None if audio is None else _waveform(audio)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps) if float(fps).is_integer() else
                                      Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = w + w % 2, h + h % 2, "yuv420p"
        stream.options = {"crf": "18"}
        sound = None
        if wave is not None:
            sound = container.add_stream("aac", rate=int(sample_rate) if sample_rate in AAC_RATES else 48000)
            sound.layout = "mono" if wave.shape[0] == 1 else "stereo"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush
            container.mux(packet)
        if sound is not None:  # PyAV resamples to the stream's rate and cuts the encoder's frames
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave), format="fltp", layout=sound.layout.name)
            chunk.sample_rate = int(sample_rate)
            for packet in [*sound.encode(chunk), *sound.encode()]:
                container.mux(packet)
    return buf.getvalue()


def _waveform(audio: Any) -> np.ndarray:
    """A waveform [C, S] (tensor or array, C = 1 or 2; [S]: one channel) -> float32 [C, S] clipped to [-1, 1]."""
    x = audio.detach().float().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio, np.float32)
    x = x[None] if x.ndim == 1 else x
    if x.ndim != 2 or x.shape[0] not in (1, 2) or x.shape[1] == 0:
        raise ValueError(f"audio: expected a waveform [C, S] with 1 or 2 channels, got {tuple(x.shape)}")
    return np.clip(x, -1.0, 1.0).astype(np.float32)


def as_pcm16(audio: torch.Tensor) -> torch.Tensor:
    """The waveform as its 16-bit WAV file (`write_wav`) holds it: clipped to [-1, 1], rounded to steps of 1 / 32767
    (what a score must see to be recomputable from the saved file)."""
    return (audio.float().clamp(-1.0, 1.0) * 32767).round() / 32767


def write_wav(audio: Any, sample_rate: int, path: str | Path) -> Path:
    """A waveform [C, S] in [-1, 1] (clipped) -> a 16-bit PCM WAV file, atomically (temp file, then rename)."""
    import io
    import wave

    x = _waveform(audio)
    pcm = (x.T * 32767).round().astype("<i2")  # interleaved channels, little-endian as WAV stores them
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(x.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(sample_rate))
        out.writeframes(pcm.tobytes())
    return _write_atomic(Path(path), buf.getvalue())


def _write_atomic(path: Path, data: bytes) -> Path:
    """`data` into `path` through a temp file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def gif_bytes(frames: np.ndarray, fps: int = DEFAULT_FPS) -> bytes:
    """uint8 [F, H, W, 3] -> animated GIF bytes (loops forever)."""
    from PIL import Image

    pils = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    pils[0].save(buf, format="GIF", save_all=True, append_images=pils[1:], duration=max(1, round(1000 / fps)),
                 loop=0)
    return buf.getvalue()


def write_video(video: Any, path: str | Path, fps: float = DEFAULT_FPS, audio: Any = None,
                sample_rate: int | None = None) -> Path:
    """Write one video (float [F, 3, H, W] in [0, 1] or uint8 [F, H, W, 3]) as `.mp4` or `.gif` (by suffix),
    atomically (temp file, then rename); `audio` [C, S] at `sample_rate`: the MP4's sound track."""
    path = Path(path)
    frames = to_uint8_frames(video)
    suffix = path.suffix.lower()
    if suffix not in (".mp4", ".gif") or (audio is not None and suffix != ".mp4"):
        raise ValueError(f"write_video: {path}: expected a .mp4{'' if audio is not None else ' or .gif'} file name")
    data = encode_mp4(frames, fps, audio, sample_rate) if suffix == ".mp4" else gif_bytes(frames, fps)
    return _write_atomic(path, data)


def read_video(path: str | Path) -> np.ndarray:
    """The frames of a video file as uint8 [F, H, W, 3] (decoded by PyAV's FFmpeg)."""
    import av

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {path}")
    try:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (av.error.FFmpegError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable video ({type(exc).__name__}: {exc})") from None
    if not frames:
        raise ValueError(f"{path}: the video has no frames")
    return np.stack(frames)
