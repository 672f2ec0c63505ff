"""LTX-2 text-to-video-with-audio (`LTX2Pipeline`, diffusers 0.42) as a FlowModel.

LTX-2's transformer denoises a video and an audio latent together (each attends to the other at every block) and
the pipeline steps both with the same sigmas, so the state this family exposes is the pair, flattened into one
tensor [B, D]: the video latents [C, F', h, w] (normalised, as the pipeline's) then the audio latents in the
pipeline's packed layout [L, C_a * M] (normalised). One flow-matching process on the pair: the samplers' SDE noises
both parts, the per-step log-probs average over both, and every recipe trains the transformer's video and audio
outputs together. `decode` gives the video [B, F, 3, H, W]; `decode_audio` the waveforms [B, 2, S] at
`audio_sample_rate` (the audio VAE's mel spectrogram through the vocoder, as the pipeline), which a rollout decodes
only when a reward component scores audio (`mmrl.rewards.audio`) and sample grids save beside their videos.

What diffusers' `LTX2Pipeline.__call__` does per step, and what this family does the same way:
- text: Gemma 3's every hidden state, stacked (`encode_prompt`, left padding to `max_sequence_length`), through the
  pipeline's `connectors` into video and audio text tokens and their mask; the negative prompt "" for CFG;
- noise: video [B, C, F', h, w] then audio [B, C_a, L, M] from the same generator (`prepare_latents`,
  `prepare_audio_latents`), L = round(num_frames / frame_rate x sample_rate / hop / 4);
- timestep 1000 sigma (also as `sigma`), `use_cross_timestep=True`, the transformer's own rotary coordinates
  (latent frames, height, width, frame rate; audio frames);
- schedule: sigmas linspace(1, 1/N, N) shifted by mu = calculate_shift(video tokens) with LTX's fallbacks (1024, 4096,
  0.95, 2.05), last sigma 0;
- guidance: CFG with the video `guidance_scale` and `audio_guidance_scale` (family option; None = the video's, as
  diffusers). The pipeline combines in x0 space with a delta, x0_c + (w - 1)(x0_c - x0_u), which is the velocity
  combination v_u + w (v_c - v_u) at the same sigma;
- decode: de-normalise (latents_mean / latents_std / scaling_factor), `AutoencoderKLLTX2Video.decode` (timestep 0
  and no decode noise when the VAE is timestep-conditioned: the pipeline's defaults), [-1, 1] -> [0, 1].
- audio decode: de-normalise (the audio VAE's latents_mean / latents_std on the packed latents), unpack to
  [B, C_a, L, M], `AutoencoderKLLTX2Audio.decode` (a mel spectrogram), `LTX2Vocoder` -> waveform.
Not covered: the pipeline's spatio-temporal guidance (STG), modality-isolation guidance and guidance rescale (each an
extra transformer pass or a non-linear rescale; the recipes run with CFG only, parity holds with `stg_scale=0,
modality_scale=1, guidance_rescale=0`); image-to-video, the two-stage upsampler, prompt enhancement; encoding videos
into latents (offline preference data), which would need the audio track too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmrl.diffusion.models.base import FlowModel, PromptEmbeds, TinyCase, register_family
from mmrl.perf import Architecture, FlopsEstimator, Pass, input_arg, register_architecture, register_flops
from mmrl.tiny import build_tiny_ltx2

Tensor = torch.Tensor

# source: Flow-Factory examples/grpo/lora/ltx2/t2av.yaml (X-GenGroup/Flow-Factory@b30dc004), `target_modules:
# "default"`: "28 Linear layers per block (video/audio attn + cross-modal attn + FFN)"; written out here (peft
# matches a suffix after a dot, so `attn1.to_q` does not reach `audio_attn1.to_q`)
_ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
LTX2_LORA_TARGETS = [f"{a}.{p}" for a in _ATTENTIONS for p in ("to_q", "to_k", "to_v", "to_out.0")] + [
    "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]


@register_family("LTX2Pipeline")
class LTX2Model(FlowModel):
    family = "ltx2"
    default_max_sequence_length = 1024  # LTX2Pipeline's max_sequence_length
    is_video = True
    has_audio = True
    option_names = ("audio_guidance_scale", "frame_rate")
    lora_target_modules = LTX2_LORA_TARGETS
    tiny_cases = (TinyCase("ltx2", build_tiny_ltx2, {"height": 32, "width": 32, "num_frames": 3,
                                                      "guidance_scale": 3.0}),)

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_sequence_length: int):
        super().__init__(pipe, device, dtype, max_sequence_length)
        self.vae_scale_factor = int(pipe.vae_spatial_compression_ratio)
        self.temporal_factor = int(pipe.vae_temporal_compression_ratio)
        self.audio_guidance_scale: float | None = None
        self.frame_rate = 24.0  # LTX2Pipeline's default frame_rate (motion_speed 1)
        self.num_frames = self.temporal_factor + 1
        # a flat state does not carry its pixel grid: every rollout size (`sigmas` / `initial_noise`, called before
        # any velocity) is remembered by the state length it gives, which `velocity` reads back (training and
        # evaluation sizes may alternate)
        self._sizes: dict[int, tuple[int, int]] = {}

    def configure(self, audio_guidance_scale: float | None = None, frame_rate: float | None = None,
                  **options: Any) -> None:
        """audio_guidance_scale: CFG scale of the audio stream (None = the rollout's guidance_scale);
        frame_rate: frames per second the video is conditioned on and its audio length follows (24)."""
        super().configure(**options)
        self.audio_guidance_scale = None if audio_guidance_scale is None else float(audio_guidance_scale)
        if frame_rate is not None:
            if float(frame_rate) <= 0:
                raise ValueError(f"model.family_options.frame_rate={frame_rate}: must be > 0 (LTX-2 uses 24)")
            self.frame_rate = float(frame_rate)

    def set_num_frames(self, num_frames: int) -> None:
        """k m + 1 frames (the VAE's temporal factor k encodes the first frame alone, then k at a time; diffusers
        rounds other counts down silently, this refuses them)."""
        k = self.temporal_factor
        if num_frames < 1 or (num_frames - 1) % k:
            raise ValueError(f"rollout.num_frames={num_frames}: the LTX-2 VAE takes {k}k+1 frames; use "
                             f"{max(1, (num_frames - 1) // k * k + 1)} or {((num_frames - 1) // k + 1) * k + 1}")
        self.num_frames = int(num_frames)

    # ------------------------------------------------------------------ layout of the state
    def _grid(self, height: int, width: int) -> tuple[int, int, int]:
        if height % 32 or width % 32:  # LTX2Pipeline.check_inputs
            raise ValueError(f"image size {height}x{width}: LTX2Pipeline takes multiples of 32")
        return ((self.num_frames - 1) // self.temporal_factor + 1, height // self.vae_scale_factor,
                width // self.vae_scale_factor)

    def audio_frames(self) -> int:
        p = self.pipe
        per_second = p.audio_sampling_rate / p.audio_hop_length / float(p.audio_vae_temporal_compression_ratio)
        return round(self.num_frames / self.frame_rate * per_second)

    def _audio_dims(self) -> tuple[int, int]:
        c = self.pipe.audio_vae.config
        return int(c.latent_channels), int(c.mel_bins) // int(self.pipe.audio_vae_mel_compression_ratio)

    def split(self, state: Tensor, height: int, width: int) -> tuple[Tensor, Tensor]:
        """State [B, D] -> video latents [B, C, F', h, w] and packed audio latents [B, L, C_a M] (both normalised)."""
        f, h, w = self._grid(height, width)
        c = self.pipe.transformer.config.in_channels
        n = c * f * h * w
        ca, m = self._audio_dims()
        if state.dim() != 2 or state.shape[1] != n + self.audio_frames() * ca * m:
            raise ValueError(f"LTX2Pipeline: a state of shape {tuple(state.shape)} is not [B, {n} + "
                             f"{self.audio_frames() * ca * m}] (video {c}x{f}x{h}x{w} at {height}x{width}, "
                             f"{self.num_frames} frames, then audio)")
        return state[:, :n].reshape(-1, c, f, h, w), state[:, n:].reshape(-1, self.audio_frames(), ca * m)

    def _state_length(self, height: int, width: int) -> int:
        f, h, w = self._grid(height, width)
        ca, m = self._audio_dims()
        return self.pipe.transformer.config.in_channels * f * h * w + self.audio_frames() * ca * m

    def _remember(self, height: int, width: int) -> None:
        n = self._state_length(height, width)
        known = self._sizes.setdefault(n, (height, width))
        if known != (height, width):
            raise ValueError(f"LTX2Pipeline: sizes {known[0]}x{known[1]} and {height}x{width} give states of the same "
                             f"length ({n}), which the family cannot tell apart; use one of them for training and "
                             f"evaluation")

    def _size_of(self, state: Tensor) -> tuple[int, int]:
        if state.shape[-1] not in self._sizes:
            raise ValueError(f"LTX2Pipeline: no rollout size gives a state of length {state.shape[-1]} (known: "
                             f"{sorted(self._sizes.values())}); sigmas / initial_noise set the size first")
        return self._sizes[state.shape[-1]]

    def join(self, video: Tensor, audio: Tensor) -> Tensor:
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    # ------------------------------------------------------------------ text
    def encode_prompts(self, prompts, images=None):
        self.check_text_only(images)
        p = self.pipe
        with torch.no_grad():
            pe, mask, _, _ = p.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                             max_sequence_length=self.max_sequence_length, device=self.device)
            video, audio, mask = p.connectors(pe, mask, padding_side=getattr(p.tokenizer, "padding_side", "left"))
        return PromptEmbeds(prompt_embeds=video.to(self.dtype), audio_prompt_embeds=audio.to(self.dtype),
                            prompt_embeds_mask=mask)

    # ------------------------------------------------------------------ denoising
    def cfg_enabled(self, guidance_scale: float) -> bool:
        audio = self.audio_guidance_scale if self.audio_guidance_scale is not None else guidance_scale
        return guidance_scale > 1.0 or audio > 1.0  # LTX2Pipeline.do_classifier_free_guidance

    def combine_cfg(self, v_uncond, v_cond, guidance_scale, sigma=None):
        out = v_uncond + guidance_scale * (v_cond - v_uncond)
        if self.audio_guidance_scale is not None:
            n = self.split(v_cond, *self._size_of(v_cond))[0][0].numel()
            out[:, n:] = v_uncond[:, n:] + self.audio_guidance_scale * (v_cond[:, n:] - v_uncond[:, n:])
        return out

    def transformer_velocity(self, latents, sigma, embeds, guidance_scale):
        height, width = self._size_of(latents)
        f, h, w = self._grid(height, width)
        video, audio = self.split(latents, height, width)
        t = sigma * self.scheduler_config.get("num_train_timesteps", 1000)
        v, a = self.transformer(
            hidden_states=self.pipe._pack_latents(video, 1, 1).to(self.dtype), audio_hidden_states=audio.to(self.dtype),
            encoder_hidden_states=embeds["prompt_embeds"], audio_encoder_hidden_states=embeds["audio_prompt_embeds"],
            timestep=t, sigma=t, encoder_attention_mask=embeds["prompt_embeds_mask"],
            audio_encoder_attention_mask=embeds["prompt_embeds_mask"], num_frames=f, height=h, width=w,
            fps=self.frame_rate, audio_num_frames=audio.shape[1], use_cross_timestep=True, return_dict=False)
        v = v.reshape(v.shape[0], f, h, w, -1).permute(0, 4, 1, 2, 3)  # tokens back to [B, C, F', h, w]
        return self.join(v, a)

    def initial_noise(self, n, height, width, generator=None):
        f, h, w = self._grid(height, width)
        self._remember(height, width)
        c = self.pipe.transformer.config.in_channels
        video = torch.randn((n, c, f, h, w), generator=generator, device=self.device, dtype=torch.float32)
        ca, m = self._audio_dims()
        audio = torch.randn((n, ca, self.audio_frames(), m), generator=generator, device=self.device,
                            dtype=torch.float32)
        return self.join(video, audio.transpose(1, 2))  # the pipeline's packing [B, L, C_a M]

    def sigmas(self, num_steps, height, width):
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        f, h, w = self._grid(height, width)
        self._remember(height, width)
        c = self.scheduler_config
        mu = calculate_shift(f * h * w, c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.95), c.get("max_shift", 2.05))
        sched = self.new_scheduler()
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return sched.sigmas.float()

    # ------------------------------------------------------------------ VAE
    def decode(self, latents, height, width):
        """State [B, D] -> videos [B, F, 3, H, W] in [0, 1] (one frame: images [B, 3, H, W]); sound: decode_audio."""
        video, _ = self.split(latents, height, width)
        vae = self.vae
        z = self.pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        t = torch.zeros(z.shape[0], device=z.device, dtype=vae.dtype) if vae.config.timestep_conditioning else None
        out = vae.decode(z.to(vae.dtype), t, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        out = (out.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
        return out[:, 0] if self.num_frames == 1 else out

    @property
    def audio_sample_rate(self) -> int:
        """Samples per second of `decode_audio`'s waveforms (the vocoder's output rate; LTX-2: 24000)."""
        return int(self.pipe.vocoder.config.output_sampling_rate)

    def decode_audio(self, latents: Tensor, height: int, width: int) -> Tensor:
        """State [B, D] -> waveforms [B, channels, samples] (float, the vocoder's range) at `audio_sample_rate`."""
        _, audio = self.split(latents, height, width)
        p, avae = self.pipe, self.pipe.audio_vae
        z = p._denormalize_audio_latents(audio, avae.latents_mean, avae.latents_std)
        z = p._unpack_audio_latents(z, audio.shape[1], num_mel_bins=self._audio_dims()[1])
        mel = avae.decode(z.to(avae.dtype), return_dict=False)[0]
        return p.vocoder(mel).float()

    def encode_images(self, images):
        raise ValueError("LTX2Pipeline: encoding videos into latents is not supported (LTX-2's latents hold the "
                         "audio track too); train on rollouts")


# ------------------------------------------------------------------ what mmrl.perf reads: FLOPs, real width


@register_flops("LTX2VideoTransformer3DModel")
def _flops(module: torch.nn.Module) -> FlopsEstimator:
    """LTX-2: per block, video tokens through self-attention, cross-attention to the video text tokens and an FFN;
    audio tokens the same with their own (narrower) layers; then audio -> video attention (video queries, audio keys)
    and video -> audio attention, both at the audio width; timestep / modulation layers once per sample."""
    cfg = module.config
    width = cfg.num_attention_heads * cfg.attention_head_dim
    audio_width = cfg.audio_num_attention_heads * cfg.audio_attention_head_dim
    n_blocks = len(module.transformer_blocks)
    rules = [("time_embed", "sample"), ("av_cross_attn", "sample"), ("audio_caption_projection", "audio_text"),
             ("caption_projection", "text"), ("audio_attn2.to_k", "audio_text"), ("audio_attn2.to_v", "audio_text"),
             ("attn2.to_k", "text"), ("attn2.to_v", "text"),
             ("audio_to_video_attn.to_k", "audio"), ("audio_to_video_attn.to_v", "audio"),
             ("audio_to_video_attn", "video"), ("video_to_audio_attn.to_k", "video"),
             ("video_to_audio_attn.to_v", "video"), ("video_to_audio_attn", "audio"), ("audio_", "audio"),
             ("", "video")]

    def shapes(args, kwargs):
        x = input_arg(args, kwargs, "hidden_states")
        a = input_arg(args, kwargs, "audio_hidden_states", 1)
        ctx = input_arg(args, kwargs, "encoder_hidden_states", 2)
        actx = input_arg(args, kwargs, "audio_encoder_hidden_states", 3)
        b, n, k, m, ma = x.shape[0], x.shape[1], a.shape[1], ctx.shape[1], actx.shape[1]
        per_block = width * (n * n + n * m) + audio_width * (k * k + k * ma + 2 * n * k)
        return Pass({"video": b * n, "audio": b * k, "text": b * m, "audio_text": b * ma, "sample": b},
                    b * n_blocks * per_block)

    return FlopsEstimator(module, rules, shapes)


def _training_row(model: torch.nn.Module, row: dict, dtype: torch.dtype) -> dict:
    """One row of the training forward: the video VAE is 8x in time ((F - 1) / 8 + 1 latent frames) and 32x in space
    with 1x1 patches; audio: round(F / fps x 16000 / 160 / 4) latent frames of 8 channels x 16 mel bins (packed to
    128); the connectors' text tokens at the Gemma width for both streams."""
    g = torch.Generator().manual_seed(0)
    c = model.config
    f, h, w = (row["num_frames"] - 1) // 8 + 1, row["height"] // 32, row["width"] // 32
    audio = round(row["num_frames"] / 24.0 * 25)
    m = row["text_tokens"]
    return {"hidden_states": torch.randn(1, f * h * w, c.in_channels, generator=g).to(dtype),
            "audio_hidden_states": torch.randn(1, audio, c.audio_in_channels, generator=g).to(dtype),
            "encoder_hidden_states": torch.randn(1, m, c.caption_channels, generator=g).to(dtype),
            "audio_encoder_hidden_states": torch.randn(1, m, c.caption_channels, generator=g).to(dtype),
            "timestep": torch.tensor([500.0]), "sigma": torch.tensor([500.0]),
            "encoder_attention_mask": torch.ones(1, m), "audio_encoder_attention_mask": torch.ones(1, m),
            "num_frames": f, "height": h, "width": w, "fps": 24.0, "audio_num_frames": audio,
            "use_cross_timestep": True, "return_dict": False}


register_architecture(Architecture(
    name="ltx2_19b", kind="ltx2", class_name="LTX2VideoTransformer3DModel",
    # diffusers 0.42.1 LTX2VideoTransformer3DModel.__init__ defaults, which are LTX-2's (the hub config was not
    # downloadable here): video 32 heads x 128 (4096), audio 32 x 64 (2048), 48 blocks, 128 latent channels each,
    # text 3840 wide (Gemma-3-12B's hidden size, LTX2TextConnectors' default caption_channels)
    config=dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                attention_head_dim=128, cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128,
                audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
                num_layers=48, caption_channels=3840),
    depth={"num_layers": 48},
    source="diffusers 0.42.1 LTX2VideoTransformer3DModel defaults = Lightricks/LTX-2 (18.88B counted: 48 blocks, "
           "video 4096 wide, audio 2048, Gemma-3-12B text 3840)",
    lora_targets=tuple(LTX2_LORA_TARGETS), recipe="configs/diffusion/flow_grpo_ltx2_t2av.yaml",
    # Flow-Factory's LTX-2 t2av GRPO run: 512 x 768, 121 frames -> 16 x 16 x 24 = 6144 video tokens, 126 audio
    # tokens, 1024 Gemma tokens (the pipeline's max_sequence_length), micro-batch 1 without CFG (guidance 1), rank 64
    step=dict(rows=1, num_frames=121, height=512, width=768, text_tokens=1024, lora_rank=64),
    # the recipe's row (7294 tokens) does not fit a CPU measurement beside other jobs: measure 9 frames (2 x 16 x 24 =
    # 768 video tokens + 9 audio + the same 1024 text tokens) and scale what a row adds by the tokens (7294 / 1801,
    # linear: flash attention on a GPU keeps no [L, L] matrix), the fixed part too: an upper bound (the text tokens
    # are the same in both rows); LoRA only, as the recipe (full fine-tuning: 8 bytes a parameter, 141 GiB, FSDP)
    measured_row=dict(num_frames=9, height=512, width=768, text_tokens=1024),
    row_scale={"*": (6144 + 126 + 1024) / (768 + 9 + 1024)},
    measure_modes=("lora",),
    inputs=_training_row,
    small_widths={"num_attention_heads": 2, "attention_head_dim": 16, "cross_attention_dim": 32,
                  "audio_num_attention_heads": 2, "audio_attention_head_dim": 8, "audio_cross_attention_dim": 16,
                  "caption_channels": 32, "in_channels": 8, "out_channels": 8, "audio_in_channels": 8,
                  "audio_out_channels": 8},
    small_row=dict(num_frames=9, height=64, width=96, text_tokens=8),
))
