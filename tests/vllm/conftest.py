"""vLLM run for real (vLLM's CPU build, `make test-vllm`): shared pieces. Each test module imports vLLM with
``pytest.importorskip`` (so the main environment, without vLLM, skips them) and starts at most one in-process engine,
shared by its tests. The engine settings are the ones measured on 2 CPU cores: float32 (as the trainer), eager,
512-token context, 1 GiB KV cache, no thread pinning."""

from __future__ import annotations

import os

import pytest

# before vLLM is imported: the engine in this process (its worker objects reachable), a small KV cache, and no
# OpenMP thread binding (CI machines share cores)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

ENGINE_KW = dict(dtype="float32", enforce_eager=True, max_model_len=512, limit_mm_per_prompt={"image": 2})
HEAD_DIM = 32  # the smallest head size vLLM's CPU attention takes (the default tiny model has 16)


@pytest.fixture(scope="session")
def tiny32(tmp_path_factory):
    """The tiny Qwen2-VL with head_dim 32 (hidden 128), saved like a real checkpoint."""
    from mmrl.tiny import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vllm") / "qwen2_vl_h32", seed=0, head_dim=HEAD_DIM)


# the policy families beyond Qwen that vLLM's CPU build runs: name -> (tiny builder, keyword arguments)
FAMILIES = {"glm4v": ("build_tiny_glm4v", {}), "internvl3": ("build_tiny_internvl", {"decoder": "qwen2"}),
            "internvl35": ("build_tiny_internvl", {"decoder": "qwen3"})}


@pytest.fixture(scope="session")
def family32(tmp_path_factory):
    """``family32(name)``: the tiny checkpoint of a `FAMILIES` entry with head_dim 32, built once per session."""
    import mmrl.tiny as tiny

    built = {}

    def get(name):
        if name not in built:
            builder, kw = FAMILIES[name]
            out = tmp_path_factory.mktemp("vllm") / f"{name}_h32"
            built[name] = getattr(tiny, builder)(out, seed=0, head_dim=HEAD_DIM, **kw)
        return built[name]

    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_name(request):
    """Each name of `FAMILIES` in turn (module scope: one engine per family at a time)."""
    return request.param


@pytest.fixture(scope="session")
def start_engine():
    """``start_engine(path, **kw)``: a ``VLLMRolloutEngine`` on `path` with the test settings (its processor loaded as
    the trainer loads it). The caller closes it."""
    from mmrl.vlm.common import load_policy
    from mmrl.vlm.vllm_engine import VLLMRolloutEngine

    def start(path, **kw):
        _, processor = load_policy(path)
        return VLLMRolloutEngine(str(path), processor, **{**ENGINE_KW, "seed": 0, **kw})

    return start


@pytest.fixture(scope="session")
def vlm_requests():
    """Two image prompts (seeded noise images of two sizes) and a text-only prompt, as GenRequests."""
    import numpy as np
    from PIL import Image

    from mmrl.vlm.common import messages_from_text
    from mmrl.vlm.rollout import GenRequest

    rng = np.random.default_rng(0)
    a = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    b = Image.fromarray(rng.integers(0, 256, (56, 112, 3), dtype=np.uint8))
    return [GenRequest(messages=messages_from_text("<image>What color is the circle?"), images=[a]),
            GenRequest(messages=messages_from_text("<image>How many shapes are there?"), images=[b]),
            GenRequest(messages=messages_from_text("Name a colour and a shape."))]


def hf_logprobs(model, results, pad_id, temperature=1.0):
    """The HF model's log-probs of each result's response tokens (its forward on prompt + response), as lists."""
    from mmrl.vlm.batch import RolloutBatch

    batch = RolloutBatch.build(model, [r.prompt_ids for r in results], [r.response_ids for r in results],
                               [r.mm for r in results], pad_id)
    lp = batch.logprobs(model, 16, temperature)
    return [lp[i, :len(r.response_ids)].tolist() for i, r in enumerate(results)]


def max_diff(results, reference) -> float:
    """max |vLLM log-prob - reference| over every response token."""
    return max((abs(a - b) for r, ref in zip(results, reference) for a, b in zip(r.response_logprobs, ref)),
               default=0.0)


@pytest.fixture(scope="session")
def logprob_tools():
    return hf_logprobs, max_diff
