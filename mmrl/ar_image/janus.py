"""Janus / Janus-Pro (transformers `JanusForConditionalGeneration`) as an image-token policy.

Image generation with classifier-free guidance, as transformers' `generate(generation_mode="image")` does it
(transformers 5.24.0, models/janus/modeling_janus.py; reimplemented, not copied): the prompt ids end with
begin-of-image; the unconditional row is the same prompt with every token but BOS and begin-of-image replaced by pad;
both rows run through the Llama decoder (`model.model.language_model`) with one cache; each step's token comes from
the generation head (`model.model.generation_head`, not `lm_head`) on the last hidden state, the logits guided as
uncond + gs (cond - uncond) and sampled from their softmax (`torch.multinomial`, one draw per row per step: the same
random stream as `generate` with `do_sample=True`); the sampled token is embedded by
`prepare_embeddings_for_image_generation` for both rows.

`guided_logprobs` scores given tokens by teacher forcing: the prompt embeddings followed by the image-token embeddings
of all tokens but the last, one forward of both rows, the guided logits combined BEFORE the log-softmax (the policy is
the guided distribution, what the rollout sampled from). Rows of one call share one prompt (a GRPO group): no padding,
so the positions are those of `generate`. Rows with prompts of different lengths (the semantic chain-of-thought,
`mmrl.ar_image.cot`) come left-padded with an `attention_mask` that both rows of each pair use (what `generate` does
with one): pads are masked, positions count them (`generate`'s image mode sets none), which RoPE leaves without effect
up to float rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor

__all__ = ["JANUS_IMAGE_PROMPT", "JanusPolicy", "check_prompt_template", "load_janus", "template_fields"]

# The user turn of Janus' "deepseek" conversation format with an empty system prompt (deepseek-ai/Janus
# janus/utils/conversation.py, SeparatorStyle.DeepSeek; generation_inference.py builds its image prompts so, and
# CaraJ7/T2I-R1@2d9d4d1 too): what a Janus-Pro checkpoint saw before begin-of-image in training.
JANUS_IMAGE_PROMPT = "<|User|>: {prompt}\n\n<|Assistant|>:"


def template_fields(key: str, template: str) -> list[str]:
    """The placeholder names of a prompt template, in order; a malformed one is one line naming `key`."""
    import string

    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{key}: not a format string ({exc}); write a literal brace as {{{{ or }}}}") from None


def check_prompt_template(template: str, key: str = "rollout.prompt_template") -> None:
    """One `{prompt}` placeholder and no other field."""
    fields = template_fields(key, template)
    if fields != ["prompt"]:
        raise ValueError(f"{key}: expected exactly one placeholder {{prompt}}, got {fields} in {template!r}")


def load_janus(path: str | Path, device: torch.device, dtype: torch.dtype):
    """(model, processor) of a saved Janus checkpoint (`from_pretrained`, offline)."""
    from transformers import JanusForConditionalGeneration, JanusProcessor

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path: {path} holds no config.json (a saved JanusForConditionalGeneration); "
                         f"set model.build_tiny: janus to build the tiny demo model there")
    model = JanusForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    if getattr(model.config, "model_type", "") != "janus":
        raise ValueError(f"model.path: {path} is a {model.config.model_type!r} model, expected 'janus'")
    return model, JanusProcessor.from_pretrained(path)


class JanusPolicy:
    """The guided image-token policy of one Janus model (module docstring). `guidance_scale` > 1 (transformers'
    image generation runs its CFG only above 1), `temperature` > 0 divides the guided logits."""

    def __init__(self, model: Any, processor: Any, guidance_scale: float, temperature: float = 1.0,
                 prompt_template: str = "{prompt}"):
        if not guidance_scale > 1:
            raise ValueError(f"rollout.guidance_scale: Janus image generation needs classifier-free guidance > 1, "
                             f"got {guidance_scale}")
        if not temperature > 0:
            raise ValueError(f"rollout.temperature: expected > 0, got {temperature}")
        check_prompt_template(prompt_template)
        self.model, self.processor, self.prompt_template = model, processor, prompt_template
        self.gs, self.temperature = float(guidance_scale), float(temperature)
        gen = model.generation_config
        boi = (gen.generation_kwargs or {}).get("boi_token_id")
        if gen.bos_token_id is None or gen.pad_token_id is None or boi is None:
            raise ValueError("model: the Janus generation config needs bos_token_id, pad_token_id and "
                             f"generation_kwargs.boi_token_id, got bos={gen.bos_token_id} pad={gen.pad_token_id} "
                             f"boi={boi}")
        self.bos, self.pad, self.boi = gen.bos_token_id, gen.pad_token_id, boi
        self.num_tokens = model.model.vision_model.config.num_image_tokens

    # ------------------------------------------------------------------ inputs

    def prompt_ids(self, prompt: str) -> Tensor:
        """[1, L] ids of one prompt in image mode (the processor appends begin-of-image)."""
        return self.processor(text=[prompt], generation_mode="image", return_tensors="pt")["input_ids"]

    def image_prompt_ids(self, prompt: str) -> Tensor:
        """[1, L] ids of one prompt put into the policy's `prompt_template` (e.g. Janus' user turn)."""
        return self.prompt_ids(self.prompt_template.format(prompt=prompt))

    def _cond_uncond(self, ids: Tensor) -> Tensor:
        keep = (ids == self.bos) | (ids == self.boi)
        return torch.cat([ids, torch.where(keep, ids, torch.full_like(ids, self.pad))])

    def _guide(self, logits: Tensor) -> Tensor:
        cond, uncond = logits.float().chunk(2)
        return (uncond + self.gs * (cond - uncond)) / self.temperature

    # ------------------------------------------------------------------ rollout

    @torch.no_grad()
    def sample(self, ids: Tensor, n: int, generator: torch.Generator | None = None,
               attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(tokens [n, T], log-probs [n, T] of the sampled tokens under the guided policy) for `n` images of one
        prompt `ids` [1, L] (or `n` left-padded prompts [n, L] with their `attention_mask`). With `generator` None
        the global generator draws (what `generate` uses)."""
        from transformers import DynamicCache

        model = self.model
        device = next(model.parameters()).device
        ids = ids.to(device).expand(n, -1)
        embeds = model.get_input_embeddings()(self._cond_uncond(ids))
        mask = None if attention_mask is None else attention_mask.to(device).repeat(2, 1)
        lm, head = model.model.language_model, model.model.generation_head
        cache = DynamicCache(config=lm.config)
        tokens = torch.zeros(n, self.num_tokens, dtype=torch.long, device=device)
        logps = torch.zeros(n, self.num_tokens, device=device)
        for i in range(self.num_tokens):
            if mask is not None and i:
                mask = torch.cat([mask, mask.new_ones(2 * n, 1)], 1)
            hidden = lm(inputs_embeds=embeds, attention_mask=mask, cache=cache, use_cache=True).last_hidden_state[:, -1]
            guided = self._guide(head(hidden))
            token = torch.multinomial(torch.softmax(guided, -1), 1, generator=generator).squeeze(-1)
            tokens[:, i] = token
            logps[:, i] = torch.log_softmax(guided, -1).gather(-1, token[:, None]).squeeze(-1)
            if i + 1 < self.num_tokens:
                embeds = model.prepare_embeddings_for_image_generation(torch.cat([token, token])[:, None])
        return tokens, logps

    # ------------------------------------------------------------------ training

    def guided_logits(self, ids: Tensor, tokens: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """[n, T, codebook] guided logits (after the temperature) of `tokens` [n, T] given one prompt `ids` [1, L]
        (or left-padded prompts [n, L] with their `attention_mask`), by teacher forcing (module docstring);
        differentiable."""
        model = self.model
        n = tokens.shape[0]
        ids = ids.to(tokens.device).expand(n, -1)
        prompt = model.get_input_embeddings()(self._cond_uncond(ids))
        images = model.prepare_embeddings_for_image_generation(tokens[:, :-1]).repeat(2, 1, 1)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(tokens.device).repeat(2, 1)
            mask = torch.cat([mask, mask.new_ones(2 * n, images.shape[1])], 1)
        hidden = model.model.language_model(inputs_embeds=torch.cat([prompt, images], 1),
                                            attention_mask=mask).last_hidden_state
        return self._guide(model.model.generation_head(hidden[:, ids.shape[1] - 1:]))

    def guided_logprobs(self, ids: Tensor, tokens: Tensor,
                        attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(log-probs [n, T] of `tokens`, entropy [n, T]) under the guided policy, by teacher forcing."""
        logp = torch.log_softmax(self.guided_logits(ids, tokens, attention_mask), -1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1), entropy

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        """[n, 3, H, W] images in [0, 1] (the VQ decoder's output is about [-1, 1], channels-last, unclamped)."""
        images = self.model.decode_image_tokens(tokens).float()
        return ((images.clamp(-1, 1) + 1) / 2).permute(0, 3, 1, 2).contiguous()
