"""Tiny real-architecture pipelines shared by the diffusion tests (built once per session)."""

import os

import pytest
import torch

# Tiny models on a shared 2-core machine: one intra-op thread is 10x+ faster than two (no spin-waiting).
torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")


# every metrics.jsonl key of a recipe starts with one of these (issue 12's naming scheme), or is "step"
METRIC_PREFIXES = ("reward/", "policy/", "kl/", "train/", "rollout/", "eval/", "time/", "diag/", "cost/", "dist/",
                   "perf/", "async/")


@pytest.fixture
def check_metric_names():
    """Assert that every key of every metrics row starts with one of METRIC_PREFIXES (or is "step")."""

    def check(rows):
        keys = sorted({k for r in rows for k in r})
        bad = [k for k in keys if k != "step" and not k.startswith(METRIC_PREFIXES)]
        assert rows and not bad, f"metric names outside {METRIC_PREFIXES}: {bad}"
        return keys

    return check


@pytest.fixture(scope="session")
def tiny_case(tmp_path_factory):
    """`tiny_case("wan22_a14b")` -> the path of that tiny case's checkpoint (`mmrl.diffusion.models.tiny_cases()`:
    declared by each family's file), built once per session."""
    from mmrl.diffusion.models import tiny_cases

    cases, built = tiny_cases(), {}

    def get(name):
        if name not in built:
            built[name] = cases[name].build_at(tmp_path_factory.mktemp(name) / "pipe")
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_family(tiny_case):
    """`tiny_family("QwenImagePipeline")` -> the path of that family's (first) tiny case."""
    from mmrl.diffusion.models import tiny_cases

    first = {}
    for case in tiny_cases().values():
        first.setdefault(case.pipeline, case.name)
    return lambda class_name: tiny_case(first[class_name])


@pytest.fixture(scope="session")
def tiny_sd3_path(tiny_case):
    return tiny_case("sd3")


@pytest.fixture(scope="session")
def tiny_flux_path(tiny_case):
    return tiny_case("flux")


@pytest.fixture(scope="session")
def tiny_wan_path(tiny_case):
    return tiny_case("wan21")


@pytest.fixture(scope="session")
def tiny_wan22_path(tiny_case):
    return tiny_case("wan22_a14b")


@pytest.fixture(scope="session")
def tiny_z_image_path(tiny_case):
    return tiny_case("z_image")


@pytest.fixture(scope="session")
def tiny_flux2_path(tiny_case):
    return tiny_case("flux2")


@pytest.fixture(scope="session")
def tiny_flux2_klein_path(tiny_case):
    return tiny_case("flux2_klein")


@pytest.fixture(scope="session")
def tiny_sd3(tiny_sd3_path):
    from mmrl.diffusion.models import load_flow_model

    return load_flow_model(tiny_sd3_path)


# A reward that fails like a custom reward or a remote server can: NaN for image 1 of every batch (brightness for
# the others). Registered for the non-finite-reward tests of the three diffusion recipes.
from mmrl.rewards import RewardModel, RewardOutput, register  # noqa: E402


@register("_test_nan_at_1")
class NanAtOneReward(RewardModel):
    name = "_test_nan_at_1"

    def __init__(self, device=None):
        pass

    def score_images(self, images, prompts, metadata):
        s = images.float().mean(dim=(1, 2, 3))
        s[1] = float("nan")
        return RewardOutput(s, {"brightness": s.clone()})
