"""`model.gradient_checkpointing` of the diffusion recipes: the transformer's blocks are recomputed in the backward
pass (diffusers' own checkpointing); the gradients of a CFG training forward equal those without it, for LoRA and
for full fine-tuning, and the FLOPs meter counts the model FLOPs once (the recomputation is not model work)."""

from __future__ import annotations

import pytest
import torch

from mmrl.diffusion.config import ModelConfig
from mmrl.training import attach_flops_meter


def _grads(path, gc: bool, rank: int):
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.models import load_flow_model

    model = load_flow_model(path)
    torch.manual_seed(0)
    cfg = ModelConfig(path=str(path), gradient_checkpointing=gc)
    cfg.lora.rank = rank
    states = build_policy_states(model, cfg, old=False, ref=False)
    assert model.transformer.gradient_checkpointing is gc
    meter = attach_flops_meter(states.model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=g)
    emb = model.encode_prompts(["a red circle", "a blue square"])
    v = model.velocity(x, torch.tensor([0.3, 0.8]), emb, guidance_scale=3.0)
    v.pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in states.named_trainable_parameters()}, meter.pop()


@pytest.mark.parametrize("rank", [4, 0])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_sd3_path, rank):
    (plain, flops_plain), (ckpt, flops_ckpt) = _grads(tiny_sd3_path, False, rank), _grads(tiny_sd3_path, True, rank)
    assert sorted(plain) == sorted(ckpt) and plain
    worst = max(float((plain[k] - ckpt[k]).abs().max()) for k in plain)
    scale = max(float(v.abs().max()) for v in plain.values())
    assert scale > 0 and worst <= 1e-6 * scale, (worst, scale)
    assert flops_plain == flops_ckpt > 0
