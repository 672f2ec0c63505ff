"""Pieces every VLM recipe shares: load a Qwen-VL policy, turn chats with images into model inputs, and
compute per-token log-probs of response tokens in micro-batches.

Sequence layout used everywhere (rollout prefill, trainer forward, reference forward):

    [pad ... pad | prompt tokens (with expanded <|image_pad|>) | response tokens | pad ... pad]
     left padding                                                             right padding

i.e. exactly what batched generation with left padding produces, so the trainer's forward sees the
same positions as the sampler. Positions are the 3-D M-RoPE index from
``mmrl.pipelines.qwen_vl.get_rope_index`` (equal to transformers' own), passed explicitly, so no
model-internal state (``rope_deltas``) is involved. ``mm_token_type_ids`` (transformers >= 5) is built
from the ids.

Log-probs: ``log_softmax(logits / temperature)`` at the chosen tokens, in float32. This is the
convention the trainer uses for old/new/ref log-probs (verl does the same); it ignores top-k/top-p and
the vision-token ban, which only change how tokens were drawn, not what the model's distribution is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from mmrl.vlm.batch import RolloutBatch, pad_to, token_logprobs  # noqa: F401  (re-exported)
from mmrl.vlm.families import ALL_VISION_TOKENS, VISION_ATTRS, family_of_processor

__all__ = [
    "IMAGE_PLACEHOLDER",
    "EncodedPrompt",
    "load_policy",
    "messages_from_text",
    "render_prompt",
    "vision_token_ids",
    "encode_prompt",
    "collate",
    "response_logprobs",
    "compute_logprobs",
    "pad_to",
    "VisionCache",
    "vision_tower",
    "vision_tower_trainable",
    "vision_has_adapters",
]

IMAGE_PLACEHOLDER = "<image>"


def load_policy(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(model, processor) from a local checkpoint directory (never a hub id: nothing is downloaded).

    The processor pads on the left (batched generation needs it); the model is in eval mode (no dropout:
    rollout and training log-probs must agree)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.run.files import refusing_pickled_weights

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path: no config.json in {str(path)!r}; expected a local checkpoint "
                                "directory (e.g. from huggingface-cli download, or mmrl.tiny.build_tiny_qwen2_vl)")
    processor = AutoProcessor.from_pretrained(str(path), padding_side="left")
    with refusing_pickled_weights("model.path", path):  # a pickled .bin: one line naming it, not 40
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype).to(device)
    model.eval()
    return model, processor


def messages_from_text(text: str, system: str | None = None) -> list[dict]:
    """A one-turn user chat from text with ``<image>`` placeholders (one per image, in order).

    >>> messages_from_text("<image>What color?")[0]["content"]
    [{'type': 'image'}, {'type': 'text', 'text': 'What color?'}]
    """
    content: list[dict] = []
    parts = text.split(IMAGE_PLACEHOLDER)
    for i, part in enumerate(parts):
        if i > 0:
            content.append({"type": "image"})
        if part:
            content.append({"type": "text", "text": part})
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": content}]


def render_prompt(processor: Any, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """Chat template text (vision items as ``<|vision_start|><|image_pad|><|vision_end|>``)."""
    return processor.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)


def _tokenizer(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def vision_token_ids(processor: Any) -> list[int]:
    """Ids of the vision special tokens the policy must never emit (start/end/pad of images and videos, of every
    family in ``mmrl.vlm.families`` that the vocabulary has)."""
    tok = _tokenizer(processor)
    vocab = tok.get_vocab()
    return sorted({vocab[t] for t in ALL_VISION_TOKENS if t in vocab})


@dataclass
class EncodedPrompt:
    """One tokenised prompt: ids (image pads expanded), its vision tensors, and the text it came from."""

    input_ids: list[int]
    mm: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values [patches, D], image_grid_thw [n, 3]
    text: str = ""


def encode_prompt(processor: Any, text: str, images: Sequence[Any] = ()) -> EncodedPrompt:
    """Tokenise one templated prompt with its images (``<image>`` placeholders are accepted too)."""
    from mmrl.pipelines.images import load_image

    fam = family_of_processor(processor)
    text = text.replace(IMAGE_PLACEHOLDER, fam.chat_image)
    n_ph = text.count(fam.image_pad)
    images = [load_image(im) for im in images]
    if n_ph != len(images):
        raise ValueError(f"prompt has {n_ph} image placeholder(s) but {len(images)} image(s) were given: {text[:200]!r}")
    if images:
        enc = processor(text=[text], images=images, return_tensors="pt")
        mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}  # InternVL: tiles, no grid
    else:
        enc = _tokenizer(processor)([text], return_tensors="pt")
        mm = {}
    return EncodedPrompt(enc["input_ids"][0].tolist(), mm, text)


def collate(model: Any, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
            mm: Sequence[dict], pad_id: int) -> tuple[dict[str, torch.Tensor], int, torch.Tensor]:
    """Model inputs for prompt+response rows in the layout of the module docstring.

    Returns ``(kwargs for model(**kwargs), P, response_mask[B, T])`` where ``P`` is the padded prompt
    length (response token t of row b sits at position P + t) and ``T`` the longest response. (A
    :class:`mmrl.vlm.batch.RolloutBatch` of the rows: build one directly to pad once and slice many times.)
    """
    batch = RolloutBatch.build(model, prompt_ids, response_ids, mm, pad_id)
    return batch.model_inputs(model.dtype), batch.prompt_len, batch.response_mask


def response_logprobs(model: Any, batch: dict[str, torch.Tensor], P: int, response_ids: torch.Tensor,
                      temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the response tokens of one micro-batch (grad flows if enabled).

    ``batch``/``P`` from :func:`collate`; ``response_ids[B, T]`` (pad where masked). Only the response
    positions' logits are materialised (``logits_to_keep``)."""
    T = response_ids.shape[1]
    L = batch["input_ids"].shape[1]
    if L != P + T:
        raise ValueError(f"response_logprobs: batch length {L} != prompt length {P} + response length {T}")
    # logits at positions P-1 .. P+T-2 predict response tokens 0 .. T-1
    out = model(**batch, use_cache=False, logits_to_keep=T + 1)
    logits = out.logits[:, :T]
    return token_logprobs(logits, response_ids.to(logits.device), temperature, with_entropy, entropy_grad)


@torch.no_grad()
def compute_logprobs(model: Any, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                     mm: Sequence[dict], pad_id: int, micro_batch_size: int = 8, temperature: float = 1.0,
                     with_entropy: bool = False, vision_cache: "VisionCache | None" = None
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Log-probs of every response (a list of 1-D CPU tensors, one per row), in micro-batches, no grad.

    ``vision_cache``: a :class:`VisionCache` of the same model (state): each prompt's images go through the
    vision tower once, however many responses / micro-batches / passes share them."""
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    n = len(prompt_ids)
    for s in range(0, n, max(1, micro_batch_size)):
        e = min(n, s + micro_batch_size)
        batch, P, mask = collate(model, prompt_ids[s:e], response_ids[s:e], mm[s:e], pad_id)
        if vision_cache is not None:
            batch = vision_cache.apply(batch, mm[s:e])
        resp = batch["input_ids"][:, P:]
        lp, ent = response_logprobs(model, batch, P, resp, temperature, with_entropy)
        for i in range(e - s):
            k = len(response_ids[s + i])
            logps.append(lp[i, :k].cpu())
            if ent is not None:
                ents.append(ent[i, :k].cpu())
    return logps, (ents if with_entropy else None)


# ---------------------------------------------------------------------------------------------- vision cache


def vision_tower(model: Any) -> torch.nn.Module:
    """The vision encoder (``.visual``) of a Qwen2/2.5/3-VL policy, through peft / DDP wrappers."""
    for m in model.modules():
        for attr in VISION_ATTRS:  # `visual` (Qwen-VL, GLM-4.1V), `vision_tower` (InternVL)
            visual = getattr(m, attr, None)
            if isinstance(visual, torch.nn.Module) and hasattr(m, "get_image_features"):
                return visual
    raise ValueError(f"vision_tower: no module with a `.visual` encoder and get_image_features in "
                     f"{type(model).__name__} (expected a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model)")


def _vlm_base(model: Any, required: bool = True) -> torch.nn.Module | None:
    """The innermost module whose forward merges vision features (``Qwen2VLModel`` & co.); None when not
    `required` and the model has none (InternVL: its features cannot be handed in)."""
    found = None
    for m in model.modules():
        if isinstance(getattr(m, "visual", None), torch.nn.Module) and hasattr(m, "get_image_features") \
                and hasattr(m, "get_placeholder_mask"):
            found = m
    if found is None and not required:
        return None
    if found is None:
        raise ValueError(f"VisionCache: {type(model).__name__} is not a Qwen2/2.5/3-VL model (no get_image_features)")
    return found


def language_block_types(model: Any) -> list[str]:
    """The model's transformer-block class names (``_no_split_modules``) that are not in the vision tower: the
    decoder layers every forward runs. Sharding only these with FSDP2 (the vision tower stays in the root unit)
    makes text-only and image forwards issue the same collectives (see ``mmrl.distributed.LockstepForwards``)."""
    inner = model
    while not hasattr(inner, "_no_split_modules") or inner._no_split_modules is None:
        nxt = getattr(inner, "base_model", None) or getattr(inner, "model", None)
        if nxt is None or nxt is inner:
            raise ValueError(f"language_block_types: {type(model).__name__} declares no _no_split_modules")
        inner = nxt
    vision = {type(m).__name__ for m in vision_tower(model).modules()}
    blocks = [n for n in inner._no_split_modules if n not in vision]
    if not blocks:
        raise ValueError(f"language_block_types: every block type of {type(model).__name__} "
                         f"({inner._no_split_modules}) is in the vision tower")
    return blocks


def vision_tower_trainable(model: Any) -> bool:
    """True when some vision-tower parameter requires grad (LoRA on the vision blocks, or full fine-tuning)."""
    return any(p.requires_grad for p in vision_tower(model).parameters())


def vision_has_adapters(model: Any) -> bool:
    """True when the vision tower carries LoRA weights (then the reference, adapters off, sees other features)."""
    return any("lora_" in n for n, _ in vision_tower(model).named_parameters())


class VisionCache:
    """Vision-tower outputs computed once per prompt image set and reused by every forward that shows the same
    images: the ``n`` responses of a prompt, all micro-batches, and the old / reference / training passes of one
    step while the vision weights do not change.

    ``cache.apply(batch, mm_rows)`` takes a :func:`collate` batch and its rows' ``mm`` dicts and returns the same
    kwargs with ``pixel_values`` replaced by ``mm_encoder_outputs`` (transformers >= 5.23: the model's own
    merge, ``masked_scatter`` of the features into the ``<|image_pad|>`` embeddings, and Qwen3-VL's deepstack
    features, runs unchanged on them; so the language model sees exactly the embeddings of the plain path).
    Features come from ``get_image_features`` of the model's vision base, under ``torch.no_grad()``.

    Entries are keyed by the identity of a row's ``pixel_values`` tensor (the n samples of a prompt share one
    ``mm`` dict; the cache holds a reference, so the id stays unique while cached).

    Invalidation (why it is safe to leave on):
    * with grad enabled and a trainable vision tower (LoRA on vision blocks, full fine-tuning with the tower),
      ``apply`` returns the batch unchanged: the training forward recomputes the features with gradients;
    * every in-place update of a vision parameter (optimizer steps) bumps its version counter; a changed
      version clears the cache;
    * the cache does not know which adapter is active: a reference pass with LoRA on the vision tower (adapters
      off) needs its own cache (``vision_has_adapters``); the recipe creates one per state then.
    Videos are not cached (``pixel_values_videos`` pass through). Memory: one [tokens, hidden] tensor per image
    (+ deepstack levels for Qwen3-VL), e.g. 1.3k tokens x 3584 x 2 bytes = 9 MB for a 1024x1024 image on a 7B.
    """

    def __init__(self, model: Any):
        # a family without a `.visual` merge (InternVL) gets an inert cache: apply() passes batches through
        self.base = _vlm_base(model, required=False)
        self.visual = self.base.visual if self.base is not None else torch.nn.Module()
        self.entries: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]] | None]] = {}
        self.out_cls: Any = None
        self.hits = self.misses = self.vision_calls = 0
        self._versions = self._param_versions()

    def _param_versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.visual.parameters())

    def clear(self) -> None:
        self.entries.clear()
        self._versions = self._param_versions()

    def usable(self) -> bool:
        """False in a grad-enabled forward when the vision tower is trained (features must carry gradients)."""
        if self.base is None:
            return False
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.visual.parameters()))

    @torch.no_grad()
    def _fill(self, mm_rows: Sequence[dict]) -> None:
        if self._param_versions() != self._versions:  # the vision weights changed in place since the fill
            self.clear()
        todo, seen = [], set()
        for m in mm_rows:
            pv = m.get("pixel_values") if m else None
            if pv is None or id(pv) in seen:
                continue
            seen.add(id(pv))
            if id(pv) in self.entries:
                self.hits += 1
            else:
                self.misses += 1
                todo.append(m)
        if not todo:
            return
        device = next(self.visual.parameters()).device
        pixels = torch.cat([m["pixel_values"] for m in todo]).to(device)
        grid = torch.cat([m["image_grid_thw"] for m in todo]).to(device)
        out = self.base.get_image_features(pixels, grid, return_dict=True)
        self.vision_calls += 1
        self.out_cls = type(out)
        feats = list(out.pooler_output)  # one [tokens_i, hidden] tensor per image
        deep = getattr(out, "deepstack_features", None)
        deep = [list(level) for level in deep] if deep else None
        k = 0
        for m in todo:
            n_img = int(m["image_grid_thw"].shape[0])
            dk = [level[k:k + n_img] for level in deep] if deep is not None else None
            self.entries[id(m["pixel_values"])] = (m["pixel_values"], feats[k:k + n_img], dk)
            k += n_img

    def apply(self, batch: dict[str, torch.Tensor], mm_rows: Sequence[dict]) -> dict[str, Any]:
        """``batch`` with the images' cached encoder outputs instead of ``pixel_values`` (unchanged when the
        cache is not usable or the batch has no images)."""
        if "pixel_values" not in batch or not self.usable():
            return batch
        self._fill(mm_rows)
        feats: list[torch.Tensor] = []
        deep: list[list[torch.Tensor]] | None = None
        for m in mm_rows:
            pv = m.get("pixel_values") if m else None
            if pv is None:
                continue
            _, f, d = self.entries[id(pv)]
            feats += f
            if d is not None:
                deep = deep or [[] for _ in d]
                for level, part in zip(deep, d):
                    level += part
        out = {k: v for k, v in batch.items() if k != "pixel_values"}
        kw: dict[str, Any] = {"pooler_output": tuple(feats)}
        if deep is not None:
            kw["deepstack_features"] = [tuple(level) for level in deep]
        out["mm_encoder_outputs"] = {"image": self.out_cls(**kw)}
        return out
