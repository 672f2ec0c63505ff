"""Editing end to end: edit rows -> source images through the conditioning (rollout, CFG negative, training) -> edit
rewards -> sample grids of source | edit -> `mmrl eval`; bad input as one clear line."""

import json
from pathlib import Path

import pytest
import torch

from mmrl import cli
from mmrl.config import load_config
from mmrl.diffusion.conditioning import check_items, encode_items, sample_panels
from mmrl.diffusion.models import PromptEmbedCache, load_flow_model
from mmrl.pipelines.data import PromptItem, load_prompts
from mmrl.pipelines.edits import load_sources
from mmrl.testing import metrics_rows

REPO = Path(__file__).resolve().parents[2]
EDIT_CONFIG = "configs/diffusion/flow_grpo_edit_tiny.yaml"
TRAIN, EVAL = "assets/edits/shapes_train/edits.jsonl", "assets/edits/shapes_eval/edits.jsonl"
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.num_steps=2", "rollout.eval_num_steps=2",
         "log.eval_max_prompts=2", "log.num_samples=4", "train.save_every=2", "model.lora.rank=4"]


def test_an_edit_model_without_source_images_is_one_line(tiny_family, tmp_path, capsys):
    code = cli.main(["train", EDIT_CONFIG, f"output_dir={tmp_path / 'a'}", f"model.path={tiny_family('FluxKontextPipeline')}",
                     "data.train_prompts=assets/prompts/shapes_train.txt", "data.eval_prompts="])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1
    err = errors[0]
    assert "data.train_prompts: FluxKontextModel (flux_kontext) edits a source image, but row 0 has no 'source_image'" in err


def test_a_text_model_given_edit_rows_is_one_line(tiny_sd3_path, tmp_path, capsys):
    code = cli.main(["train", "configs/diffusion/flow_grpo_tiny.yaml", f"output_dir={tmp_path / 'b'}",
                     f"model.path={tiny_sd3_path}", f"data.train_prompts={TRAIN}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "row 0 is an edit ('source_image' given) but SD3Model (sd3) generates from text only" in err


def test_offline_dpo_refuses_an_edit_model(tiny_family, tmp_path):
    from mmrl.diffusion.dpo import make_shapes_preference_file, train

    pairs = make_shapes_preference_file(tmp_path / "pairs", n_pairs=2)
    cfg = load_config("configs/diffusion/dpo_tiny_offline.yaml",
                      [f"output_dir={tmp_path / 'c'}", f"model.path={tiny_family('FluxKontextPipeline')}",
                       f"data.preference_file={pairs}", "data.eval_prompts="])
    with pytest.raises(ValueError, match="preference pairs carry no source images"):
        train(cfg)


def test_conditioning_helpers(tiny_family, tiny_sd3):
    items = load_prompts(REPO / TRAIN)[:2]
    with pytest.raises(ValueError, match="row 1 has no 'source_image'"):
        check_items(load_flow_model(tiny_family("FluxKontextPipeline")), [items[0], PromptItem("x")], "data.k")
    # a text model encodes through the given function (the prompt cache); an edit model with its sources
    cache = PromptEmbedCache(tiny_sd3)
    encode_items(tiny_sd3, [PromptItem("a red circle on a blue background")], 64, 64, cache)
    assert cache.misses == 1
    kontext = load_flow_model(tiny_family("FluxKontextPipeline"))
    emb = encode_items(kontext, items, 64, 64)
    assert torch.allclose(emb["image_latents"], kontext.encode_images(load_sources(items, 64, 64)))
    # grids: every result after its source
    results = torch.rand(2, 3, 64, 64)
    cells, caps = sample_panels(results, ["reward 1 | a", "reward 2 | b"], [it.metadata for it in items])
    assert cells.shape == (4, 3, 64, 64) and torch.equal(cells[1], results[0]) and torch.equal(cells[3], results[1])
    # "source (masked)" did not say what the mask does
    assert torch.equal(cells[0], load_sources(items[:1], 64, 64)[0]) and caps == [
        "source (edit only in mask)", "reward 1 | a", "source (edit only in mask)", "reward 2 | b"]
    # the eval grid's captions said "- r=0.5" / "x r=0.5": now what the number and the mark are
    from mmrl.eval.harness import grid_captions

    assert grid_captions([0.5, 0.25, 1.0], [None, {"checks": {"correct": False}}, {"checks": {"correct": True}}],
                         ["make the circle red", "a red circle", "a blue square"]) == [
        "reward 0.5 | make the circle red", "reward 0.25 | check failed | a red circle",
        "reward 1 | check ok | a blue square"]
    same, same_caps = sample_panels(results, ["a", "b"], [{}, {}])
    assert same is results and same_caps == ["a", "b"]


@pytest.mark.slow
def test_edit_training_and_eval_end_to_end(tiny_family, tmp_path):
    """The edit config on a tiny Kontext: 2 steps with sample grids and evaluation (source | edit cells), the edit
    rewards logged per component, then `mmrl eval` of the checkpoint with the same rewards and grid."""
    out = tmp_path / "run"
    args = [EDIT_CONFIG, f"output_dir={out}", f"model.path={tiny_family('FluxKontextPipeline')}",
            "train.max_steps=2", "log.sample_every=1", "log.eval_every=2", *SMALL]
    assert cli.main(["train", *args]) == 0
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/edit_region_color", "reward/edit_preservation", "eval/reward/edit_region_color"):
        assert key in rows[-1] and 0 <= rows[-1][key] <= 1, key
    from PIL import Image

    grid = Image.open(out / "samples" / "step_000001.png")
    # the grid's fixed prompts: the 2 held-out edits (log.eval_max_prompts=2), each result after its source, in one
    # row (cells scaled to 128 px)
    assert grid.size[0] == 4 * 128
    assert (out / "samples" / "eval_step_000002.png").is_file()
    assert cli.main(["eval", *args[:1], *args[1:3], *SMALL, "--max-prompts", "2"]) == 0  # the base editor
    assert json.loads((out / "eval" / "base" / "eval_report.json").read_text())["policy"]["mode"] == "base"
    assert cli.main(["eval", *args[:1], *args[1:3], *SMALL, "--checkpoint", str(out), "--max-prompts", "2"]) == 0
    report = json.loads((out / "eval" / "step_2" / "eval_report.json").read_text())
    assert report["num_prompts"] == 2 and set(report["components"]) == {"edit_region_color", "edit_preservation"}
    assert report["policy"]["mode"] == "lora" and Image.open(out / "eval" / "step_2" / "eval_grid.png").size[0] == 4 * 128
