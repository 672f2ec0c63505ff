"""T2I-R1's semantic-level chain-of-thought for Janus (BiCoT-GRPO: CaraJ7/T2I-R1 at commit
2d9d4d1af4119953b3a8541f914f85481d7e1e76, src/t2i-r1/src/open_r1/trainer/grpo_trainer.py; facts taken, no code).

One rollout of a prompt is two generations of the same model:
1. Text (the semantic CoT): the reasoning prompt (`rollout.cot.template`, T2I-R1's data/prompt/reasoning_prompt.txt in
   Janus' "deepseek" chat format with their system prompt) is continued by the text `lm_head`, sampled like
   transformers' `generate` in text mode (temperature, then top-k, softmax, `torch.multinomial`; a row that produced
   EOS gets pad tokens until every row has, or `rollout.cot.max_tokens`). The mask keeps the tokens up to and
   including the first EOS (T2I-R1's completion mask).
2. Image: the CoT, decoded without special tokens and stripped, goes into a new prompt with the original one
   (`rollout.cot.image_template`, T2I-R1's "{prompt}. {cot}" user turn with an empty system prompt), and the image
   tokens are sampled with classifier-free guidance by `JanusPolicy.sample`. The unconditional row is T2I-R1's: every
   token but the first (BOS) and the last (begin-of-image) replaced by pad, so the CoT is dropped with the prompt.
   The group's prompts differ in length: they are left-padded with a mask (`mmrl.ar_image.janus`), so each row's
   image distribution is the one of its own prompt; T2I-R1 right-pads before appending begin-of-image, which leaves a
   gap of masked positions before it and gives the unconditional rows as many (attended) pads as the longest prompt.

Training: the text log-probs (teacher forcing on the reasoning prompt + CoT) are those of softmax(lm_head logits /
temperature), without the top-k cut, which only filters the sampling (T2I-R1 scores the raw lm_head softmax at its
temperature 1 after sampling with top-k 50; verl and TRL do the same; log-probs of the cut distribution would be
-inf, and the KL infinite, for a sampled token that an update or the reference pushes out of its top-k). They and
the guided image log-probs are concatenated per sample, text masked after EOS, and trained with one advantage per
sample under one loss (T2I-R1 concatenates both parts and averages the per-token loss and its k3 KL over all
unmasked tokens: `algo.loss_agg: token-mean`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mmrl.ar_image.janus import check_prompt_template, template_fields

Tensor = torch.Tensor

__all__ = ["T2I_R1_IMAGE_TEMPLATE", "T2I_R1_TEMPLATE", "CoTConfig", "CoTGroup", "SemanticCoT"]

# T2I-R1's reasoning prompt (data/prompt/reasoning_prompt.txt) rendered by Janus' "deepseek" conversation format with
# the system prompt of their trainer (apply_sft_template_for_multi_turn_prompts strips the user turn and the result)
T2I_R1_TEMPLATE = (
    "You are a helpful assistant that receives an image prompt and generate a visualization of the prompt.\n\n"
    "<|User|>: You are asked to generate an image based on this prompt: \"{prompt}\"\n"
    "Provide a brief, precise visualization of all elements in the prompt. Your description should:\n"
    "1. Include every object mentioned in the prompt\n"
    "2. Specify visual attributes (color, number, shape, texture) if specified in the prompt\n"
    "3. Clarify relationships (e.g., spatial) between objects if specified in the prompt\n"
    "4. Be concise (50 words or less)\n"
    "5. Focus only on what's explicitly stated in the prompt\n"
    "6. Do not elaborate beyond the attributes or relationships specified in the prompt\n"
    "Do not miss objects. Output your visualization directly without explanation:\n\n<|Assistant|>:")
# their image-generation prompt: f"{raw_prompt}. {answer}" as the user turn, empty system prompt
T2I_R1_IMAGE_TEMPLATE = "<|User|>: {prompt}. {cot}\n\n<|Assistant|>:"


@dataclass
class CoTConfig:
    template: str = T2I_R1_TEMPLATE
    """The text prompt the CoT continues, `{prompt}` = the image prompt (the whole string the tokenizer sees, chat
    framing included; literal braces doubled). Default: T2I-R1's reasoning prompt in Janus' chat format."""
    image_template: str = T2I_R1_IMAGE_TEMPLATE
    """The image-generation prompt, `{prompt}` and `{cot}` (the decoded CoT, stripped); begin-of-image is appended.
    Default: T2I-R1's."""
    max_tokens: int = 1024
    """Most CoT tokens (T2I-R1: max_completion_length 1024)."""
    temperature: float = 1.0
    """Divides the text logits before sampling (and in the trained log-probs)."""
    top_k: int = 50
    """Sample the CoT from the k most likely text tokens (0 = all); the trained log-probs are the uncut softmax's.
    50: T2I-R1's generate call leaves transformers' default."""

    def __post_init__(self) -> None:
        check_prompt_template(self.template, "rollout.cot.template")
        got = template_fields("rollout.cot.image_template", self.image_template)
        if got.count("cot") != 1 or got.count("prompt") > 1 or not set(got) <= {"prompt", "cot"}:
            raise ValueError(f"rollout.cot.image_template: expected the placeholder {{cot}} (and optionally "
                             f"{{prompt}}), got {sorted(got)}")
        if self.max_tokens < 1:
            raise ValueError(f"rollout.cot.max_tokens: expected >= 1, got {self.max_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.cot.temperature: expected > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"rollout.cot.top_k: expected >= 0 (0 = no top-k), got {self.top_k}")


@dataclass
class CoTGroup:
    """One prompt's rollout (a GRPO group of n samples)."""

    text_ids: Tensor  # [1, P] the reasoning prompt
    cot: Tensor  # [n, M] CoT tokens, pad after EOS
    cot_mask: Tensor  # [n, M] 1 up to and including the first EOS
    cot_logp: Tensor  # [n, M] sampled log-probs (0 where masked)
    image_ids: Tensor  # [n, L] image prompts, left-padded, ending with begin-of-image
    image_mask: Tensor  # [n, L]
    tokens: Tensor  # [n, T] image tokens
    image_logp: Tensor  # [n, T] sampled guided log-probs


class SemanticCoT:
    """Text-then-image rollouts and their log-probs on one `JanusPolicy` (module docstring)."""

    def __init__(self, policy: Any, cfg: CoTConfig):
        self.policy, self.cfg = policy, cfg
        eos = policy.model.generation_config.eos_token_id
        if eos is None:
            raise ValueError("model: the Janus generation config needs eos_token_id to end a chain-of-thought")
        self.eos = torch.tensor([eos] if isinstance(eos, int) else list(eos))

    # ------------------------------------------------------------------ text

    def text_ids(self, prompt: str) -> Tensor:
        """[1, P] ids of the reasoning prompt (the tokenizer adds BOS, as T2I-R1's add_special_tokens=True)."""
        text = self.cfg.template.format(prompt=prompt)
        return self.policy.processor.tokenizer(text, return_tensors="pt")["input_ids"]

    def _top_k(self, scores: Tensor) -> Tensor:
        """generate's top-k warper (after its temperature; ties at the k-th value kept)."""
        if not self.cfg.top_k:
            return scores
        kth = torch.topk(scores, min(self.cfg.top_k, scores.shape[-1]))[0][..., -1:]
        return scores.masked_fill(scores < kth, -float("inf"))

    @torch.no_grad()
    def sample_text(self, ids: Tensor, n: int, generator: torch.Generator | None = None) -> tuple[Tensor, ...]:
        """(cot [n, M], log-probs [n, M] under softmax(logits / temperature), mask [n, M]) of `n` CoTs continuing
        `ids` [1, P], M <= max_tokens."""
        from transformers import DynamicCache

        model = self.policy.model
        device = next(model.parameters()).device
        lm = model.model.language_model
        cache = DynamicCache(config=lm.config)
        inputs, eos = ids.to(device).expand(n, -1), self.eos.to(device)
        running = torch.ones(n, dtype=torch.bool, device=device)
        tokens, logps = [], []
        for _ in range(self.cfg.max_tokens):
            hidden = lm(input_ids=inputs, cache=cache, use_cache=True).last_hidden_state[:, -1]
            scores = model.lm_head(hidden).float() / self.cfg.temperature
            token = torch.multinomial(torch.softmax(self._top_k(scores), -1), 1, generator=generator).squeeze(-1)
            token = torch.where(running, token, torch.full_like(token, self.policy.pad))  # generate's padding
            logp = torch.log_softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)
            tokens.append(token)
            logps.append(torch.where(running, logp, torch.zeros_like(logp)))
            running = running & ~torch.isin(token, eos)
            if not running.any():
                break
            inputs = token[:, None]
        cot = torch.stack(tokens, 1)
        return cot, torch.stack(logps, 1), self.cot_mask(cot)

    def cot_mask(self, cot: Tensor) -> Tensor:
        """[n, M] float mask: 1 up to and including each row's first EOS (all of a row without one)."""
        is_eos = torch.isin(cot, self.eos.to(cot.device)).long()
        before = is_eos.cumsum(1) - is_eos  # EOS seen strictly before each position
        return (before == 0).float()

    def text_logprobs(self, ids: Tensor, cot: Tensor, mask: Tensor) -> Tensor:
        """[n, M] log-probs of `cot` after `ids` [1, P] under softmax(logits / temperature), by teacher forcing (0
        where `mask` is 0); differentiable."""
        model = self.policy.model
        inputs = torch.cat([ids.to(cot.device).expand(cot.shape[0], -1), cot[:, :-1]], 1)
        hidden = model.model.language_model(input_ids=inputs).last_hidden_state[:, ids.shape[1] - 1:]
        logp = torch.log_softmax(model.lm_head(hidden).float() / self.cfg.temperature, -1)
        logp = logp.gather(-1, cot[..., None]).squeeze(-1)
        return torch.where(mask > 0, logp, torch.zeros_like(logp))

    # ------------------------------------------------------------------ image

    def image_inputs(self, prompt: str, cot: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(ids [n, L] left-padded with pad, attention mask [n, L]) of the image prompts of `prompt` + each CoT."""
        decode = self.policy.processor.tokenizer.decode
        rows = [self.policy.prompt_ids(self.cfg.image_template.format(
            prompt=prompt, cot=decode(c[m > 0].tolist(), skip_special_tokens=True).strip()))[0]
            for c, m in zip(cot, mask)]
        width = max(len(r) for r in rows)
        ids = torch.stack([F.pad(r, (width - len(r), 0), value=self.policy.pad) for r in rows])
        attn = torch.stack([F.pad(torch.ones_like(r), (width - len(r), 0)) for r in rows])
        return ids.to(cot.device), attn.to(cot.device)

    # ------------------------------------------------------------------ rollout and training

    @torch.no_grad()
    def rollout(self, prompt: str, n: int, generator: torch.Generator | None = None) -> CoTGroup:
        """`n` text-then-image samples of `prompt`."""
        ids = self.text_ids(prompt)
        cot, cot_logp, cot_mask = self.sample_text(ids, n, generator)
        image_ids, image_mask = self.image_inputs(prompt, cot, cot_mask)
        tokens, image_logp = self.policy.sample(image_ids, n, generator, attention_mask=image_mask)
        return CoTGroup(ids, cot, cot_mask, cot_logp, image_ids, image_mask, tokens, image_logp)

    def logprobs(self, group: CoTGroup, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs [r, max_tokens + T]: the CoT's, zero-padded to max_tokens, then the image tokens'; the image
        tokens' entropy [r, T]; the mask [r, max_tokens + T]) of the group's `rows`, by teacher forcing."""
        cot, mask = group.cot[rows], group.cot_mask[rows]
        text = self.text_logprobs(group.text_ids, cot, mask)
        image, entropy = self.policy.guided_logprobs(group.image_ids[rows], group.tokens[rows],
                                                     attention_mask=group.image_mask[rows])
        pad = (0, self.cfg.max_tokens - cot.shape[1])
        return (torch.cat([F.pad(text, pad), image], 1), entropy,
                torch.cat([F.pad(mask, pad), torch.ones_like(image)], 1))

    def metrics(self, groups: list[CoTGroup]) -> dict[str, float]:
        """`cot/length`: mean CoT tokens up to and including EOS (T2I-R1's completion_length); `cot/truncated`: the
        fraction of CoTs cut at max_tokens without EOS."""
        lengths = torch.cat([g.cot_mask.sum(1) for g in groups])
        ended = torch.cat([torch.isin(g.cot, self.eos.to(g.cot.device)).any(1) for g in groups])
        return {"cot/length": float(lengths.mean()), "cot/truncated": float((~ended).float().mean())}
