"""VLM policy RL: rollout engines (HF / vLLM), shared model-input helpers, the GRPO-family recipe."""

from mmrl.vlm.batch import RolloutBatch  # noqa: F401
from mmrl.vlm.common import (  # noqa: F401
    EncodedPrompt,
    collate,
    compute_logprobs,
    encode_prompt,
    load_policy,
    messages_from_text,
    render_prompt,
    response_logprobs,
    vision_token_ids,
)
from mmrl.vlm.rollout import (  # noqa: F401
    GenRequest,
    HFRolloutEngine,
    RolloutEngine,
    RolloutResult,
    SamplingParams,
    make_engine,
)
from mmrl.vlm.vllm_engine import VLLMRolloutEngine  # noqa: F401  (vLLM itself is imported when an engine starts)
