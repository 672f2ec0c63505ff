"""reward_bt (`mmrl reward train`): the Bradley-Terry loss and the Wilson interval by hand, a tiny CLIP that learns a
prompt-dependent preference, the exported reward scoring exactly as it trained (zoo load and `mmrl reward score`),
an exact resume, and one-line errors for bad preference files."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mmrl import cli
from mmrl.config import load_config, to_yaml
from mmrl.reward_train.accuracy import bradley_terry_loss, pair_accuracy, wilson_interval
from mmrl.reward_train.bt import evaluate, make_color_preference_file, split_pairs, train
from mmrl.testing import RESUMED_RUN, assert_close_across_paths, assert_same_path, metrics_rows, without_time


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from mmrl.tiny import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "clip", seed=0)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return make_color_preference_file(tmp_path_factory.mktemp("prefs"))


def _cfg(out, clip_dir, pairs_file, *overrides):
    d = {"algorithm": "reward_bt", "output_dir": str(out), "device": "cpu", "num_threads": 1,
         "model": {"path": str(clip_dir)}, "data": {"pairs": str(pairs_file)}, "optim": {"lr": 1e-3},
         "update": {"pairs_per_step": 8, "micro_batch_size": 8}, "train": {"max_steps": 40, "save_every": 0},
         "log": {"eval_every": 20}}
    return load_config(d, list(overrides))


def test_wilson_interval_hand_computed():
    # p = 0.8, z^2 = 3.8415: centre (0.8 + 0.19207) / 1.38415 = 0.71674, half 1.41601 * sqrt(0.016 + 0.0096037)
    # = 0.22658 (the textbook values for 8 of 10: 0.4902 .. 0.9433)
    assert wilson_interval(8, 10) == pytest.approx((0.49016, 0.94332), abs=1e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.72246, 1.0), abs=1e-5)  # 1 - 10 / (10 + z^2)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27754), abs=1e-5)
    assert wilson_interval(50, 100) == pytest.approx((0.40383, 0.59617), abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    m = pair_accuracy(torch.tensor([2.0, 1.0, 0.0, 5.0]), torch.tensor([1.0, 1.0, 1.0, 4.0]))
    # an equal score is no correct prediction: 2 of 4
    assert m["eval/pair_accuracy"] == 0.5 and m["eval/pairs"] == 4
    assert (m["eval/pair_accuracy_lo"], m["eval/pair_accuracy_hi"]) == wilson_interval(2, 4)


def test_bradley_terry_loss_is_pickscores_two_image_cross_entropy():
    s0, s1 = torch.tensor([21.5, 19.0, 18.0]), torch.tensor([20.0, 22.5, 18.0])
    # PickScore: cross-entropy over the pair's two logits, label (1, 0) = image 0 preferred
    pickscore = F.cross_entropy(torch.stack([s0, s1], -1), torch.zeros(3, dtype=torch.long))
    assert bradley_terry_loss(s0, s1).item() == pytest.approx(pickscore.item(), rel=1e-6)
    assert bradley_terry_loss(torch.zeros(1), torch.zeros(1)).item() == pytest.approx(math.log(2))


def test_tiny_clip_learns_and_the_exported_reward_scores_as_trained(tmp_path, clip_dir, pairs_file, capsys):
    import mmrl.rewards

    out = tmp_path / "run"
    cfg = _cfg(out, clip_dir, pairs_file)
    summary = train(cfg)
    rows = metrics_rows(out)
    evals = [r for r in rows if "eval/pair_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 20, 40]
    # before training the prompt-blind tiny CLIP gets half of the held-out prompts' pairs right; after: all
    assert evals[0]["eval/pair_accuracy"] <= 0.75 and evals[-1]["eval/pair_accuracy"] >= 0.8
    assert (evals[-1]["eval/pair_accuracy_lo"], evals[-1]["eval/pair_accuracy_hi"]) == wilson_interval(
        round(evals[-1]["eval/pair_accuracy"] * evals[-1]["eval/pairs"]), evals[-1]["eval/pairs"])
    assert summary["eval/pair_accuracy"] == evals[-1]["eval/pair_accuracy"]
    # the held-out pairs are whole prompts the model never trained on; the 2 ties are dropped
    train_pairs, eval_pairs = split_pairs(cfg)
    assert len(train_pairs) + len(eval_pairs) == 80 and not {p.prompt for p in train_pairs} & {p.prompt for p in eval_pairs}
    # the exported directory, loaded from the zoo, gives the last evaluation's numbers exactly
    reward_dir = out / "reward"
    spec = json.loads((reward_dir / "mmrl_reward.json").read_text())
    assert spec["reward"] == "pickscore" and spec["eval"]["eval/pair_accuracy"] == evals[-1]["eval/pair_accuracy"]
    loaded = mmrl.rewards.load("learned_pref", weights=str(reward_dir), batch_size=16, device="cpu")
    again = evaluate(loaded, eval_pairs, 8)
    assert_same_path(again, {k: v for k, v in evals[-1].items() if k.startswith("eval/")},
                     why="full fine-tuning: the trained weights saved and loaded into the same pickscore scoring call")
    pickscore = mmrl.rewards.load("pickscore", weights=str(reward_dir), batch_size=16, device="cpu")  # a CLIP dir
    assert_same_path(evaluate(pickscore, eval_pairs, 8), again, why="learned_pref builds this pickscore")
    # `mmrl reward score` with the trained directory
    images = [eval_pairs[0].chosen, eval_pairs[0].rejected]
    (tmp_path / "prompts.txt").write_text(f"{eval_pairs[0].prompt}\n{eval_pairs[0].prompt}\n")
    capsys.readouterr()
    assert cli.main(["reward", "score", "learned_pref", "--weights", str(reward_dir), "--images", *map(str, images),
                     "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "s.jsonl")]) == 0
    scored = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(scored) == 2 and scored[0]["score"] > scored[1]["score"]  # the chosen image wins


def test_lora_resumed_run_equals_uninterrupted(tmp_path, clip_dir, pairs_file):
    import mmrl.rewards

    extra = ["model.lora.rank=4", "optim.lr=1e-2", "train.save_every=3", "log.eval_every=3"]
    train(_cfg(tmp_path / "full", clip_dir, pairs_file, "train.max_steps=6", *extra))
    (tmp_path / "half.yaml").write_text(to_yaml(_cfg(tmp_path / "half", clip_dir, pairs_file, "train.max_steps=3",
                                                     *extra)))
    assert cli.main(["train", str(tmp_path / "half.yaml")]) == 0  # `mmrl train` runs the recipe too
    assert cli.main(["reward", "train", str(tmp_path / "half" / "config.yaml"), "train.max_steps=6"]) == 0
    a, b = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "half")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4, 5, 6]
    assert_same_path([without_time(r) for r in a], [without_time(r) for r in b], why=RESUMED_RUN)
    ra, rb = (mmrl.rewards.load("learned_pref", weights=str(d / "reward"), device="cpu")
              for d in (tmp_path / "full", tmp_path / "half"))
    assert_same_path(ra.clip.model.state_dict(), rb.clip.model.state_dict(), why=RESUMED_RUN + "; the same merge")
    # the merged LoRA scores as the adapters did in training (merging reorders the float sums)
    _, eval_pairs = split_pairs(load_config(tmp_path / "full" / "config.yaml"))
    merged = evaluate(ra, eval_pairs, 8)
    assert_close_across_paths(merged["eval/margin"], a[-1]["eval/margin"], what="merged vs adapter LoRA")
    assert merged["eval/pair_accuracy"] == a[-1]["eval/pair_accuracy"]


def _error(capsys, *argv) -> str:
    capsys.readouterr()
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_bad_preference_files_are_one_line_errors(tmp_path, clip_dir, capsys):
    cfg = tmp_path / "bt.yaml"
    cfg.write_text(f"algorithm: reward_bt\noutput_dir: {tmp_path / 'run'}\nmodel:\n  path: {clip_dir}\n")
    pairs = tmp_path / "pairs.jsonl"
    err = _error(capsys, "reward", "train", str(cfg), f"data.pairs={pairs}")
    assert err.startswith(f"mmrl: error: data.pairs: preference file not found: {pairs}")
    (tmp_path / "a.png").write_bytes(b"")  # only its existence is checked before training
    good = {"prompt": "a red car", "image_0": "a.png", "image_1": "a.png", "label_0": 1}
    pairs.write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != "label_0"}) + "\n")
    err = _error(capsys, "reward", "train", str(cfg), f"data.pairs={pairs}")
    assert err.startswith(f"mmrl: error: {pairs}: row 1 has no 'label_0' (keys: ['image_0', 'image_1', 'prompt'])")
    pairs.write_text(json.dumps(good | {"image_1": "missing.png"}) + "\n")
    err = _error(capsys, "reward", "train", str(cfg), f"data.pairs={pairs}")
    assert err.startswith(f"mmrl: error: {pairs}: image '{tmp_path / 'missing.png'}' of the pair with prompt 'a red "
                          f"car' not found (relative paths are taken from {tmp_path})")
    pairs.write_text((json.dumps(good | {"label_0": 0.5}) + "\n") * 3)
    err = _error(capsys, "reward", "train", str(cfg), f"data.pairs={pairs}")
    assert err.startswith(f"mmrl: error: {pairs}: all 3 rows are ties (label_0 = 0.5): a tie prefers neither image")
    err = _error(capsys, "reward", "train", "configs/diffusion/flow_grpo_tiny.yaml")
    assert err.startswith("mmrl: error: mmrl reward train: configs/diffusion/flow_grpo_tiny.yaml has algorithm: "
                          "flow_grpo, expected reward_bt")
    err = _error(capsys, "reward", "train", str(cfg), f"data.pairs={pairs}", "dtype=bfloat16")
    assert err.startswith("mmrl: error: dtype=bfloat16: full fine-tuning (model.lora.rank=0) trains every weight")
    assert not (tmp_path / "run").exists()  # every check ran before the run directory was made


def test_vlm_head_backbone_trains_a_lora_and_exports_an_hpsv3_checkpoint(tmp_path):
    """The VLM-with-head backbone: the tiny HPSv3 (Qwen2-VL + MLP head) gets LoRA on its decoder attention and head;
    the export is an HPSv3.safetensors the zoo's hpsv3 loads, scoring as the adapters did."""
    import mmrl.rewards
    from mmrl.tiny.hpsv3 import build_tiny_hpsv3

    tiny = build_tiny_hpsv3(tmp_path / "hps")
    pairs = make_color_preference_file(tmp_path / "prefs", n_pairs=8, ties=0)
    cfg = load_config({"algorithm": "reward_bt", "output_dir": str(tmp_path / "run"), "device": "cpu",
                       "num_threads": 1, "model": {"backbone": "vlm_head", "path": str(tiny / "HPSv3.safetensors"),
                                                   "processor": str(tiny / "base"), "lora": {"rank": 4},
                                                   "kwargs": {"min_pixels": 56 * 56, "max_pixels": 56 * 56}},
                       "data": {"pairs": str(pairs)}, "optim": {"lr": 1e-2},
                       "update": {"pairs_per_step": 2, "micro_batch_size": 2}, "train": {"max_steps": 2}})
    train(cfg)
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["eval/pairs"] == 2
    assert rows[1]["train/grad_norm"] > 0
    spec = json.loads((tmp_path / "run" / "reward" / "mmrl_reward.json").read_text())
    assert (spec["reward"], spec["weights"]) == ("hpsv3", "HPSv3.safetensors")
    assert spec["kwargs"] == {"processor": str((tiny / "base").resolve()), "dtype": "float32", "min_pixels": 3136,
                              "max_pixels": 3136}
    loaded = mmrl.rewards.load("learned_pref", weights=str(tmp_path / "run" / "reward"), device="cpu")
    _, eval_pairs = split_pairs(cfg)
    assert_close_across_paths(evaluate(loaded, eval_pairs, 2)["eval/margin"], rows[-1]["eval/margin"],
                              what="merged vs adapter LoRA")


def test_a_start_after_one_that_wrote_no_checkpoint_logs_step_0_once(tmp_path, clip_dir, pairs_file):
    import shutil

    cfg = _cfg(tmp_path / "run", clip_dir, pairs_file, "train.max_steps=2")
    train(cfg)
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # as if it had died before its first checkpoint
    train(cfg)
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [0, 1, 2]


def test_learned_pref_names_a_directory_that_is_not_an_export(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["reward", "score", "learned_pref", "--weights", str(tmp_path), "--images", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert err == (f"mmrl reward: error: learned_pref: '{tmp_path}' has no mmrl_reward.json: not a directory written "
                   f"by `mmrl reward train` (its <output_dir>/reward)")
