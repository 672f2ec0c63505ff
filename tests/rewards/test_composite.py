"""Composite reward: weighted sums checked by hand against each component's own scores."""

import pytest
import torch

from mmrl.rewards import RewardModel, RewardOutput, load
from mmrl.rewards.base import jpeg_size_kb
from mmrl.rewards.composite import CompositeReward


def _images(n=4, seed=0, size=16):
    g = torch.Generator().manual_seed(seed)
    # uint8-grid images with different amounts of noise -> different JPEG sizes
    base = torch.rand(n, 3, size, size, generator=g)
    amount = torch.linspace(0.0, 1.0, n).view(n, 1, 1, 1)
    return ((0.5 * (1 - amount) + base * amount) * 255).round() / 255


class MeanBrightness(RewardModel):
    """Differentiable toy reward: mean pixel value (used to check gradients through the composite)."""

    name = "test_mean_brightness"
    differentiable = True

    def __init__(self, device=None):
        pass

    def score_images(self, images, prompts, metadata):
        return RewardOutput(images.mean(dim=(1, 2, 3)), {"brightness": images.mean(dim=(1, 2, 3)).detach()})


def test_weighted_sum_by_hand_and_details():
    imgs = _images()
    kb = jpeg_size_kb(imgs, 95)
    comp = load({"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5})
    assert isinstance(comp, CompositeReward)
    out = comp(imgs)
    # -kb * 1.0 + kb * 0.5 = -0.5 kb
    torch.testing.assert_close(out.scores, -0.5 * kb)
    torch.testing.assert_close(out.details["jpeg_compressibility"], -kb)
    torch.testing.assert_close(out.details["jpeg_incompressibility"], kb)
    torch.testing.assert_close(out.details["jpeg_compressibility/jpeg_kb"], kb)
    assert set(out.details) == {"jpeg_compressibility", "jpeg_compressibility/jpeg_kb", "jpeg_incompressibility",
                                "jpeg_incompressibility/jpeg_kb"}
    assert comp.differentiable is False and comp.kind == "image"


def test_component_kwargs_and_same_reward_twice():
    imgs = _images()
    comp = CompositeReward.from_mapping({
        "q50": {"reward": "jpeg_incompressibility", "weight": 2.0, "quality": 50},
        "q95": {"reward": "jpeg_incompressibility", "weight": -1.0},
    }, device="cpu")  # shared kwargs reach every component's load
    out = comp(imgs)
    kb50, kb95 = jpeg_size_kb(imgs, 50), jpeg_size_kb(imgs, 95)
    torch.testing.assert_close(out.scores, 2.0 * kb50 - kb95)
    torch.testing.assert_close(out.details["q50"], kb50)
    assert comp.weights == {"q50": 2.0, "q95": -1.0}


def test_mixed_image_and_text_components():
    imgs = _images()
    completions = ["<think>a</think><answer>1</answer>", "1", "<think>b</think>\\boxed{2}", "2"]
    metadata = [{"answer": "1"}, {"answer": "2"}, {"answer": "2"}, {"answer": "2"}]
    comp = load({"jpeg_compressibility": 0.1, "format": 1.0, "math_accuracy": 2.0})
    out = comp(imgs, metadata=metadata, completions=completions)
    fmt = torch.tensor([1.0, 0.0, 1.0, 0.0])
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(out.scores, -0.1 * jpeg_size_kb(imgs) + fmt + 2.0 * acc)
    assert out.details["math_accuracy/extracted"] == ["1", "1", "2", "2"]
    with pytest.raises(ValueError, match="component 'format' scores text"):
        comp(imgs, metadata=metadata)
    with pytest.raises(ValueError, match="component 'jpeg_compressibility' scores images"):
        comp(metadata=metadata, completions=completions)
    text_only = load({"format": 1.0, "math_accuracy": 1.0})
    assert text_only.kind == "text"
    assert text_only(completions=completions, metadata=metadata).scores.tolist() == [2.0, 0.0, 2.0, 1.0]


def test_batch_normalisation_z_scores():
    completions = ["<think>a</think><answer>1</answer>", "1", "<think>b</think><answer>2</answer>", "2"]
    metadata = [{"answer": "1"}, {"answer": "1"}, {"answer": "1"}, {"answer": "2"}]
    comp = load({"components": {"format": 1.0, "math_accuracy": 3.0}, "normalize": "batch"})
    out = comp(completions=completions, metadata=metadata)
    # format [1,0,1,0]: mean .5, std .5 -> z [1,-1,1,-1]; accuracy [1,1,0,1]: mean .75, std sqrt(3)/4
    z_fmt = torch.tensor([1.0, -1.0, 1.0, -1.0])
    acc = torch.tensor([1.0, 1.0, 0.0, 1.0])
    z_acc = (acc - 0.75) / (3 ** 0.5 / 4)
    torch.testing.assert_close(out.scores, z_fmt + 3.0 * z_acc, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.details["format"], torch.tensor([1.0, 0.0, 1.0, 0.0]))  # raw stays raw
    torch.testing.assert_close(out.details["math_accuracy/normalized"], z_acc, atol=1e-4, rtol=1e-4)
    # a constant component contributes 0, not NaN
    const = load({"format": 1.0}, normalize="batch")(completions=["x", "y"])
    assert const.scores.tolist() == [0.0, 0.0]


def test_yaml_mapping(tmp_path):
    imgs = _images()
    p = tmp_path / "reward.yaml"
    p.write_text("jpeg_compressibility: 1.0\njpeg_incompressibility:\n  weight: 0.25\n  quality: 50\n")
    comp = CompositeReward.from_mapping(str(p))
    torch.testing.assert_close(comp(imgs).scores, -jpeg_size_kb(imgs) + 0.25 * jpeg_size_kb(imgs, 50))
    assert CompositeReward.from_yaml(p).weights == {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.25}
    assert load("composite", components=str(p)).weights == comp.weights
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        CompositeReward.from_mapping(str(tmp_path / "missing.yaml"))
    p.write_text("jpeg_compressibility: [1\n")
    with pytest.raises(ValueError, match="reward.yaml' is not valid YAML"):
        CompositeReward.from_yaml(p)


def test_differentiable_only_if_all_components_are():
    imgs = _images().requires_grad_(True)
    comp = CompositeReward({"brightness": MeanBrightness()}, {"brightness": 2.0})
    assert comp.differentiable is True
    out = comp(imgs)
    out.scores.sum().backward()
    # d/dx of 2 * mean over 3*16*16 values
    torch.testing.assert_close(imgs.grad, torch.full_like(imgs, 2.0 / (3 * 16 * 16)))
    mixed = CompositeReward({"brightness": MeanBrightness(), "jpeg": load("jpeg_compressibility")},
                            {"brightness": 1.0, "jpeg": 1.0})
    assert mixed.differentiable is False


def test_errors_are_clear():
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        load({"nope": 1.0})
    with pytest.raises(ValueError, match="component 'jpeg_compressibility': expected a weight"):
        load({"jpeg_compressibility": "heavy"})
    with pytest.raises(ValueError, match="normalize must be one of"):
        load({"jpeg_compressibility": 1.0}, normalize="rank")
    with pytest.raises(TypeError, match="component 'jpeg_compressibility'"):
        load({"jpeg_compressibility": {"weight": 1.0, "bogus_kw": 3}})
    with pytest.raises(ValueError, match="unknown keys"):
        load({"components": {"jpeg_compressibility": 1.0}, "extra": 1})
    with pytest.raises(ValueError, match="at least one component"):
        load({})
