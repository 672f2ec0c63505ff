"""`mmrl eval` and the GenEval-style shapes check: the detector on rendered ground truth (hand-checked scenes,
sampled scenes, the shipped GenEval prompt file), wrong prompts scoring 0, and the harness end to end on the
shapes-pretrained tiny SD3 (base model and a 1-step Flow-GRPO checkpoint), every reported number recomputed
independently (images re-sampled without the harness, rewards and checks re-scored from the saved PNGs)."""

import hashlib
import json
import os
import shutil
import random
import statistics
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image, ImageFilter

from mmrl.cli import main
from mmrl.pipelines.shapes_check import (ObjectSpec, ShapesPrompt, accuracy, check_images, check_prompt, detect_shapes,
                                    parse_shapes_prompt, scene_for_prompt)
from mmrl.pipelines.data import load_prompts
from mmrl.pipelines.shapes import Shape, render_scene, sample_scene

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "assets" / "tiny_sd3_shapes"
GENEVAL = REPO / "assets" / "prompts" / "shapes_geneval.txt"
EVAL_PROMPTS = REPO / "assets" / "prompts" / "shapes_eval.txt"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MMRL_NO_PROGRESS", "1")


# ---------------------------------------------------------------------------------------- prompt grammar


def test_parse_caption_and_position_grammar():
    p = parse_shapes_prompt("two red circles and a blue square on a white background")
    assert p == ShapesPrompt((ObjectSpec(2, "red", "circle"), ObjectSpec(1, "blue", "square")), "white", None)
    assert parse_shapes_prompt("Two red circles") == ShapesPrompt((ObjectSpec(2, "red", "circle"),), None, None)
    p = parse_shapes_prompt("a blue square left of a green circle")
    assert p == ShapesPrompt((ObjectSpec(1, "blue", "square"), ObjectSpec(1, "green", "circle")), None, "left of")
    p = parse_shapes_prompt("an orange triangle above a red square on a black background")
    assert (p.relation, p.background, p.objects[0].color) == ("above", "black", "orange")
    # every caption the shapes world writes parses back to its scene's objects
    rng = random.Random(0)
    for _ in range(30):
        scene = sample_scene(rng, n_shapes=(1, 4))
        p = parse_shapes_prompt(scene.caption)
        want = sorted((s.color, s.kind) for s in scene.shapes)
        assert sorted((o.color, o.kind) for o in p.objects for _ in range(o.count)) == want
        assert p.background == scene.background
    with pytest.raises(ValueError, match="'dog' is not one of"):
        parse_shapes_prompt("a red dog on a blue background")
    with pytest.raises(ValueError, match="colour 'teal'"):
        parse_shapes_prompt("a teal circle")
    with pytest.raises(ValueError, match="one object to one object"):
        parse_shapes_prompt("two red circles left of a blue square")


# ---------------------------------------------------------------------------------------- detector


def _hand_scene():
    """64 px, white background: red circle centred (16, 16) px of side 19.2 px, blue square centred (48, 19.2)
    -> pixels x 40..55, y 11..26 (PIL rectangle [round(48-8), round(19.2-8), round(48+8)-1, round(19.2+8)-1]),
    i.e. 16 x 16 = 256 px, centre (47.5 + 0.5) / 64 = 0.75, (18.5 + 0.5) / 64 = 0.296875; yellow triangle
    centred (32, 48)."""
    shapes = [Shape("circle", "red", 0.25, 0.25, 0.3), Shape("square", "blue", 0.75, 0.3, 0.25),
              Shape("triangle", "yellow", 0.5, 0.75, 0.3)]
    return render_scene(shapes, "white", 64)


def test_detector_hand_checked_scene():
    det = detect_shapes(_hand_scene())
    assert det.background == "white"
    found = {o.color: o for o in det.objects}
    assert sorted((o.color, o.kind) for o in det.objects) == [("blue", "square"), ("red", "circle"),
                                                              ("yellow", "triangle")]
    sq = found["blue"]
    assert (sq.x, sq.y, sq.area, sq.fill) == (0.75, 0.296875, 256 / 4096, 1.0)
    assert found["red"].fill == pytest.approx(np.pi / 4, abs=0.05)  # a disc fills pi/4 of its box
    assert found["red"].x == pytest.approx(0.25, abs=1 / 64) and found["red"].y == pytest.approx(0.25, abs=1 / 64)
    assert found["yellow"].taper < 0.5 < found["red"].taper  # narrow top third: an upward triangle
    # the same image as a float tensor [3, H, W] and as a uint8 array gives the same detection
    arr = np.array(_hand_scene())
    assert detect_shapes(torch.from_numpy(arr).permute(2, 0, 1).float() / 255) == det
    assert detect_shapes(arr) == det


def test_right_prompt_scores_1_and_wrong_prompts_score_0():
    det = detect_shapes(_hand_scene())

    def check(prompt):
        return check_prompt(parse_shapes_prompt(prompt), det)

    right = check("a red circle, a blue square and a yellow triangle on a white background")
    assert right == {"object": True, "color": True, "count": True, "position": None, "background": True,
                     "correct": True, "exact": True}
    # GenEval does not mind objects the prompt leaves out; `exact` (reported apart, not in `correct`) does
    partial = check("a red circle on a white background")
    assert partial["correct"] is True and partial["exact"] is False
    assert check("a red circle left of a blue square")["correct"]  # x 0.25 < 0.75
    assert check("a yellow triangle below a blue square")["correct"]  # y 0.75 > 0.30
    wrong = {  # prompt -> the one check that fails
        "a green circle on a white background": "color",  # a circle exists, not a green one
        "a red square on a white background": "color",  # a square exists (blue), not a red one
        "two red circles on a white background": "count",
        "a red circle right of a blue square": "position",
        "a red circle below a blue square": "position",  # y 0.25 vs 0.30: above, not below
        "a red circle on a black background": "background",
    }
    for prompt, failing in wrong.items():
        c = check(prompt)
        assert c["correct"] is False and c[failing] is False, (prompt, c)
    assert check("a purple triangle")["object"] is True and check("a red square")["object"] is True
    c = check("a blue circle")  # a circle exists (red), so object passes; no blue circle
    assert (c["object"], c["color"], c["count"]) == (True, False, False)
    # within the margin the relation is not decided: "above" needs y_a < y_b - 0.05; 0.25 vs 0.296875 -> fails
    assert check("a red circle above a blue square")["position"] is False
    assert check_prompt(parse_shapes_prompt("a red circle above a blue square"), det, position_margin=0.01)["position"]


def test_detector_exact_on_sampled_scenes():
    rng = random.Random(7)
    for size in (64, 96, 256):
        for _ in range(25):
            scene = sample_scene(rng, n_shapes=(1, 5), size=size)
            det = detect_shapes(scene.image)
            assert det.background == scene.background
            assert sorted((o.color, o.kind) for o in det.objects) == sorted((s.color, s.kind) for s in scene.shapes)
            px = 1 / min(size, 128)  # a pixel of the detector's working image (larger images are reduced to 128)
            for o in det.objects:  # box centre = shape centre within 2 px per axis (rounding of the drawn box;
                # the 3x3 opening trims a triangle's tip)
                assert min(max(abs(o.x - s.x), abs(o.y - s.y)) for s in scene.shapes if s.color == o.color) <= 2 * px
            assert check_prompt(parse_shapes_prompt(scene.caption), det)["correct"]


def test_detector_tolerates_soft_edges():
    """Generated images have blurred edges (blends of two palette colours); a Gaussian blur of radius 1 px
    keeps >= 90% of 1-3 shape scenes fully correct (measured 96/100 with seed 1)."""
    rng = random.Random(1)
    ok = 0
    for _ in range(50):
        scene = sample_scene(rng, n_shapes=(1, 3), size=64)
        det = detect_shapes(scene.image.filter(ImageFilter.GaussianBlur(1.0)))
        ok += check_prompt(parse_shapes_prompt(scene.caption), det)["correct"]
    assert ok >= 45


def test_geneval_prompt_file_reference_scenes_and_shuffled_pairs():
    prompts = [it.prompt for it in load_prompts(GENEVAL)]
    specs = [parse_shapes_prompt(p) for p in prompts]
    rng = random.Random(0)
    images = [scene_for_prompt(s, rng, 64).image for s in specs]
    res = accuracy(check_images(images, prompts))
    n_pos = sum(s.relation is not None for s in specs)
    assert n_pos == 8 and res["checked"] == len(prompts) == 26 and res["skipped"] == 0
    assert res["accuracy"] == {"object": 1.0, "color": 1.0, "count": 1.0, "position": 1.0, "background": 1.0,
                               "exact": 1.0, "overall": 1.0}
    assert res["asked"]["position"] == n_pos and res["asked"]["background"] == 26
    # each image against the next prompt: no scene satisfies another prompt of the file
    shifted = accuracy(check_images(images[1:] + images[:1], prompts))
    assert shifted["accuracy"]["overall"] == shifted["accuracy"]["exact"] == 0.0
    # prompts outside the shapes world are skipped, not failed
    mixed = check_images(images[:2], [prompts[0], "a photo of a cat"])
    assert mixed[1] is None and accuracy(mixed)["skipped"] == 1


def test_accuracy_hand_values():
    results = [{"checks": {"object": True, "color": True, "count": False, "position": None, "background": True,
                           "correct": False, "exact": False}},
               {"checks": {"object": True, "color": False, "count": False, "position": True, "background": None,
                           "correct": False, "exact": False}},
               {"checks": {"object": True, "color": True, "count": True, "position": True, "background": True,
                           "correct": True, "exact": True}},
               None]
    res = accuracy(results)
    assert res["accuracy"] == {"object": 1.0, "color": 2 / 3, "count": 1 / 3, "position": 1.0, "background": 1.0,
                               "exact": 1 / 3, "overall": 1 / 3}
    assert res["asked"] == {"object": 3, "color": 3, "count": 3, "position": 2, "background": 2, "exact": 3,
                            "overall": 3}
    assert (res["checked"], res["skipped"]) == (3, 1)


# ---------------------------------------------------------------------------------------- mmrl eval end to end

EVAL_ARGS = ["--max-prompts", "3", "--samples-per-prompt", "2"]
EVAL_OVERRIDES = ["rollout.eval_num_steps=4"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 1-step Flow-GRPO run of the shapes-pretrained tiny SD3 (EMA "old" state with decay 0.5, so it differs
    from "default"), rewarded by two components; returns (config path, run dir)."""
    from mmrl.config import load_config
    from mmrl.diffusion.flow_grpo import train

    if not (MODEL / "model_index.json").is_file():
        pytest.skip("assets/tiny_sd3_shapes not built")
    root = tmp_path_factory.mktemp("eval")
    d = yaml.safe_load((REPO / "configs" / "diffusion" / "flow_grpo_tiny.yaml").read_text())
    d["output_dir"] = str(root / "run")
    d["model"].update(path=str(MODEL), lora={"rank": 4, "alpha": 8})
    d["data"].update(train_prompts=str(REPO / "assets" / "prompts" / "shapes_train.txt"),
                     eval_prompts=str(EVAL_PROMPTS))
    d["rollout"].update(group_size=2, num_steps=3, prompts_per_step=2)
    d["train"].update(max_steps=1, save_every=1)
    d["algo"].update(ema=True, ema_decay=0.5)
    d["log"].update(eval_every=0, sample_every=0)
    d["reward"]["components"] = {"jpeg_incompressibility": 1.0, "prompt_color": {"weight": 0.5, "target": "background"}}
    cfg_path = root / "flow_grpo_eval.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    train(load_config(cfg_path))
    return cfg_path, root / "run"


def _png(path):
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def _independent_images(cfg_path, n_prompts, samples, checkpoint=None, state="default"):
    """The eval images computed without mmrl.eval: the recipe's own policy states loaded from the checkpoint,
    sample_groups with noise_level 0 and prompt i's generator seeded seed * 1000003 + i, rounded to 8 bits."""
    from mmrl.config import load_config
    from mmrl.diffusion.common import build_policy_states
    from mmrl.diffusion.models import load_flow_model
    from mmrl.diffusion.sampling import sample_groups

    cfg = load_config(cfg_path, EVAL_OVERRIDES)
    model = load_flow_model(cfg.model.path)
    use = nullcontext()
    if checkpoint is not None:
        states = build_policy_states(model, cfg.model, old=True, ref=False)
        states.load(Path(checkpoint) / "adapters")
        use = states.use(state)
    out = []
    with use, torch.no_grad():
        for i, item in enumerate(load_prompts(cfg.data.eval_prompts)[:n_prompts]):
            gen = torch.Generator().manual_seed(cfg.seed * 1000003 + i)
            traj = sample_groups(model, model.encode_prompts([item.prompt]), samples, num_steps=4,
                                 height=cfg.rollout.height, width=cfg.rollout.width,
                                 guidance_scale=cfg.rollout.eval_guidance_scale, noise_level=0.0, generator=gen)
            out.append((traj.images.clamp(0, 1) * 255).round().to(torch.uint8))
    return torch.cat(out)


def _check_report_against_files(out, cfg_path):
    """Every number of eval_report.json recomputed from the saved PNGs and the config alone."""
    from mmrl import rewards
    from mmrl.config import load_config

    report = json.loads((out / "eval_report.json").read_text())
    cfg = load_config(cfg_path)
    assert (out / "eval_grid.png").is_file()
    files = [f for row in report["per_prompt"] for f in row["images"]]
    prompts = [row["prompt"] for row in report["per_prompt"] for _ in row["images"]]
    x = torch.stack([_png(out / f) for f in files]).float() / 255
    fn = rewards.load(dict(cfg.reward.components))
    res = fn(images=x, prompts=prompts)
    got_total = [v for row in report["per_prompt"] for v in row["reward"]]
    assert got_total == pytest.approx(res.scores.tolist(), abs=1e-6)
    for name in ("jpeg_incompressibility", "prompt_color"):
        got = [v for row in report["per_prompt"] for v in row["components"][name]]
        assert got == pytest.approx(res.details[name].tolist(), abs=1e-6)
        assert report["components"][name]["mean"] == pytest.approx(statistics.mean(got), abs=1e-9)
        assert report["components"][name]["std"] == pytest.approx(statistics.stdev(got), abs=1e-9)
    assert report["reward"]["mean"] == pytest.approx(statistics.mean(got_total), abs=1e-9)
    assert report["reward"]["std"] == pytest.approx(statistics.stdev(got_total), abs=1e-9)
    # compositional checks: the detector on the saved files, and the accuracies from the per-image checks
    checks = [c for row in report["per_prompt"] for c in row["checks"]]
    for img, prompt, c in zip(x, prompts, checks):
        assert c == check_prompt(parse_shapes_prompt(prompt), detect_shapes(img))
    for name in ("object", "color", "count", "background", "exact"):
        assert report["compositional"]["accuracy"][name] == pytest.approx(sum(c[name] for c in checks) / len(checks))
    overall = sum(c["correct"] for c in checks) / len(checks)
    assert report["compositional"]["accuracy"]["overall"] == pytest.approx(overall)
    assert report["compositional"]["accuracy"]["position"] is None  # no position prompt in shapes_eval.txt
    return report, torch.stack([_png(out / f) for f in files])


def test_eval_checkpoint_matches_independent_recomputation(trained_run, tmp_path, capsys):
    cfg_path, run = trained_run
    out = tmp_path / "ckpt"
    # the run directory stands for its newest checkpoint; overrides may follow the options
    assert main(["eval", str(cfg_path), "--checkpoint", str(run), "--out", str(out), *EVAL_ARGS, *EVAL_OVERRIDES]) == 0
    printed = json.loads(capsys.readouterr().out)
    report, images = _check_report_against_files(out, cfg_path)
    assert printed["reward"] == report["reward"] and printed["out_dir"] == str(out)
    step_dir = run / "checkpoints" / "step_1"
    pol = report["policy"]
    assert (pol["step"], pol["mode"], pol["state"]) == (1, "lora", "default")
    assert pol["checkpoint"] == str(step_dir / "adapters")
    weights = step_dir / "adapters" / "default" / "adapter_model.safetensors"
    assert pol["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert report["overrides"] == EVAL_OVERRIDES and report["sampling"]["num_steps"] == 4
    assert [r["seed"] for r in report["per_prompt"]] == [0, 1, 2] and report["num_prompts"] == 3
    assert images.shape == (6, 3, 64, 64)
    assert torch.equal(images, _independent_images(cfg_path, 3, 2, step_dir, "default"))

    # --state old (the EMA) is another policy: other weights, other images, again those of the recipe's states
    out_old = tmp_path / "old"
    assert main(["eval", str(cfg_path), "--checkpoint", str(step_dir), "--state", "old", "--out", str(out_old),
                 *EVAL_ARGS, *EVAL_OVERRIDES]) == 0
    report_old, images_old = _check_report_against_files(out_old, cfg_path)
    assert report_old["policy"]["state"] == "old" and report_old["policy"]["sha256"] != pol["sha256"]
    assert torch.equal(images_old, _independent_images(cfg_path, 3, 2, step_dir, "old"))
    assert not torch.equal(images_old, images)


def test_eval_of_a_run_directory_alone_uses_the_config_it_was_trained_with(trained_run, tmp_path):
    """`mmrl eval RUN`: the newest checkpoint, evaluated with the config.yaml its step directory holds."""
    cfg_path, run = trained_run
    out = tmp_path / "alone"
    assert main(["eval", str(run), "--out", str(out), *EVAL_ARGS, *EVAL_OVERRIDES]) == 0
    report, images = _check_report_against_files(out, cfg_path)
    step_dir = run / "checkpoints" / "step_1"
    assert report["config_file"] == str(step_dir / "config.yaml") and report["policy"]["step"] == 1
    assert torch.equal(images, _independent_images(cfg_path, 3, 2, step_dir, "default"))


def test_eval_base_model_and_prompt_independent_seeds(trained_run, tmp_path):
    cfg_path, run = trained_run
    out = tmp_path / "base"
    assert main(["eval", str(cfg_path), "--out", str(out), *EVAL_ARGS, *EVAL_OVERRIDES]) == 0
    report, images = _check_report_against_files(out, cfg_path)
    assert report["policy"] == {"checkpoint": None, "step": None, "mode": "base", "state": None}
    assert torch.equal(images, _independent_images(cfg_path, 3, 2))
    # the checkpoint's adapters change the images (same prompts, same noise)
    ckpt = _independent_images(cfg_path, 3, 2, run / "checkpoints" / "step_1")
    assert (images.float() - ckpt.float()).abs().max() > 0
    # no checkpoint but model.lora.init_path: the policy a run starts from (here the checkpoint's own adapter)
    init = run / "checkpoints" / "step_1" / "adapters" / "default"
    out_init = tmp_path / "init"
    assert main(["eval", str(cfg_path), "--out", str(out_init), *EVAL_ARGS, *EVAL_OVERRIDES,
                 f"model.lora.init_path={init}"]) == 0
    report_init, images_init = _check_report_against_files(out_init, cfg_path)
    assert report_init["policy"]["state"] == "init_lora_path" and torch.equal(images_init, ckpt)
    # prompt i's noise has its own seed: evaluating only the first prompt reproduces its images
    out1 = tmp_path / "first"
    assert main(["eval", str(cfg_path), "--out", str(out1), "--max-prompts", "1", "--samples-per-prompt", "2",
                 *EVAL_OVERRIDES]) == 0
    assert torch.equal(torch.stack([_png(out1 / "images" / f"p0000_s{j}.png") for j in range(2)]), images[:2])


def test_apply_checkpoint_full_finetuning_weights(tmp_path):
    """A full fine-tuning checkpoint (PolicyStates without LoRA: adapters/<state>/model.safetensors) is copied into
    the transformer; a file that does not fit the model is refused naming the keys."""
    from safetensors.torch import load_file, save_file

    from mmrl.adapters import PolicyStates
    from mmrl.diffusion.models import load_flow_model
    from mmrl.eval import apply_checkpoint

    trained = load_flow_model(MODEL)
    trained.transformer.requires_grad_(True)  # as build_policy_states does for model.lora: false
    states = PolicyStates(trained.transformer, None)
    with torch.no_grad():
        for i, p in enumerate(states.trainable_parameters()):
            p.add_(0.01 * (i + 1))
    states.save(tmp_path / "adapters")
    model = load_flow_model(MODEL)
    before = {k: v.clone() for k, v in model.transformer.named_parameters()}
    info = apply_checkpoint(model, tmp_path / "adapters", "default")
    assert info["mode"] == "full" and info["state"] == "default"
    for k, v in model.transformer.named_parameters():
        assert torch.equal(v, dict(trained.transformer.named_parameters())[k])
        assert not torch.equal(v, before[k])
    weights = tmp_path / "adapters" / "default" / "model.safetensors"
    sd = load_file(str(weights))
    save_file({**sd, "bogus.weight": torch.zeros(2)}, str(weights))
    with pytest.raises(ValueError, match=r"1 of its \d+ tensors are not model parameters \(e.g. \['bogus.weight'\]\)"):
        apply_checkpoint(load_flow_model(MODEL), tmp_path / "adapters", "default")
    first = sorted(sd)[0]
    save_file({**sd, first: torch.zeros(3, 1)}, str(weights))
    with pytest.raises(ValueError, match=f"{first} has shape \\(3, 1\\)"):
        apply_checkpoint(load_flow_model(MODEL), tmp_path / "adapters", "default")


def _one_line_error(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    return err


def test_eval_errors_are_one_line(tmp_path, capsys):
    cfg = str(REPO / "configs" / "diffusion" / "flow_grpo_tiny.yaml")
    _one_line_error(capsys, ["eval", cfg, "--checkpoint", str(tmp_path / "nowhere")], "nowhere: not found")
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, ["eval", cfg, "--checkpoint", str(tmp_path / "empty")], "no adapters/ in it")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    _one_line_error(capsys, ["eval", cfg, "--checkpoint", str(tmp_path / "run")], "no complete checkpoint")
    (tmp_path / "run" / "checkpoints" / "step_3" / "adapters").mkdir(parents=True)  # no COMPLETE marker
    _one_line_error(capsys, ["eval", cfg, "--checkpoint", str(tmp_path / "run" / "checkpoints" / "step_3")],
                    "incomplete")
    _one_line_error(capsys, ["eval", str(REPO / "configs" / "joint" / "rewriter_tiny.yaml")],
                    "mmrl eval supports diffusion configs (awm, dgpo, dpo, flow_grpo, nft")
    _one_line_error(capsys, ["eval", cfg, "data.eval_prompts="], "no evaluation prompts")
    _one_line_error(capsys, ["eval", cfg, "--prompts", str(tmp_path / "p.txt")], "prompt file not found")
    _one_line_error(capsys, ["eval", cfg, "--state", "old"], "--state old needs --checkpoint")
    _one_line_error(capsys, ["eval", cfg, "--samples-per-prompt", "0"], "samples_per_prompt")


def test_eval_missing_state_is_one_line(trained_run, tmp_path, capsys):
    _, run = trained_run
    adapters = tmp_path / "adapters"
    shutil.copytree(run / "checkpoints" / "step_1" / "adapters" / "default", adapters / "default")
    cfg = str(REPO / "configs" / "diffusion" / "flow_grpo_tiny.yaml")
    _one_line_error(capsys, ["eval", cfg, f"model.path={MODEL}", "--checkpoint", str(adapters), "--state", "old",
                             "--max-prompts", "1"], "no policy state 'old' (saved: ['default']")


def test_eval_of_a_run_on_a_read_only_mount_is_one_line(trained_run, tmp_path, capsys):
    """A run on a real read-only mount (root only), with the eval folder of an earlier eval in it (its mkdir passes):
    one line naming the folder before the model loads (issue 27: a traceback from writing the first image)."""
    import subprocess

    cfg_path, run = trained_run
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        shutil.copytree(run, mnt / "run")
        (mnt / "run" / "eval" / "step_1" / "images").mkdir(parents=True)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        _one_line_error(capsys, ["eval", str(cfg_path), "--checkpoint", str(mnt / "run"), *EVAL_ARGS, *EVAL_OVERRIDES],
                        f"mmrl: error: mmrl eval: cannot write into {mnt / 'run' / 'eval' / 'step_1'} (Read-only file "
                        f"system); pass --out DIR, a directory on a writable disk")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
