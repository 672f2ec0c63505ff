"""The FlowModel interface, the prompt-embedding cache and the model-family registry.

A family is a FlowModel subclass in its own file of this package, registered under the diffusers pipeline
class that `model_index.json` names (`_class_name`):

    @register_family("QwenImagePipeline")
    class QwenImageModel(FlowModel):
        family = "qwen_image"
        def encode_prompts(self, prompts): ...
        def transformer_velocity(self, latents, sigma, embeds, guidance_scale): ...
        def initial_noise(self, n, height, width, generator=None): ...
        def sigmas(self, num_steps, height, width): ...
        def decode(self, latents, height, width): ...

`mmrl.diffusion.models` imports every module of the package, so the new file is the only change needed.

Video families (`is_video = True`, e.g. Wan) keep latents [B, C, F, h, w] and decode to videos [B, F, 3, H, W] in
[0, 1] when `num_frames > 1` (`load_flow_model(..., num_frames=N)` / `set_num_frames`); every sampler, log-prob and
loss reduces over all non-batch dimensions, so the same code serves both ranks. A family whose classifier-free
guidance differs from `v_u + w (v_c - v_u)` for `w > 1` overrides `cfg_enabled` / `combine_cfg`; family-specific
settings (`model.family_options` in a recipe) are the keyword arguments of `configure`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

Tensor = torch.Tensor

# source: flow_grpo scripts/train_sd3.py (LoRA target modules for SD3 / FLUX joint-attention blocks)
ATTENTION_LORA_TARGETS = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]


class PromptEmbeds(dict):
    """Conditioning of a batch: name -> tensor with the batch on dim 0 (e.g. `prompt_embeds` [N, L, D],
    `pooled_prompt_embeds` [N, D], an edit model's source-image latents `image_latents` [N, C, h, w]).
    `select(idx)` picks / repeats rows; `cat` stacks batches.

    Variable-length text: a tensor `<key>` [N, L, ...] with a mask `<key>_mask` [N, L] (1 = token, 0 = padding)
    may differ in L between the batches `cat` stacks; the shorter ones are zero-padded (mask 0) to the longest."""

    def select(self, index: Sequence[int] | Tensor) -> "PromptEmbeds":
        idx = torch.as_tensor(index, dtype=torch.long)
        return PromptEmbeds({k: v[idx.to(v.device)] for k, v in self.items()})

    def __len__(self) -> int:  # number of prompts, not of keys
        return int(next(iter(self.values())).shape[0]) if dict.__len__(self) else 0

    @staticmethod
    def cat(parts: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        out = {}
        for k in parts[0].keys():
            tensors = [p[k] for p in parts]
            shapes = {tuple(t.shape[1:]) for t in tensors}
            if len(shapes) > 1:
                masked = (k.endswith("_mask") and k[: -len("_mask")] in parts[0]) or f"{k}_mask" in parts[0]
                if not masked or len({s[1:] for s in shapes}) > 1:
                    raise ValueError(f"PromptEmbeds.cat: '{k}' has different shapes {sorted(shapes)} across the "
                                     f"batches (only a text tensor with a '<key>_mask' may differ in length; an edit "
                                     f"model's source images of one batch must share one size)")
                n = max(s[0] for s in shapes)  # zero padding (mask 0) up to the longest row
                tensors = [torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [0, n - t.shape[1]]) for t in tensors]
            out[k] = torch.cat(tensors)
        return PromptEmbeds(out)


@dataclass(frozen=True)
class TinyCase:
    """A tiny random checkpoint of a family (its real classes at tiny sizes, built by an `mmrl.tiny` builder) and the
    rollout to run on it. The recipe tests (every recipe on every case), the golden metrics (each family's first case)
    and benchmarks/families.py read the cases of every registered family (`tiny_cases()`)."""

    name: str
    """Unique over all families (`sd3`, `wan22_a14b`): test ids, benchmark rows."""
    build: Callable[..., Path]
    """The mmrl.tiny builder (`build(path, **options) -> path`; `mmrl tiny DIR` builds it too)."""
    rollout: dict[str, Any]
    """Rollout keys: the smallest `height` / `width` its latent grid takes, `num_frames` (video), a `guidance_scale`."""
    options: dict[str, Any] = field(default_factory=dict)
    """The builder's keyword arguments (e.g. a variant)."""
    pipeline: str = ""
    """The pipeline class the family is registered under (filled by `tiny_cases()`)."""

    def build_at(self, path: str | Path) -> Path:
        return self.build(path, **self.options)


class FlowModel:
    """A diffusers flow-matching pipeline seen as encode / velocity / decode. Subclasses set
    `lora_target_modules` and implement the abstract methods below.

    Conditioning beyond text (edit models) travels inside `PromptEmbeds`: `encode_prompts(prompts, images=...)`
    returns rows that also hold the source image's latents (and whatever else the family's transformer needs),
    so every sampler and recipe passes it along untouched; `negative_rows(embeds)` builds the unconditional CFG
    branch of the same rows (an edit model keeps the source image there)."""

    lora_target_modules: list[str] = ATTENTION_LORA_TARGETS
    family: str = "flow"
    default_max_sequence_length: int = 512  # text tokens when load_flow_model is not given one
    has_guidance_embedding: bool = False  # FLUX-dev: guidance goes into the transformer, not CFG
    needs_source_image: bool = False  # edit models: encode_prompts(prompts, images) needs one source image per prompt
    has_unused_parameters: bool = False  # parameters no output depends on: DDP must find unused parameters
    is_video: bool = False  # latents [B, C, F, h, w]; decode gives [B, F, 3, H, W] when num_frames > 1
    has_audio: bool = False  # audio-video families: decode_audio(latents, h, w) -> waveforms [B, C, S]
    num_frames: int = 1  # frames per sample (> 1 only for video families; set_num_frames)
    option_names: tuple[str, ...] = ()  # the keywords `configure` takes (model.family_options)
    tiny_cases: tuple[TinyCase, ...] = ()  # declared by each registered class itself (not inherited): see TinyCase

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_sequence_length: int):
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = int(max_sequence_length)
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.scheduler_config = dict(pipe.scheduler.config)
        blocks = self.vae.config.get("block_out_channels")  # 2-D VAEs; video VAEs state their spatial factor
        self.vae_scale_factor = (2 ** (len(blocks) - 1) if blocks
                                 else int(self.vae.config.get("scale_factor_spatial", 8)))
        self._negative: PromptEmbeds | None = None
        self._cfg_memo: tuple[PromptEmbeds, PromptEmbeds] | None = None  # (embeds, [negative; embeds])

    # ------------------------------------------------------------------ text
    def encode_prompts(self, prompts: list[str], images: Tensor | None = None) -> PromptEmbeds:
        """Conditioning rows of `prompts`. Edit models (`needs_source_image`) take `images` float [N, 3, H, W] in
        [0, 1], one source image per prompt, already at the size to condition on; text-to-image models take none."""
        raise NotImplementedError

    def check_text_only(self, images: Tensor | None) -> None:
        """What a text-to-image / -video family's `encode_prompts` calls first: a source image given anyway is a
        mistake, not ignored."""
        if images is not None:
            edit = sorted(k for k, v in MODEL_FAMILIES.items() if v.needs_source_image)
            raise ValueError(f"{type(self.pipe).__name__} generates from text only: it takes no source images (edit "
                             f"pipelines: {edit})")

    def encode_empty_prompt(self) -> PromptEmbeds:
        """The empty prompt's rows, the unconditional CFG branch (`negative_embeds` encodes it once); an edit family
        whose text encoder does not see the source image encodes the text alone here."""
        return self.encode_prompts([""])

    def negative_embeds(self, n: int) -> PromptEmbeds:
        """Embeddings of the empty prompt (the unconditional CFG branch), encoded once, repeated n times."""
        if self._negative is None:
            self._negative = self.encode_empty_prompt()
        return self._negative.select([0] * n)

    # ------------------------------------------------------------------ denoising
    def velocity(self, latents: Tensor, sigma: Tensor | float, embeds: PromptEmbeds,
                 guidance_scale: float = 1.0, cfg: bool | None = None) -> Tensor:
        """Predicted velocity (noise - x0) at noise level sigma (scalar or [B]), fp32, latents' shape.

        With cfg (default: guidance_scale > 1 for models without a guidance embedding) the empty
        prompt and the prompt go through the transformer as one doubled batch:
        v = v_uncond + guidance_scale * (v_cond - v_uncond).
        """
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).expand(b)
        if cfg is None:
            cfg = self.cfg_enabled(guidance_scale)
        if cfg:
            both = self._with_negative(embeds)
            v = self.transformer_velocity(torch.cat([latents, latents]), torch.cat([sigma, sigma]), both,
                                          guidance_scale)
            v_uncond, v_cond = v.float().chunk(2)
            return self.combine_cfg(v_uncond, v_cond, guidance_scale, sigma=sigma)
        return self.transformer_velocity(latents, sigma, embeds, guidance_scale).float()

    def cfg_enabled(self, guidance_scale: float) -> bool:
        """Whether `guidance_scale` turns classifier-free guidance on (diffusers' rule for this family's pipeline)."""
        return guidance_scale > 1.0 and not self.has_guidance_embedding

    def combine_cfg(self, v_uncond: Tensor, v_cond: Tensor, guidance_scale: float,
                    sigma: Tensor | None = None) -> Tensor:
        """The guided velocity from the two branches: v_u + w (v_c - v_u) unless a family's pipeline differs (Z-Image's
        scale convention; Wan 2.2 A14B's second scale for the low-noise expert, chosen by sigma [B])."""
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def negative_rows(self, embeds: PromptEmbeds) -> PromptEmbeds:
        """The unconditional CFG branch for each row of `embeds`: the empty prompt (encoded once) for text-to-image
        families; edit families override it to keep each row's source image."""
        return self.negative_embeds(len(embeds))

    def _with_negative(self, embeds: PromptEmbeds) -> PromptEmbeds:
        """[empty-prompt rows; embeds] for the CFG batch. Samplers and trainers call `velocity` many times in
        a row with the same `embeds` object (every step of a rollout, every trained step of a micro-batch), so
        the last concatenation is remembered (by identity) instead of rebuilt per call."""
        memo = self._cfg_memo
        if memo is not None and memo[0] is embeds:
            return memo[1]
        both = PromptEmbeds.cat([self.negative_rows(embeds), embeds])
        self._cfg_memo = (embeds, both)
        return both

    def transformer_velocity(self, latents: Tensor, sigma: Tensor, embeds: PromptEmbeds,
                             guidance_scale: float) -> Tensor:
        """The transformer on exactly this batch (no CFG: `velocity` doubles the batch for it) with the pipeline's
        keyword arguments and timestep convention; the prediction as the velocity (noise - x0), latents' shape."""
        raise NotImplementedError

    def initial_noise(self, n: int, height: int, width: int, generator: torch.Generator | None = None) -> Tensor:
        raise NotImplementedError

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        raise NotImplementedError

    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        raise NotImplementedError

    def idle_experts(self, num_steps: int, height: int, width: int, steps: tuple[int, int]) -> list[str]:
        """The experts no sampling step in [steps[0], steps[1]) runs through (so they get no gradient in a recipe
        that trains those steps). One transformer: none; a family with several experts (Wan 2.2 A14B) overrides."""
        return []

    def set_num_frames(self, num_frames: int) -> None:
        """Frames per sample; an image family takes only 1 (video families check what their VAE can take)."""
        if num_frames != 1:
            raise _image_only_error(type(self.pipe).__name__, num_frames)
        self.num_frames = 1

    def configure(self, **options: Any) -> None:
        """Family-specific settings (`model.family_options`): a family overrides this taking its keywords (named in
        `option_names`) and passes the rest here, where any left is an error."""
        if options:
            valid = f"valid: {list(self.option_names)}" if self.option_names else "it takes none"
            raise ValueError(f"model.family_options: {sorted(options)} not known to {type(self.pipe).__name__} "
                             f"({valid})")

    @property
    def sigma_shift(self) -> float:
        """The scheduler's static time shift (sigma -> shift s / (1 + (shift - 1) s)), for training-time noise
        levels drawn outside a rollout schedule (DPO)."""
        return float(self.scheduler_config.get("shift", 1.0))

    def new_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)

    # --- families whose transformer sees 2x2 latent patches as tokens (FLUX.1, Kontext, Qwen-Image): latents stay
    # [B, C, h, w] outside, so samplers and log-probs see one layout for every family
    def pack_tokens(self, *latents: Tensor) -> Tensor:
        """[B, C, h, w] latents (the noisy ones, then any condition latents) -> [B, sum of (h/2)(w/2), 4C] tokens in
        the model dtype, concatenated on the sequence dim (the pipelines' `_pack_latents`)."""
        out = []
        for x in latents:
            b, c, h, w = x.shape
            out.append(self.pipe._pack_latents(x.to(self.dtype), b, c, h, w))
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]

    @staticmethod
    def unpack_tokens(out: Tensor, c: int, h: int, w: int) -> Tensor:
        """The first (h/2)(w/2) tokens of a prediction [B, N, 4C] back to [B, C, h, w] (inverse of `pack_tokens`; any
        condition tokens after them are dropped, as the edit pipelines slice)."""
        b = out.shape[0]
        return out[:, : (h // 2) * (w // 2)].reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(
            b, c, h, w)

    def packed_noise(self, n: int, height: int, width: int, generator: torch.Generator | None) -> Tensor:
        h, w = self.latent_hw(height, width, 2)
        c = self.transformer.config.in_channels // 4
        return torch.randn((n, c, h, w), generator=generator, device=self.device, dtype=torch.float32)

    def packed_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """`shifted_sigmas` with the shift computed from the target's tokens (the pipelines use the noisy latents'
        sequence length, condition tokens excluded)."""
        h, w = self.latent_hw(height, width, 2)
        return self.shifted_sigmas(num_steps, (h // 2) * (w // 2))

    def shifted_sigmas(self, num_steps: int, image_seq_len: int) -> Tensor:
        """The FLUX / Qwen-Image pipelines' schedule: sigmas linspace(1, 1/N, N) through the scheduler with the
        resolution-dependent shift mu = calculate_shift(image tokens) (`use_dynamic_shifting` configs)."""
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = self.scheduler_config
        mu = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched = self.new_scheduler()
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return sched.sigmas.float()

    def latent_hw(self, height: int, width: int, multiple: int = 1) -> tuple[int, int]:
        f = self.vae_scale_factor * multiple
        if height % f or width % f:
            raise ValueError(f"image size {height}x{width} must be a multiple of {f} for this model")
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images float [B, 3, H, W] in [0, 1] -> latents [B, C, h, w] fp32 as the flow model sees them:
        VAE posterior mean, then (z - shift_factor) * scaling_factor (the inverse of `decode`'s scaling)."""
        cfg = self.vae.config
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.vae.dtype)
        z = self.vae.encode(x).latent_dist.mean.float()
        return (z - (getattr(cfg, "shift_factor", None) or 0.0)) * cfg.scaling_factor

    def vae_decode(self, latents: Tensor) -> Tensor:
        cfg = self.vae.config
        z = latents / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
        image = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


class PromptEmbedCache:
    """`model.encode_prompts` with an LRU cache keyed by prompt text, for training on a fixed prompt set.

        cache = PromptEmbedCache(model, max_size=1024)
        emb = cache(["a red circle", "a blue square"])   # like model.encode_prompts(...), rows in order

    Missing prompts are encoded one at a time, so a prompt's embedding never depends on which prompts shared
    its batch (text encoders are not bitwise batch-invariant, and a resumed run starts with an empty cache:
    this keeps resumed runs bit-identical). Rows are kept on the CPU (SD3.5: ~2.7 MB per prompt in bf16,
    FLUX: ~4 MB) and moved to the model's device per call. `hits` / `misses` count prompt look-ups."""

    def __init__(self, model: FlowModel, max_size: int = 1024):
        if max_size < 1:
            raise ValueError(f"PromptEmbedCache: max_size must be >= 1, got {max_size}")
        self.model, self.max_size = model, int(max_size)
        self._rows: OrderedDict[str, PromptEmbeds] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def __call__(self, prompts: Sequence[str]) -> PromptEmbeds:
        rows = []
        for p in prompts:
            row = self._rows.get(p)
            if row is None:
                self.misses += 1
                row = PromptEmbeds({k: v.to("cpu") for k, v in self.model.encode_prompts([p]).items()})
                self._rows[p] = row
                if len(self._rows) > self.max_size:
                    self._rows.popitem(last=False)
            else:
                self.hits += 1
                self._rows.move_to_end(p)
            rows.append(row)
        return PromptEmbeds({k: v.to(self.model.device) for k, v in PromptEmbeds.cat(rows).items()})



MODEL_FAMILIES: dict[str, type[FlowModel]] = {}  # diffusers pipeline class name -> FlowModel subclass


def register_family(class_name: str) -> Callable[[type[FlowModel]], type[FlowModel]]:
    """Class decorator: `load_flow_model` builds this FlowModel subclass for a pipeline directory whose
    model_index.json has `"_class_name": class_name`; the pipeline itself is `diffusers.<class_name>`."""

    def add(cls: type[FlowModel]) -> type[FlowModel]:
        if not (isinstance(cls, type) and issubclass(cls, FlowModel)):
            raise TypeError(f"register_family('{class_name}'): {cls!r} is not a FlowModel subclass")
        known = MODEL_FAMILIES.get(class_name)
        if known is not None and known is not cls:
            raise ValueError(f"register_family: pipeline class '{class_name}' is already registered to "
                             f"{known.__module__}.{known.__qualname__}")
        MODEL_FAMILIES[class_name] = cls
        return cls

    return add


def available_families() -> list[str]:
    """Pipeline class names `load_flow_model` accepts (model_index.json `_class_name`), sorted."""
    return sorted(MODEL_FAMILIES)


def tiny_cases() -> dict[str, TinyCase]:
    """Every registered family's tiny cases (each class's own `tiny_cases`, not a parent's), by case name, the
    families in `available_families()` order; `case.pipeline` names the family."""
    out: dict[str, TinyCase] = {}
    for class_name in available_families():
        for case in vars(MODEL_FAMILIES[class_name]).get("tiny_cases", ()):
            if case.name in out:
                raise ValueError(f"tiny case {case.name!r} of {class_name} is also {out[case.name].pipeline}'s")
            out[case.name] = replace(case, pipeline=class_name)
    return out


def _image_only_error(class_name: str, num_frames: int) -> ValueError:
    video = sorted(k for k, v in MODEL_FAMILIES.items() if v.is_video)
    return ValueError(f"rollout.num_frames={num_frames}: {class_name} generates images, so num_frames must be 1 "
                      f"(video pipelines: {video})")


def check_num_frames(path: str | Path, num_frames: int) -> None:
    """`rollout.num_frames` > 1 with an image family (read from model_index.json, no weights loaded): one line
    naming the family, before anything is loaded for the run. A missing folder is left to the model load."""
    if num_frames != 1 and (Path(path) / "model_index.json").is_file():
        cls = flow_model_class(path)
        if not cls.is_video:
            raise _image_only_error(next(k for k, v in MODEL_FAMILIES.items() if v is cls), num_frames)


def flow_model_class(path: str | Path, key: str = "model.path") -> type[FlowModel]:
    """The FlowModel subclass of a local pipeline directory (its model_index.json `_class_name`), without loading
    any weights; clear errors naming the config `key` for an empty value, a missing directory or an unknown
    pipeline class (naming the supported ones)."""
    expected = ("expected a local diffusers pipeline directory (with model_index.json, e.g. written by "
                "StableDiffusion3Pipeline.save_pretrained, a downloaded stabilityai/stable-diffusion-3.5-medium "
                "snapshot, or mmrl.tiny.build_tiny_sd3(path))")
    if not str(path).strip():  # Path('') is '.', the current directory: say what was given
        raise FileNotFoundError(f"{key} is empty: {expected}")
    path = Path(path)
    index = path / "model_index.json"
    if not path.is_dir() or not index.is_file():
        what = "does not exist" if not path.exists() else "has no model_index.json"
        raise FileNotFoundError(f"{key} '{path}' {what}: {expected}")
    cls_name = json.loads(index.read_text()).get("_class_name", "")
    if cls_name not in MODEL_FAMILIES:
        raise ValueError(f"{key} '{path}': pipeline class '{cls_name}' is not supported; "
                         f"supported: {available_families()}")
    return MODEL_FAMILIES[cls_name]


def load_flow_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    max_sequence_length: int | None = None, num_frames: int = 1,
                    family_options: dict[str, Any] | None = None, key: str = "model.path") -> FlowModel:
    """Load a local diffusers pipeline directory as a FlowModel (family chosen by model_index.json); errors name
    the config `key` that gave `path`.

    Text encoders and VAE are frozen (requires_grad False, eval mode); the transformer is left frozen
    too - adapters (or full fine-tuning) decide what trains. The VAE stays fp32 (as Flow-GRPO).
    `num_frames`: frames per sample (video families; images: 1). `family_options`: the family's `configure`
    keywords (e.g. Wan 2.2 A14B's guidance_scale_2).
    """
    import diffusers

    from mmrl.run.files import refusing_pickled_weights

    model_cls = flow_model_class(path, key)
    path = Path(path)
    cls_name = next(name for name, cls in MODEL_FAMILIES.items() if cls is model_cls)
    if int(num_frames) != 1 and not model_cls.is_video:  # fail before loading the weights
        raise _image_only_error(cls_name, int(num_frames))
    with refusing_pickled_weights(key, path):  # a pickled .bin: one line naming it, not 40
        pipe = getattr(diffusers, cls_name).from_pretrained(str(path), dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
            module.eval()
            module.to(device)
    if pipe.vae.dtype != torch.float32:
        pipe.vae.to(dtype=torch.float32)
    if max_sequence_length is None:
        max_sequence_length = model_cls.default_max_sequence_length
    model = model_cls(pipe, torch.device(device), dtype, max_sequence_length)
    model.set_num_frames(int(num_frames))
    model.configure(**(family_options or {}))
    return model
