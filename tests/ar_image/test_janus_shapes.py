"""The shipped tiny Janus of the learning demo (assets/tiny_janus_shapes, built by mmrl.ar_image.pretrain_tiny): its
VQ decoder paints each token its palette colour (a random decoder does not), its briefly trained language model is
weakly prompt-conditioned (a random one is not), it loads and samples through the real path, and the pretraining
script is deterministic and refuses a foreign directory."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.ar_image import pretrain_tiny
from mmrl.ar_image.janus import JanusPolicy, load_janus
from mmrl.pipelines.data import load_prompts
from mmrl.pipelines.shapes import COLORS, parse_caption
from mmrl.rewards import load as load_reward
from mmrl.tiny import build_tiny_janus

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "assets" / "tiny_janus_shapes"
CPU = torch.device("cpu")
P_TRAINED_RANGE = (0.1, 0.7)


def _colour_scores(model) -> torch.Tensor:
    """[8, 8]: prompt_color of the one-token image of colour i's pure token (token 8 i), scored for colour j."""
    side = model.model.vqmodel.quantize.quant_state_dims[0]
    tokens = (torch.arange(len(COLORS)) * pretrain_tiny.SHADES)[:, None].expand(-1, side * side)
    images = JanusPolicy(model, None, guidance_scale=5.0).decode(tokens)
    reward = load_reward({"prompt_color": 1.0})
    return torch.stack([reward(images, ["x"] * len(COLORS), [{"color": c}] * len(COLORS)).scores
                        for c in COLORS], 1)


def _ideal_scores() -> torch.Tensor:
    """The same matrix for images painted exactly in the palette."""
    images = pretrain_tiny.token_palette()[:: pretrain_tiny.SHADES, :, None, None].expand(-1, 3, 16, 16)
    reward = load_reward({"prompt_color": 1.0})
    return torch.stack([reward(images, ["x"] * len(COLORS), [{"color": c}] * len(COLORS)).scores
                        for c in COLORS], 1)


def test_shipped_decoder_paints_every_token_its_colour_and_a_random_one_does_not(tmp_path):
    model, processor = load_janus(ASSET, CPU, torch.float32)  # the real loading path (from_pretrained)
    check = pretrain_tiny.palette_check(model)
    assert check["uniform_max_err"] < 0.15 and check["mosaic_mae"] < 0.06, check
    scores, ideal = _colour_scores(model), _ideal_scores()
    assert torch.equal(scores.argmax(1), torch.arange(len(COLORS)))  # each colour's token scores best for it
    assert scores.diagonal().min() > 0.85 and (scores - ideal).abs().max() < 0.15, scores
    # the same architecture before the decoder training: every token grey-ish, the check fails
    random_path = build_tiny_janus(tmp_path / "random", seed=0, image_size=16, patch_size=4, vq_top_width=4,
                                   aligner_dim=32)
    random_model, _ = load_janus(random_path, CPU, torch.float32)
    assert pretrain_tiny.palette_check(random_model)["uniform_max_err"] > 0.5
    assert _colour_scores(random_model).diagonal().min() < 0.2
    # sampling through the policy gives 16 x 16 images of palette colours
    policy = JanusPolicy(model, processor, guidance_scale=5.0)
    tokens, _ = policy.sample(policy.prompt_ids("a red circle on a blue background"), 2,
                              generator=torch.Generator().manual_seed(0))
    images = policy.decode(tokens)
    assert images.shape == (2, 3, 16, 16)
    cells = torch.nn.functional.avg_pool2d(images, 4).permute(0, 2, 3, 1).reshape(-1, 3)  # each token's cell
    err = (cells - pretrain_tiny.token_palette()[tokens.reshape(-1)]).norm(dim=1)
    # (pure-colour tokens, what the trained language model samples, blur more into contrasting neighbours than the
    # greyed shades of random grids: 0.13 mean here)
    assert err.mean() < 0.15 and err.max() < 0.3, err


def test_shipped_language_model_is_weakly_prompt_conditioned(tmp_path):
    """The language-model stage: on the held-out prompts the guided policy gives the pure token of the prompt's
    background colour (what `prompt_color` rewards) a probability well above the same model's before that stage
    (random language model: ~1 / 64) and far below certainty, and that colour is the likeliest at the first position for
    most prompts."""
    model, processor = load_janus(ASSET, CPU, torch.float32)
    prompts = [it.prompt for it in load_prompts(pretrain_tiny.EVAL_PROMPTS)]
    before = pretrain_tiny.pretrain_tiny_janus(tmp_path / "random_lm", steps=1, lm_steps=0)
    random_lm, _ = load_janus(before["path"], CPU, torch.float32)
    p_random = pretrain_tiny.background_token_prob(random_lm, processor, prompts)
    p_trained = pretrain_tiny.background_token_prob(model, processor, prompts)
    assert p_random < 0.03 and P_TRAINED_RANGE[0] < p_trained < P_TRAINED_RANGE[1], (p_random, p_trained)
    policy, names, best = JanusPolicy(model, processor, guidance_scale=5.0), list(COLORS), 0
    for p in prompts:  # the colour whose pure token is likeliest at the first image position
        probs = torch.softmax(policy.guided_logits(policy.prompt_ids(p), torch.zeros(1, 1, dtype=torch.long)), -1)
        best += names[int(probs[0, 0, ::pretrain_tiny.SHADES].argmax())] == parse_caption(p)["background"]
    assert best >= len(prompts) // 2, best  # 17 of 24 (by chance: 1 in 8)
    summary = json.loads((ASSET / "pretraining.json").read_text())
    assert summary["held_out/background_token_prob"] == pytest.approx(p_trained, rel=1e-5)
    assert before["held_out/prompt_color"] < 0.15 < summary["held_out/prompt_color"] < 0.5


def test_caption_grid_is_the_scene_in_pure_tokens():
    grid = pretrain_tiny.caption_grid("a red circle on a blue background", random.Random(0))
    red, blue = (list(COLORS).index(c) * pretrain_tiny.SHADES for c in ("red", "blue"))
    assert grid.shape == (16,) and set(grid.tolist()) <= {red, blue} and (grid == blue).sum() >= 8
    with pytest.raises(ValueError, match=r"caption_grid: expected a one-shape caption \('a red circle on a blue "
                                         r"background'\), got 'two red circles on a blue background'"):
        pretrain_tiny.caption_grid("two red circles on a blue background", random.Random(0))


def test_shipped_asset_is_the_scripts_default_build():
    summary = json.loads((ASSET / "pretraining.json").read_text())
    defaults = {k: p.default for k, p in inspect.signature(pretrain_tiny.pretrain_tiny_janus).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert {k: summary[k] for k in defaults} == defaults
    assert summary["trained/uniform_max_err"] < 0.15 < 0.5 < summary["random/uniform_max_err"]


def test_pretraining_is_deterministic_and_refuses_a_foreign_directory(tmp_path):
    a = pretrain_tiny.pretrain_tiny_janus(tmp_path / "a", steps=2, lm_steps=2)
    b = pretrain_tiny.pretrain_tiny_janus(tmp_path / "b", steps=2, lm_steps=2)
    wa, wb = (load_file(str(Path(x["path"]) / "model.safetensors")) for x in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["decoder/loss_last"] == b["decoder/loss_last"] and a["lm/loss_last"] == b["lm/loss_last"]
    pretrain_tiny.pretrain_tiny_janus(tmp_path / "a", steps=1, lm_steps=0)  # an earlier output: overwritten
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match=r"pretrain_tiny_janus: output directory '.*other' is not empty and "
                                              r"holds no pretraining.json; refusing to overwrite it"):
        pretrain_tiny.pretrain_tiny_janus(tmp_path / "other", steps=1, lm_steps=0)
    with pytest.raises(ValueError, match=r"pretrain_tiny_janus: steps must be >= 1 and lm_steps >= 0, got 0 and 1"):
        pretrain_tiny.pretrain_tiny_janus(tmp_path / "c", steps=0, lm_steps=1)
    with pytest.raises(ValueError, match=r"pretrain_tiny_janus: steps must be >= 1 and lm_steps >= 0, got 1 and -1"):
        pretrain_tiny.pretrain_tiny_janus(tmp_path / "c", steps=1, lm_steps=-1)


def test_demo_config_trains_on_the_shipped_model(tmp_path):
    from mmrl.ar_image import grpo
    from mmrl.config import load_config
    from mmrl.testing import metrics_rows

    cfg = load_config(REPO / "configs" / "ar_image" / "janus_grpo_tiny_shapes.yaml",
                      [f"output_dir={tmp_path / 'run'}", f"model.path={ASSET}",
                       f"data.train_prompts={REPO / 'assets' / 'prompts' / 'shapes_train.txt'}", "train.max_steps=1",
                       "rollout.prompts_per_step=2", "rollout.group_size=4", "update.micro_batch_size=8"])
    grpo.train(cfg)
    (row,) = metrics_rows(tmp_path / "run")
    assert 0 < row["reward/mean"] < 1 and row["reward/std"] > 0 and row["policy/grad_norm"] > 0
    # the first update's ratio is exactly 1 (old log-probs of the same weights): each micro-batch's log-probs are
    # those of its own rows in the update's shuffled order, not of the rows sorted by index
    assert row["policy/clipfrac"] == 0
