"""Tiny real-architecture pipelines shared by the diffusion tests (built once per session)."""

import os

import pytest
import torch

# Tiny models on a shared 2-core machine: one intra-op thread is 10x+ faster than two (no spin-waiting).
torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "pipe")


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    from mmrl.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux") / "pipe")


@pytest.fixture(scope="session")
def tiny_sd3(tiny_sd3_path):
    from mmrl.diffusion.models import load_flow_model

    return load_flow_model(tiny_sd3_path)
