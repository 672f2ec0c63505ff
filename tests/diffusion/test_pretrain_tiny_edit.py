"""Pretraining the tiny shapes editor: the CLI (short form of the command in docs/editing.md) writes a
FluxKontextPipeline that loads as the Kontext family and edits, and the shipped asset is that pipeline."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from mmrl.diffusion.models import load_flow_model
from mmrl.diffusion.models.flux_kontext import FluxKontextModel

REPO = Path(__file__).resolve().parents[2]


def test_cli_writes_a_kontext_editor(tmp_path):
    """`python -m mmrl.diffusion.pretrain_tiny_edit OUT --steps N`, 2 steps on 8 edits."""
    out = tmp_path / "kontext"
    proc = subprocess.run([sys.executable, "-m", "mmrl.diffusion.pretrain_tiny_edit", str(out), "--steps", "2",
                           "--pool-size", "8", "--batch-size", "4", "--threads", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "pretraining.json").read_text())
    assert summary["steps"] == 2 and summary["pool_size"] == 8 and torch.isfinite(torch.tensor(summary["transformer/loss"]))
    assert "_name_or_path" not in (out / "transformer" / "config.json").read_text()  # no temp path in the asset
    m = load_flow_model(out, max_sequence_length=16)
    assert isinstance(m, FluxKontextModel) and m.has_guidance_embedding


def test_shipped_editor_is_the_documented_pipeline():
    path = REPO / "assets" / "tiny_kontext_shapes"
    summary = json.loads((path / "pretraining.json").read_text())
    assert (summary["steps"], summary["pool_size"], summary["guidance"], summary["max_sequence_length"]) == (1200, 4096,
                                                                                                            2.5, 16)
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    m = load_flow_model(path, max_sequence_length=16)
    assert sum(p.numel() for p in m.transformer.parameters()) == 483_280  # the size docs/editing.md states
    assert m.vae.config.latent_channels == 4  # the shapes VAE of assets/tiny_sd3_shapes
