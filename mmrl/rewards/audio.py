"""Audio rewards: the sound of an audio-video family's sample (LTX-2), waveforms [B, C, S] + sample rate -> scores [B].

```python
load("audio_loudness")                                   # mean power of the waveform, in dB
load("audio_loudness", low_hz=100, high_hz=1000)         # only the power between 100 Hz and 1 kHz
r(audio=waveforms, sample_rate=24000)                    # waveforms [B, C, S] (or [B, S]) float
```

The flag on the reward protocol: `kind == "audio"` (beside "image" / "video" / "latent" / "text"). An audio reward is
called with `audio=` and `sample_rate=` (images are not taken). Recipes (`mmrl.diffusion.rollout.rollout_and_score`,
evaluations and sample grids): when a component of `reward.components` is an audio reward the rollout also decodes
the sound (`FlowModel.decode_audio`: LTX-2's audio VAE and vocoder) and the composite hands each component its own
input (videos to video rewards, waveforms to audio rewards); without one the sound is never decoded. When every
component scores audio the video is not decoded either. A family without sound is refused when the run starts
(`check_audio_rewards`).

- `audio_loudness`: 10 log10(P + 1e-10) dB, P the waveform's mean power (mean of x^2 over channels and samples; a
  sine of amplitude A: A^2 / 2, -3.01 dB at A = 1; silence: -100 dB). With `low_hz` / `high_hz`, P is the power of
  the frequencies in [low_hz, high_hz] only (Parseval over each channel's real FFT: the band's share of the mean
  power). No weights. Higher = louder; give it a negative weight to ask for quiet.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, _check_len, register

FLOOR = 1e-10  # power of silence: -100 dB


def to_audio_tensor(audio: Any, sample_rate: Any, name: str = "audio reward") -> torch.Tensor:
    """Waveforms as a float [B, C, S] tensor ([B, S]: one channel) with a positive sample rate; one line naming what
    is wrong."""
    if audio is None:
        raise ValueError(f"reward '{name}' scores sound: pass audio=<waveforms [B, C, S]> and sample_rate=<Hz> (a "
                         f"recipe passes an audio-video family's decoded sound itself)")
    if not isinstance(audio, torch.Tensor):
        raise TypeError(f"reward '{name}': audio must be a tensor [B, C, S], got {type(audio).__name__}")
    if audio.dim() == 2:
        audio = audio.unsqueeze(1)
    if audio.dim() != 3 or audio.shape[0] == 0 or audio.shape[2] == 0:
        raise ValueError(f"reward '{name}': expected waveforms [B, C, S] with B, S > 0, got {tuple(audio.shape)}")
    if not audio.is_floating_point() or not bool(torch.isfinite(audio).all()):
        raise ValueError(f"reward '{name}': waveforms must be finite floats, got {audio.dtype} with "
                         f"{int((~torch.isfinite(audio.float())).sum())} non-finite values")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or sample_rate <= 0:
        raise ValueError(f"reward '{name}': sample_rate must be a positive number of Hz, got {sample_rate!r}")
    return audio


class AudioRewardModel(RewardModel):
    """Base class of audio rewards: `__call__(audio=[B, C, S], sample_rate=Hz, prompts, metadata)` checks the
    waveforms (`to_audio_tensor`), splits them into chunks of `batch_size` and calls `score_audio`."""

    kind = "audio"

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None,
                 audio: Any = None, sample_rate: Any = None) -> RewardOutput:
        x = to_audio_tensor(audio, sample_rate, self.name)
        n = x.shape[0]
        if self.needs_prompts and prompts is None:
            raise ValueError(f"reward '{self.name}' needs prompts (one per waveform)")
        prompts, metadata = _check_len(prompts, n, "prompts", self.name), _check_len(metadata, n, "metadata", self.name)
        return self._chunked(n, lambda s: self.score_audio(x[s], float(sample_rate),
                                                           None if prompts is None else prompts[s],
                                                           None if metadata is None else metadata[s]))

    def score_audio(self, audio: torch.Tensor, sample_rate: float, prompts: list[str] | None,
                    metadata: list[dict] | None) -> RewardOutput:
        raise NotImplementedError


@register("audio_loudness")
class AudioLoudness(AudioRewardModel):
    """Mean power of the waveform (or of one frequency band) in dB (module docstring)."""

    name = "audio_loudness"
    unit = "dB (mean power of the waveform)"
    score_range = (-100.0, None)

    def __init__(self, low_hz: float | None = None, high_hz: float | None = None, batch_size: int = 32,
                 device: Any = None):
        lo, hi = 0.0 if low_hz is None else float(low_hz), float("inf") if high_hz is None else float(high_hz)
        if not 0 <= lo < hi:
            raise ValueError(f"audio_loudness: need 0 <= low_hz < high_hz, got low_hz={low_hz}, high_hz={high_hz}")
        self.band = None if low_hz is None and high_hz is None else (lo, hi)
        self.batch_size = int(batch_size)
        if self.band is not None:
            self.name = f"audio_loudness({lo:g}-{hi:g} Hz)"

    def power(self, audio: torch.Tensor, sample_rate: float) -> torch.Tensor:
        """Mean power [B] of waveforms [B, C, S], within [low_hz, high_hz] when a band is set."""
        x = audio.float()
        if self.band is None:
            return x.pow(2).mean(dim=(1, 2))
        s = x.shape[-1]
        spec = torch.fft.rfft(x, dim=-1).abs().pow(2)  # [B, C, S // 2 + 1]
        # one-sided spectrum: every bin but DC (and Nyquist for even S) stands for two conjugate bins
        weight = torch.full((spec.shape[-1],), 2.0, device=x.device)  # (on the waveform's device: CUDA too)
        weight[0] = 1.0
        if s % 2 == 0:
            weight[-1] = 1.0
        freqs = torch.fft.rfftfreq(s, d=1.0 / sample_rate, device=x.device)
        weight = weight * ((freqs >= self.band[0]) & (freqs <= self.band[1]))
        return (spec * weight).sum(-1).mean(1) / s ** 2

    def score_audio(self, audio, sample_rate, prompts, metadata):
        p = self.power(audio, sample_rate)
        return RewardOutput(10 * torch.log10(p + FLOOR), {"power": p})


# ------------------------------------------------------------------------------------- what recipes ask


def takes_audio(reward: Any) -> bool:
    """Whether `reward` (or a component of a composite) scores sound: the rollout then decodes it and passes
    `audio=` / `sample_rate=`."""
    return getattr(reward, "kind", None) == "audio" or any(
        getattr(c, "kind", None) == "audio" for c in getattr(reward, "components", {}).values())


def check_audio_rewards(components: Mapping[str, Any], family_has_audio: Callable[[], tuple[str, bool] | None],
                        model_path: Any, where: str = "reward.components") -> None:
    """An audio reward among `components` (a `reward.components` mapping, or a loaded reward's components) while the
    policy makes no sound: one line naming the component, the family and the fix. `family_has_audio()` -> (family,
    has_audio) of the policy, asked only when a component scores audio (None: unknown yet, nothing checked)."""
    from mmrl.rewards.registry import lookup

    if "components" in components and isinstance(components["components"], Mapping):
        components = components["components"]  # {components: {...}, normalize: ...}
    for key, spec in components.items():
        if isinstance(spec, RewardModel):
            audio = spec.kind == "audio"
        else:
            name = spec.get("reward", spec.get("name", key)) if isinstance(spec, Mapping) else key
            cls = lookup(str(name))
            audio = isinstance(cls, type) and issubclass(cls, AudioRewardModel)
        policy = family_has_audio() if audio else None
        if policy is not None and not policy[1]:
            raise ValueError(f"{where}.{key} scores sound, but model.path '{model_path}' ({policy[0]}) makes none; "
                             f"audio rewards need an audio-video family (LTX2Pipeline)")
