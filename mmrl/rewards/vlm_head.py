"""A Qwen2-VL / Qwen2.5-VL backbone with reward head(s), read from a reward model's one-file state dict: the layout
HPSv3 (MizzenAI/HPSv3) and EditReward (TIGER-AI-Lab/EditReward) release, and VideoAlign's (KwaiVGI/VideoAlign: the
same model wrapped by PEFT, LoRA kept apart; `lora_scale=` merges it at load).

Those authors subclass `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration`, add a special
token (`<|Reward|>`) to the base model's tokenizer (embeddings resized to the tokenizer's new length), put an MLP
`rm_head` (or `rm_heads.head_<i>`) on the last hidden state, and read the head's output at the special token. The
checkpoint is the whole model's `state_dict()`; the base model directory (config.json + processor files, e.g.
Qwen/Qwen2-VL-7B-Instruct; its weights are not needed) gives the architecture, tokenizer and chat template.

    bb = QwenVLRewardBackbone(ckpt_file, base_dir, what="hpsv3", head_prefixes=["rm_head."], dtype=torch.bfloat16)
    texts = bb.chat_texts([[{"type": "image"}, {"type": "text", "text": "..."}], ...])   # one conversation per row
    batch = bb.encode(texts, images=bb.resize(images_01, 256 * 28 * 28, 256 * 28 * 28))
    hidden = bb.token_hidden(batch)              # [B, K, H] float32: last hidden state at each reward token
    out = bb.heads["rm_head."](hidden[:, 0])     # [B, output_dim]

Videos: `encode(texts, videos=frames)` with {"type": "video"} items in the conversations; token_hidden feeds the
processor's `pixel_values_videos` / `video_grid_thw` to the vision tower the same way. Several reward tokens per row
(VideoAlign's three): `reward_tokens=` in their tokenizer order, `token_hidden` gives one hidden state per token.

Facts kept from the authors' forward (hpsv3/model/qwen2vl_trainer.py, EditReward/model/qwen2_5_vl_trainer.py):
the text decoder is called with `inputs_embeds` and no position ids, so it gets plain 1-D positions (0..L-1 on all
three M-RoPE axes, not the image-aware 3-D positions of generation); padding is on the right; the head runs in
float32 on the final-norm hidden state (VideoAlign's runs in the model's dtype: the caller casts it). Checkpoints in
transformers 4.45 names (`visual.*`, `model.*`) and 4.5x+ names (`model.visual.*`, `model.language_model.*`) both load;
`lm_head.weight` is not needed and is dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from mmrl.rewards.image._common import load_state_dict_file, load_strict, require_path

FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def find_checkpoint(weights: Any, names: Sequence[str], what: str, download: str) -> Path:
    """The checkpoint file: `weights` itself when it is a file, else the first of `names` inside the directory
    `weights`; FileNotFoundError naming the path and the expected file names otherwise."""
    p = require_path(weights, what, download)
    if p.is_file():
        return p
    for name in names:
        if (p / name).is_file():
            return p / name
    raise FileNotFoundError(f"{what}: no checkpoint in '{p}': expected one of {list(names)} there (or pass the "
                            f"file itself as weights=); download {download}")


# checkpoint key prefix -> transformers 5 `Qwen*VLModel` prefix, first match wins: 5.x ForConditionalGeneration names,
# 4.45 names, and the Qwen*VLModel's own (what merge_lora returns)
_RENAMES = (("model.visual.", "visual."), ("model.language_model.", "language_model."), ("visual.", "visual."),
            ("language_model.", "language_model."), ("model.", "language_model."))
PEFT_PREFIX = "base_model.model."


def model_key(key: str) -> str | None:
    """The transformers 5 `Qwen*VLModel` name of a checkpoint's backbone key; None for other keys (heads, lm_head)."""
    old, new = next(((o, n) for o, n in _RENAMES if key.startswith(o)), (None, None))
    return None if old is None else new + key[len(old):]


def split_state(state: dict[str, torch.Tensor], head_prefixes: Sequence[str]) -> tuple[dict, dict[str, dict]]:
    """(backbone state in transformers 5 `Qwen*VLModel` names, {prefix: head state keyed below the prefix}); keys of
    neither (lm_head.weight) are dropped."""
    backbone: dict[str, torch.Tensor] = {}
    heads: dict[str, dict] = {p: {} for p in head_prefixes}
    for key, value in state.items():
        prefix = next((p for p in head_prefixes if key.startswith(p)), None)
        if prefix is not None:
            heads[prefix][key[len(prefix):]] = value
        elif (name := model_key(key)) is not None:
            backbone[name] = value
    return backbone, heads


def merge_lora(state: dict[str, torch.Tensor], scale: float, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """A PEFT-wrapped state dict (`base_model.model.` + the model's names, LoRA kept apart) -> the backbone in
    transformers 5 `Qwen*VLModel` names (`model_key`) + the other keys (heads) as they are, lm_head dropped, LoRA
    merged: `<m>.base_layer.weight` + scale * `<m>.lora_B.default.weight` @ `<m>.lora_A.default.weight` (float32
    product, stored back in the weight's dtype)."""
    if not any(k.startswith(PEFT_PREFIX) for k in state):
        raise ValueError(f"{where}: keys do not start with '{PEFT_PREFIX}' (e.g. {list(state)[:3]}); expected a "
                         "PEFT-wrapped state dict")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if ".lora_" in key or key == "lm_head.weight":  # lm_head: not used by a reward (tied to the embeddings)
            continue
        if ".base_layer." in key:
            module, leaf = key.split(".base_layer.")
            if leaf == "weight":
                a = state[f"{PEFT_PREFIX}{module}.lora_A.default.weight"]
                b = state[f"{PEFT_PREFIX}{module}.lora_B.default.weight"]
                value = (value.float() + scale * (b.float() @ a.float())).to(value.dtype)
            key = f"{module}.{leaf}"
        out[model_key(key) or key] = value
    return out


def build_head(state: dict[str, torch.Tensor], what: str, path: Path) -> torch.nn.Module:
    """The authors' head from its weights: `nn.Linear(bias=False)` (rm_head_type "default": keys `weight`) or their
    ranknet `nn.Sequential` (keys `<i>.weight`): a Linear at every index holding weights, a ReLU right after each
    Linear but the last, Dropout (identity when scoring) at the other indices. Runs in float32 as theirs does."""
    if not state:
        raise ValueError(f"{what}: checkpoint '{path}' has no reward head weights")
    if set(state) == {"weight"}:
        w = state["weight"]
        head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        head.load_state_dict({"weight": w})
        return head.float().eval()
    indices = sorted({int(k.split(".")[0]) for k in state if k.split(".")[0].isdigit()})
    if not indices or len(indices) != len({k.split(".")[0] for k in state}):
        raise ValueError(f"{what}: checkpoint '{path}': reward head keys {sorted(state)[:6]} are neither a Linear "
                         f"('weight') nor an nn.Sequential ('<index>.weight')")
    layers: list[torch.nn.Module] = []
    for i in range(indices[-1] + 1):
        if i in indices:
            w = state[f"{i}.weight"]
            layers.append(torch.nn.Linear(w.shape[1], w.shape[0], bias=f"{i}.bias" in state))
        elif isinstance(layers[-1], torch.nn.Linear):
            layers.append(torch.nn.ReLU())
        else:
            layers.append(torch.nn.Dropout(0.0))
    head = torch.nn.Sequential(*layers)
    load_strict(head, state, what, path)
    return head.float().eval()


class QwenVLRewardBackbone:
    """Backbone (vision tower + text decoder, no lm_head) + heads + processor of a Qwen-VL reward checkpoint.

    checkpoint: the state-dict file. base: the base model's directory (config.json, tokenizer, preprocessor and
    chat template files). head_prefixes: the head keys' prefixes in the checkpoint (e.g. ["rm_head."]).
    reward_tokens: the special tokens the authors add to the tokenizer (in their order: it sets the token ids).
    lora_scale: for a PEFT-wrapped checkpoint, the LoRA scale (alpha / r) to merge it with (`merge_lora`); None: the
    checkpoint is the plain model. base_arg: the caller's argument that gives `base`, named in messages."""

    def __init__(self, checkpoint: Path, base: Path, *, what: str, head_prefixes: Sequence[str],
                 reward_tokens: Sequence[str] = ("<|Reward|>",), family: str | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, trust_pickle: bool = False,
                 lora_scale: float | None = None, base_arg: str = "processor"):
        from transformers import AutoConfig, AutoProcessor
        from transformers.initialization import no_init_weights

        self.what, self.device, self.checkpoint = what, torch.device(device), checkpoint
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"{what}: no config.json in the base model directory '{base}'; pass {base_arg}= "
                                    f"the base model the checkpoint was trained from (its config + processor files)")
        config = AutoConfig.from_pretrained(str(base), local_files_only=True)
        if config.model_type not in FAMILIES or (family is not None and config.model_type != family):
            expected = family or " or ".join(FAMILIES)
            raise ValueError(f"{what}: base model '{base}' is a {config.model_type}, expected {expected} "
                             f"(config.json model_type)")
        self.family = config.model_type
        try:
            self.processor = AutoProcessor.from_pretrained(str(base), local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise FileNotFoundError(f"{what}: no {self.family} processor in '{base}' ({str(exc).splitlines()[0][:160]}); "
                                    f"it needs the base model's tokenizer, preprocessor_config.json and chat template "
                                    f"files") from None
        tok = self.processor.tokenizer
        tok.padding_side = "right"  # as the authors load it (AutoProcessor(padding_side="right"))
        tok.add_special_tokens({"additional_special_tokens": list(reward_tokens)})
        self.token_ids = [tok.convert_tokens_to_ids(t) for t in reward_tokens]

        state = load_state_dict_file(checkpoint, what, trust_pickle)
        if lora_scale is not None:
            state = merge_lora(state, lora_scale, f"{what}: '{checkpoint}'")
        backbone_state, head_states = split_state(state, head_prefixes)
        embed = backbone_state.get("language_model.embed_tokens.weight")
        if embed is None:
            raise ValueError(f"{what}: checkpoint '{checkpoint}' has no embedding (expected 'model.embed_tokens.weight' "
                             f"or 'model.language_model.embed_tokens.weight'); is it a {self.family} reward model?")
        if embed.shape[0] != len(tok):
            raise ValueError(f"{what}: checkpoint '{checkpoint}' has {embed.shape[0]} token embeddings, the tokenizer in "
                             f"'{base}' with {list(reward_tokens)} added has {len(tok)}; pass {base_arg}= the base model "
                             f"the checkpoint was trained from")
        config.text_config.vocab_size = int(embed.shape[0])
        cls = _model_class(self.family)
        with no_init_weights():  # every weight comes from the checkpoint; built in `dtype` (7B: no float32 copy)
            self.model = cls._from_config(config, attn_implementation="sdpa", dtype=dtype)
        load_strict(self.model, backbone_state, f"{what} backbone ({self.family})", checkpoint,
                    f"the base model in '{base}' must be the one the checkpoint was trained from")
        self.model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.heads = {p: build_head(s, f"{what} head '{p}*'", checkpoint).to(self.device).requires_grad_(False)
                      for p, s in head_states.items()}

    def check_outputs(self, n: int, meaning: str) -> None:
        """ValueError unless every head predicts `n` values (`meaning` says which, for the message)."""
        for prefix, head in self.heads.items():
            out = [m for m in head.modules() if isinstance(m, torch.nn.Linear)][-1].out_features
            if out != n:
                raise ValueError(f"{self.what}: checkpoint '{self.checkpoint}' head '{prefix}*' predicts {out} values, "
                                 f"expected {n} ({meaning})")

    def chat_texts(self, conversations: Sequence[Sequence[dict]]) -> list[str]:
        """One user turn per row (content items {"type": "image"} / {"type": "text", "text": ...}) rendered with the
        base model's chat template and the generation prompt, as the authors call apply_chat_template."""
        rendered = self.processor.apply_chat_template([[{"role": "user", "content": list(c)}] for c in conversations],
                                                      tokenize=False, add_generation_prompt=True)
        return [rendered] if isinstance(rendered, str) else list(rendered)

    @staticmethod
    def resize(images: torch.Tensor | Sequence[torch.Tensor], min_pixels: int, max_pixels: int) -> list:
        """Float [3, H, W] images in [0, 1] (a batch tensor or a list of any sizes) -> PIL images resized as the
        authors' fetch_image (qwen-vl-utils): uint8 RGB, smart_resize to multiples of 28 within [min_pixels,
        max_pixels], PIL bicubic."""
        from mmrl.pipelines.images import resize_for_qwen
        from mmrl.rewards.base import to_pil_list

        return [resize_for_qwen(to_pil_list(t[None])[0], min_pixels=min_pixels, max_pixels=max_pixels, factor=28)
                for t in images]

    def encode(self, texts: Sequence[str], images: Sequence[Any] | None = None, **processor_kwargs: Any) -> dict:
        """The processor's batch (right-padded) on the backbone's device."""
        batch = self.processor(text=list(texts), images=images, padding=True, return_tensors="pt", **processor_kwargs)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def token_hidden(self, batch: dict) -> torch.Tensor:
        """[B, K, H] float32 final hidden states at the K reward tokens of each row, in their order in the row
        (every row must hold each once)."""
        ids = batch["input_ids"]
        at = torch.zeros_like(ids, dtype=torch.bool)
        for t in self.token_ids:
            at |= ids == t
        counts = at.sum(1)
        if bool((counts != len(self.token_ids)).any()):
            row = int((counts != len(self.token_ids)).nonzero()[0])
            raise ValueError(f"{self.what}: row {row} holds {int(counts[row])} reward tokens, expected "
                             f"{len(self.token_ids)}; a prompt must not contain the reward token text itself")
        # 1-D positions on all M-RoPE axes, as the authors' forward gets (see the module docstring). No attention
        # mask: padding is on the right, after every reward token, so causal attention already keeps it out of what
        # is read here (equal to the masked forward; without a mask SDPA runs its causal kernel instead of a
        # materialised [B, 1, L, L] mask, 2x faster for a batch of 16 HPSv3 inputs)
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False,
                         **{k: batch[k] for k in keys if batch.get(k) is not None})
        hidden = out.last_hidden_state[at]
        return hidden.view(ids.shape[0], len(self.token_ids), -1).float()


def _model_class(family: str):
    from transformers import Qwen2_5_VLModel, Qwen2VLModel

    return {"qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2_5_VLModel}[family]
