"""Generation engines for VLM policies: one interface, two back ends.

    engine.generate(requests: list[GenRequest], sampling: SamplingParams) -> list[RolloutResult]

Results are request-major: the ``n`` samples of request 0, then those of request 1, ...

``HFRolloutEngine`` (default) is a small sampling loop over the transformers model itself (prefill, then
one token per step with a ``DynamicCache``), not ``model.generate``: owning the loop lets it

* prefill each prompt (and run its vision tower) once and then copy the KV cache to its ``n`` samples,
  instead of encoding the image ``n`` times as ``num_return_sequences`` does;
* pass the 3-D M-RoPE positions explicitly (no ``rope_deltas`` state kept inside the model);
* record two log-probs per sampled token (see ``RolloutResult``);
* ban the vision special tokens, apply temperature / top-k / top-p, stop on EOS or stop strings.
Greedy decoding (``temperature=0``) is token-for-token ``model.generate(do_sample=False)`` with the same
banned tokens (tested).

``VLLMRolloutEngine`` (``mmrl.vlm.vllm_engine``) has the same interface on ``vllm.LLM``; vLLM is imported only when
such an engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

import torch

from mmrl.vlm.common import EncodedPrompt, collate, encode_prompt, render_prompt, vision_token_ids
from mmrl.vlm.families import family_of_config

__all__ = ["SamplingParams", "GenRequest", "RolloutResult", "RolloutEngine", "HFRolloutEngine", "make_engine",
           "apply_top_k_top_p", "ENGINES"]


@dataclass
class SamplingParams:
    """How to sample. ``temperature=0`` is greedy. ``top_k <= 0`` and ``top_p >= 1`` switch those filters off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: n and max_new_tokens must be >= 1, got n={self.n}, "
                             f"max_new_tokens={self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: need temperature >= 0 and 0 < top_p <= 1, got "
                             f"temperature={self.temperature}, top_p={self.top_p}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclass
class GenRequest:
    """One prompt: chat ``messages`` (Qwen format, ``{"type": "image"}`` items) or an already templated
    ``prompt_text`` (vision items as ``<image>`` or ``<|vision_start|><|image_pad|><|vision_end|>``), plus its
    ``images`` in placeholder order. ``n`` overrides ``SamplingParams.n``; ``metadata`` is carried along."""

    messages: list[dict] | None = None
    prompt_text: str | None = None
    images: list = field(default_factory=list)
    n: int | None = None
    metadata: dict = field(default_factory=dict)


@dataclass
class RolloutResult:
    """One sampled response.

    ``response_logprobs[t]`` = log softmax(logits / temperature)[token t]: the model's own distribution at
    the sampling temperature (T=1 when greedy), without top-k/top-p/ban. That is what the trainer
    recomputes for old/new log-probs, so the two can be compared (``diag/logprob_drift``).
    ``sampling_logprobs[t]`` = log-prob under the distribution the token was actually drawn from (ban +
    temperature + top-k + top-p; 0 for greedy). They are equal when no filter removed mass.
    ``finish_reason``: "stop" (EOS token or a stop string; ``stop_reason`` says which) or "length".
    With a stop string the response ends with the token that completed it (the text contains it).
    ``mm`` holds this prompt's vision tensors (shared by its n samples), for the trainer's forward.
    """

    request_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    sampling_logprobs: list[float] | None
    finish_reason: str
    stop_reason: int | str | None
    text: str
    prompt_text: str = ""
    mm: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    def generate(self, requests: Sequence[GenRequest], sampling: SamplingParams) -> list[RolloutResult]: ...


def _prompt_text(processor: Any, req: GenRequest) -> str:
    if (req.messages is None) == (req.prompt_text is None):
        raise ValueError("GenRequest: give exactly one of messages or prompt_text")
    return req.prompt_text if req.prompt_text is not None else render_prompt(processor, req.messages)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (smallest set with mass >= top_p) to -inf. logits [N, V].

    The most likely token is always kept."""
    # source: nucleus sampling, Holtzman et al. arXiv 1904.09751 (same rule as transformers TopPLogitsWarper)
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        remove_sorted = mass_before >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class HFRolloutEngine:
    """Batched sampling with the transformers model (see module docstring).

    Args:
        model, processor: from ``mmrl.vlm.common.load_policy`` (or any Qwen2/2.5/3-VL pair).
        ban_vision_tokens: never sample ``<|vision_start|>``, ``<|image_pad|>``, ... (their logits -> -inf).
        batch_size: max sequences decoded together (prompts are grouped so sum of n fits).
        eos_token_ids: default ``model.generation_config.eos_token_id``.
    """

    def __init__(self, model: Any, processor: Any, ban_vision_tokens: bool = True, batch_size: int = 64,
                 eos_token_ids: Iterable[int] | None = None, step_sync: Any = None):
        self.model, self.processor = model, processor
        # step_sync(still_generating: bool) -> bool: "is any rank still generating?" (a collective). Set under FSDP,
        # where every rank must run the same number of decode forwards: a rank whose rows are all finished keeps
        # running masked forwards (no sampling) until every rank is done. None = stop as soon as this rank is done.
        self.step_sync = step_sync
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.batch_size = int(batch_size)
        self.banned = vision_token_ids(processor) if ban_vision_tokens else []
        self.one_d = family_of_config(getattr(model, "config", None)).rope == "1d"
        if eos_token_ids is None:
            eos = model.generation_config.eos_token_id
            eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos = sorted(set(int(e) for e in eos_token_ids))
        if not self.eos:
            raise ValueError("HFRolloutEngine: no EOS token id (pass eos_token_ids=...)")
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos[0])

    # ------------------------------------------------------------------ public
    def encode(self, requests: Sequence[GenRequest]) -> list[EncodedPrompt]:
        return [encode_prompt(self.processor, _prompt_text(self.processor, r), r.images) for r in requests]

    @torch.no_grad()
    def generate(self, requests: Sequence[GenRequest], sampling: SamplingParams,
                 encoded: Sequence[EncodedPrompt] | None = None) -> list[RolloutResult]:
        encoded = list(encoded) if encoded is not None else self.encode(requests)
        ns = [r.n or sampling.n for r in requests]
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self._device()).manual_seed(int(sampling.seed))
        results: list[RolloutResult] = []
        chunk: list[int] = []
        for i in range(len(requests)):
            if chunk and sum(ns[j] for j in chunk) + ns[i] > self.batch_size:
                results += self._generate_chunk([requests[j] for j in chunk], [encoded[j] for j in chunk],
                                                [ns[j] for j in chunk], chunk, sampling, gen)
                chunk = []
            chunk.append(i)
        if chunk:
            results += self._generate_chunk([requests[j] for j in chunk], [encoded[j] for j in chunk],
                                            [ns[j] for j in chunk], chunk, sampling, gen)
        return results

    # ------------------------------------------------------------------ internals
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _generate_chunk(self, reqs, enc: list[EncodedPrompt], ns: list[int], req_idx: list[int],
                        sp: SamplingParams, gen) -> list[RolloutResult]:
        model = self.model
        device = self._device()
        # 1. prefill each distinct prompt once (vision tower included)
        batch, P, _ = collate(model, [e.input_ids for e in enc], [[] for _ in enc], [e.mm for e in enc], self.pad_id)
        out = model(**batch, use_cache=True, logits_to_keep=1)
        cache_kw = cache_argument(model)
        cache = returned_cache(out, cache_kw)
        # 2. copy it to the n samples of each prompt
        rows = torch.repeat_interleave(torch.arange(len(enc), device=device), torch.tensor(ns, device=device))
        cache.batch_select_indices(rows)
        logits = out.logits[:, -1][rows]
        attn = batch["attention_mask"][rows]
        pos = batch["position_ids"]
        next_pos = pos.reshape(-1, *pos.shape[-2:]).amax(dim=(0, 2))[rows] + 1  # text continues after the max position
        N = rows.numel()
        tokens = torch.full((N, sp.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        lp_model = torch.zeros(N, sp.max_new_tokens, device=device)
        lp_samp = torch.zeros(N, sp.max_new_tokens, device=device)
        length = torch.zeros(N, dtype=torch.long, device=device)
        done = torch.zeros(N, dtype=torch.bool, device=device)
        reason: list[Any] = [None] * N
        eos = torch.tensor(self.eos, device=device)
        banned = torch.tensor(self.banned, dtype=torch.long, device=device)
        greedy = sp.temperature == 0
        window = max([len(s) for s in sp.stop] + [0]) + 2  # a token holds >= 1 character
        for t in range(sp.max_new_tokens):
            raw = logits.float()
            scaled = raw if greedy else raw / sp.temperature
            logp_model = torch.log_softmax(scaled, -1)
            proc = scaled.clone()
            if banned.numel():
                proc[:, banned] = float("-inf")
            if greedy:
                tok = proc.argmax(-1)
                lps = torch.zeros(N, device=device)
            else:
                proc = apply_top_k_top_p(proc, sp.top_k, sp.top_p)
                logp_proc = torch.log_softmax(proc, -1)
                tok = torch.multinomial(logp_proc.exp(), 1, generator=gen).squeeze(-1)
                lps = logp_proc.gather(-1, tok[:, None]).squeeze(-1)
            active = ~done
            tok = torch.where(active, tok, torch.full_like(tok, self.pad_id))
            tokens[:, t] = tok
            lp_model[:, t] = torch.where(active, logp_model.gather(-1, tok[:, None]).squeeze(-1), 0.0)
            lp_samp[:, t] = torch.where(active, lps, 0.0)
            length += active.long()
            hit_eos = active & torch.isin(tok, eos)
            for i in hit_eos.nonzero().flatten().tolist():
                reason[i] = int(tok[i])
            done |= hit_eos
            if sp.stop:
                for i in (active & ~hit_eos).nonzero().flatten().tolist():
                    k = int(length[i])
                    tail = self.tokenizer.decode(tokens[i, max(0, k - window):k].tolist())
                    hit = [s for s in sp.stop if s in tail]
                    if hit:
                        done[i] = True
                        reason[i] = hit[0]
            if bool(done.all()) or t == sp.max_new_tokens - 1:
                if self.step_sync is not None and t < sp.max_new_tokens - 1:
                    self._idle_steps(model, cache, attn, next_pos, t, sp.max_new_tokens, N, device)
                break
            if self.step_sync is not None:
                self.step_sync(True)
            attn = torch.cat([attn, torch.ones(N, 1, dtype=attn.dtype, device=device)], 1)
            pos = self._decode_positions(next_pos + t, N)
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, use_cache=True,
                        **{cache_kw: cache})
            cache = returned_cache(out, cache_kw)
            logits = out.logits[:, -1]
        results = []
        tokens, lp_model, lp_samp, length = tokens.cpu(), lp_model.cpu(), lp_samp.cpu(), length.cpu()
        k = 0
        for r, (req, e, n) in enumerate(zip(reqs, enc, ns)):
            for s in range(n):
                L = int(length[k])
                ids = tokens[k, :L].tolist()
                results.append(RolloutResult(
                    request_index=req_idx[r], sample_index=s, prompt_ids=list(e.input_ids), response_ids=ids,
                    response_logprobs=lp_model[k, :L].tolist(),
                    sampling_logprobs=lp_samp[k, :L].tolist(),
                    finish_reason="stop" if reason[k] is not None else "length", stop_reason=reason[k],
                    text=self.tokenizer.decode(ids, skip_special_tokens=True), prompt_text=e.text, mm=e.mm,
                    metadata=req.metadata))
                k += 1
        return results

    def _decode_positions(self, pos: torch.Tensor, N: int) -> torch.Tensor:
        """The next token's positions: [3, N, 1] (M-RoPE, text rows equal) or [N, 1] (1-D families: InternVL)."""
        return pos.view(N, 1) if self.one_d else pos.view(1, N, 1).expand(3, N, 1)

    def _idle_steps(self, model, cache, attn, next_pos, t: int, max_new_tokens: int, N: int, device) -> None:
        """This rank is done at decode step t: run masked forwards (pad tokens, nothing sampled or recorded) as
        long as another rank is still generating, so every rank runs the same forwards (FSDP)."""
        pad = torch.full((N, 1), self.pad_id, dtype=torch.long, device=device)
        while t < max_new_tokens - 1 and self.step_sync(False):
            attn = torch.cat([attn, torch.ones(N, 1, dtype=attn.dtype, device=device)], 1)
            pos = self._decode_positions(next_pos + t, N)
            kw = cache_argument(model)
            cache = returned_cache(model(input_ids=pad, attention_mask=attn, position_ids=pos, use_cache=True,
                                         **{kw: cache}), kw)
            t += 1


def cache_argument(model: Any) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers versions that renamed it, else
    `past_key_values` (transformers deprecates that name, with removal in 5.40, and warns on every use). Read from the
    forward signature of the model itself (under a DDP / FSDP wrapper: the wrapped module)."""
    import inspect

    inner = getattr(model, "module", model)
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def returned_cache(out: Any, name: str) -> Any:
    """The KV cache a forward returned, read by the name `cache_argument` chose (the old attribute warns)."""
    return out.get("cache") if name == "cache" else out.past_key_values


ENGINES = ("hf", "vllm")


def make_engine(name: str, model: Any, processor: Any, **kwargs: Any) -> RolloutEngine:
    """``"hf"`` -> HFRolloutEngine(model, processor, **kwargs). vLLM engines start from a checkpoint directory with
    their own weight syncer: ``mmrl.vlm.vllm_engine.make_vllm_rollout``."""
    if name == "hf":
        return HFRolloutEngine(model, processor, **kwargs)
    if name == "vllm":
        raise ValueError("make_engine('vllm'): start it with mmrl.vlm.vllm_engine.make_vllm_rollout(model_path, states, "
                         "processor, vllm_kwargs, seed), which also returns its weight syncer")
    raise ValueError(f"unknown rollout engine {name!r}; valid: {list(ENGINES)}")
