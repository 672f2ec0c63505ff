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
                   "perf/")


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
def tiny_sd3_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "pipe")


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux") / "pipe")


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """`tiny_family("QwenImagePipeline")` -> the path of that family's tiny pipeline (`mmrl.tiny.FAMILY_BUILDERS`),
    built once per session."""
    from mmrl.tiny import FAMILY_BUILDERS

    built = {}

    def get(class_name):
        if class_name not in built:
            built[class_name] = FAMILY_BUILDERS[class_name](tmp_path_factory.mktemp(class_name) / "pipe")
        return built[class_name]

    return get


@pytest.fixture(scope="session")
def tiny_wan_path(tmp_path_factory):
    from mmrl.tiny.family_models import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan") / "pipe")


@pytest.fixture(scope="session")
def tiny_wan22_path(tmp_path_factory):
    from mmrl.tiny.family_models import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan22") / "pipe", variant="2.2_a14b")


@pytest.fixture(scope="session")
def tiny_z_image_path(tmp_path_factory):
    from mmrl.tiny.family_models import build_tiny_z_image

    return build_tiny_z_image(tmp_path_factory.mktemp("tiny_z_image") / "pipe")


@pytest.fixture(scope="session")
def tiny_flux2_path(tmp_path_factory):
    from mmrl.tiny.family_models import build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("tiny_flux2") / "pipe")


@pytest.fixture(scope="session")
def tiny_flux2_klein_path(tmp_path_factory):
    from mmrl.tiny.family_models import build_tiny_flux2_klein

    return build_tiny_flux2_klein(tmp_path_factory.mktemp("tiny_flux2_klein") / "pipe")


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
