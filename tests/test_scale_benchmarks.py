"""The scaling benchmarks (benchmarks/sharded_checkpoint.py, real_width.py, gpu_check.py): their pure parts by hand,
and each command of docs/scaling.md / docs/performance.md in its short form (`--small`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mmrl.diffusion.models  # noqa: F401  (the families register their real-width architectures)
from mmrl.perf.architectures import get_architecture
from mmrl.testing import child_env

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _script(name: str):
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"STDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"
    return proc


def test_real_width_extrapolation_by_hand():
    """Two depth points of SD3.5-Medium: what one row's step adds is 0.5 GiB per block and 0 fixed; gradients 0.05
    GiB per block; at 24 blocks and the recipe's 18 rows (micro-batch 9, CFG) the table adds up as written here."""
    rw = _script("real_width")
    arch = get_architecture("sd35_medium")
    rows = []
    for mode in ("lora", "full"):
        for gc in (False, True):
            for layers, peak, grads in ((2, 1.0, 0.1), (3, 1.5, 0.15)):
                rows.append({"arch": arch.name, "depth": {"num_layers": layers}, "mode": mode, "gc": gc,
                             "step_peak_gib": peak, "trainable_bytes": grads, "weights_gib": 0.0,
                             "opt_temp_gib": 0.0, "tflops": 0.25 * layers})
    table = rw.extrapolate(arch, rows, small=False)
    weights = 2 * arch.parameters() / 2**30
    assert arch.parameters() == 2_243_171_520 + 384 * 384 * 1536  # parameters + the position table
    by = {(t["mode"], t["gc"], t["old_ref"]): t for t in table}
    assert len(table) == 8
    lora = by[("lora", False, "adapters")]
    assert lora["act_per_row_gib"] == pytest.approx(0.5 * 24) and lora["grads_gib"] == pytest.approx(0.05 * 24)
    # LoRA: the base weights + the trained adapter (1.2), two adapters for old/ref, gradients, two AdamW moments
    assert lora["weights_gib"] == pytest.approx(weights + 1.2) and lora["adapter_gib"] == pytest.approx(1.2)
    assert lora["total_gib"] == pytest.approx(weights + 1.2 + 2 * 1.2 + 1.2 + 2 * 1.2 + 18 * 12.0)
    # deep copies: the ref model (base) and the old one (base + its adapter)
    assert by[("lora", False, "copies")]["total_gib"] == pytest.approx(
        weights + 1.2 + (2 * weights + 1.2) + 1.2 + 2.4 + 216)
    assert by[("full", False, "none")]["weights_gib"] == pytest.approx(weights)  # the trained weights are the model's
    assert by[("full", True, "none")]["states_gib"] == 0.0
    assert by[("full", True, "copies")]["states_gib"] == pytest.approx(2.4)
    assert lora["tflops_per_row_step"] == pytest.approx(0.25 * 24) and not lora["fits_80gb"]


def test_real_width_extrapolation_of_two_experts_by_hand():
    """Wan2.2-T2V-A14B holds two experts of one config: the weights, LoRA adapters and old/ref states of both; the
    gradients, AdamW state and optimizer temporaries of the one its recipe trains (its SDE window reaches only the
    high-noise expert); the activations of the one a row goes through (2 rows: micro-batch 1 doubled by CFG)."""
    from dataclasses import replace

    rw = _script("real_width")
    arch = get_architecture("wan22_t2v_a14b")
    one = replace(arch, experts=1)
    assert arch.parameters() == 2 * one.parameters() and round(one.parameters() / 1e9, 2) == 14.29
    rows = [{"arch": arch.name, "depth": {"num_layers": n}, "mode": mode, "gc": gc, "step_peak_gib": 0.1 * n,
             "trainable_bytes": 0.01 * n, "weights_gib": 0.0, "opt_temp_gib": 0.002 * n, "tflops": 0.5 * n}
            for mode in ("lora", "full") for gc in (False, True) for n in (2, 3)]
    two = {(t["mode"], t["gc"], t["old_ref"]): t for t in rw.extrapolate(arch, rows, small=False)}
    single = {(t["mode"], t["gc"], t["old_ref"]): t for t in rw.extrapolate(one, rows, small=False)}
    assert arch.step["trained_experts"] == 1
    t2, t1 = two[("lora", False, "adapters")], single[("lora", False, "adapters")]
    base = 2 * arch.parameters() / 2**30
    assert t2["grads_gib"] == t1["grads_gib"] == pytest.approx(0.4) and t2["adapter_gib"] == pytest.approx(0.8)
    assert t2["weights_gib"] == pytest.approx(base + 0.8) and t2["opt_temp_gib"] == pytest.approx(0.08)
    assert t2["act_per_row_gib"] == t1["act_per_row_gib"] == pytest.approx(4.0) and t2["rows"] == 2
    assert t2["tflops_per_row_step"] == pytest.approx(20.0)
    assert t2["total_gib"] == pytest.approx(base + 0.8 + 2 * 0.8 + 0.4 + 0.8 + 0.08 + 2 * 4.0)
    assert two[("lora", True, "copies")]["states_gib"] == pytest.approx(2 * base + 0.8)
    both = {(t["mode"], t["gc"], t["old_ref"]): t for t in rw.extrapolate(
        replace(arch, step={**arch.step, "trained_experts": 2}), rows, small=False)}  # a window reaching both
    assert both[("full", True, "none")]["adam_gib"] == pytest.approx(2 * two[("full", True, "none")]["adam_gib"])


def test_real_width_wan_rows_follow_each_vae():
    """The Wan row builder (mmrl/diffusion/models/wan.py): Wan2.1 / A14B latents 8x smaller in space, one timestep per
    row; TI2V-5B's 48-channel VAE 16x smaller and a timestep per token (expand_timesteps), as its pipeline passes
    them."""
    import torch

    rw = _script("real_width")
    row = {"num_frames": 9, "height": 704, "width": 1280, "text_tokens": 8}
    arch = get_architecture("wan22_ti2v_5b", small=True)
    ti2v = arch.build({"num_layers": 1}, dtype=torch.float32)
    x = arch.inputs(ti2v, row, torch.float32)
    assert x["hidden_states"].shape == (1, 48, 3, 44, 80) and x["timestep"].shape == (1, 3 * 22 * 40)
    arch = get_architecture("wan22_t2v_a14b", small=True)
    a14b = arch.build({"num_layers": 1}, dtype=torch.float32)
    x = arch.inputs(a14b, dict(row, num_frames=5, height=480, width=480), torch.float32)
    assert x["hidden_states"].shape == (1, 16, 2, 60, 60) and x["timestep"].shape == (1,)
    # the patch embedding as the benchmark computes it (a reshape and a matmul: oneDNN's bf16 Conv3d weight gradient
    # is pathologically slow on CPU at Wan2.2-A14B's width) equals the Conv3d, with the same parameters
    conv = a14b.patch_embedding
    patch = rw.patch_as_matmul(conv)
    assert patch.weight is conv.weight and torch.allclose(patch(x["hidden_states"]), conv(x["hidden_states"]), rtol=1e-5, atol=1e-5)


def test_real_width_plan_is_read_from_each_architecture():
    """What benchmarks/real_width.py measures comes from the registered architectures (a family's file declares its
    own): the depth points, the measured row (the recipe's unless the architecture names a smaller one to scale up)
    and the modes, as written out here."""
    rw = _script("real_width")
    one, two = [{"num_layers": 2}, {"num_layers": 3}], [{"num_layers": 1, "num_single_layers": 1},
                                                        {"num_layers": 2, "num_single_layers": 1},
                                                        {"num_layers": 1, "num_single_layers": 2}]
    image = {"height": 512, "width": 512}

    def vlm(vision: str) -> list[dict]:
        t, v = "text_config.num_hidden_layers", f"vision_config.{vision}"
        return [{t: 1, v: 1}, {t: 2, v: 1}, {t: 1, v: 2}]

    plan = {"sd35_medium": (one, dict(image, text_tokens=205)),
            "flux1_dev": (two, dict(height=256, width=256, text_tokens=128)),
            "flux2_dev": (two, dict(image, text_tokens=512)),
            "flux2_klein_9b": (two, dict(height=384, width=384, text_tokens=512)),
            "wan21_t2v_1_3b": (one, dict(num_frames=5, height=256, width=256, text_tokens=512)),
            "wan22_t2v_a14b": (one, dict(num_frames=5, height=480, width=480, text_tokens=512)),
            "wan22_ti2v_5b": (one, dict(num_frames=9, height=704, width=1280, text_tokens=1024)),
            "qwen_image_20b": (one, dict(image, text_tokens=256)),
            "hunyuan_video15_480p_t2v": (one, dict(num_frames=5, height=256, width=256, text_tokens=1000)),
            "ltx2_19b": (one, dict(num_frames=9, height=512, width=768, text_tokens=1024)),
            "z_image_6b": ([{"n_layers": 2}, {"n_layers": 3}], dict(image, text_tokens=512)),
            "qwen25_vl_3b": (vlm("depth"), dict(image_patches=(38, 38), prompt_tokens=120, response_tokens=256)),
            "glm41v_9b_thinking": (vlm("depth"), dict(image_patches=(38, 38), prompt_tokens=120, response_tokens=256)),
            "internvl35_1b": (vlm("num_hidden_layers"), dict(tiles=1, prompt_tokens=120, response_tokens=256)),
            "internvl35_8b": (vlm("num_hidden_layers"), dict(tiles=1, prompt_tokens=120, response_tokens=256))}
    from mmrl.perf.architectures import ARCHITECTURES

    assert sorted(ARCHITECTURES) == sorted(plan)
    for name, (depths, row) in plan.items():
        arch = get_architecture(name)
        assert rw.depth_points(arch) == depths and rw.measured_row(arch, small=False) == row, name
        assert arch.inputs is not None and arch.small_widths and rw.measured_row(arch, small=True), name
        lora_only = name in ("flux2_dev", "ltx2_19b", "glm41v_9b_thinking", "internvl35_8b")  # full: more than this machine holds
        assert arch.measure_modes == (("lora",) if lora_only else ("lora", "full")), name
    assert get_architecture("flux1_dev").row_scale == {"*": 1536 / 384}
    assert get_architecture("hunyuan_video15_480p_t2v").row_scale == {"*": 10085 / 2497}  # 33 frames at 480 px
    assert get_architecture("ltx2_19b").row_scale == {"*": 7294 / 1801}  # 121 frames at 512 x 768, 9 frames measured
    assert get_architecture("sd35_medium").measure_config == {"pos_embed_max_size": 64}
    # the VLMs: what one measured row adds scales to the recipe's response length (2048; InternVL 32768 tokens)
    assert get_architecture("glm41v_9b_thinking").row_scale == {"text_config.num_hidden_layers": 2531 / 739,
                                                                 "fixed": 2048 / 256}
    assert get_architecture("internvl35_1b").row_scale == {"text_config.num_hidden_layers": 33146 / 634,
                                                            "fixed": 32768 / 256}


def test_real_width_cache_resumes_where_a_run_stopped(tmp_path):
    """`--cache`: a measurement found in the JSONL file is not repeated; the missing one runs (in its own process, as
    the benchmark does) and is appended; rows come back in the order of the specs."""
    rw = _script("real_width")
    specs = [{"arch": "sd35_medium", "depth": {"num_layers": n}, "mode": "lora", "gc": False, "small": True,
              "shape": get_architecture("sd35_medium").small_row, "threads": 1} for n in (2, 3)]
    cache = tmp_path / "rw.jsonl"
    earlier = {"arch": "sd35_medium", "step_peak_gib": 123.0}  # a marker no real measurement gives
    cache.write_text(json.dumps({"key": rw._key(specs[1]), "row": earlier}) + "\n")
    rows = rw._child(specs, cache)
    assert rows[1] == earlier and rows[0]["depth"] == {"num_layers": 2} and rows[0]["step_peak_gib"] < 1
    lines = [json.loads(x) for x in cache.read_text().splitlines()]
    assert [x["key"] for x in lines] == [rw._key(specs[1]), rw._key(specs[0])]
    assert rw._child(specs, cache) == rows  # everything cached: nothing runs


def test_gpu_check_summary_of_a_run(tmp_path):
    gc = _script("gpu_check")
    (tmp_path / "config.yaml").write_text("algorithm: flow_grpo\nrollout: {prompts_per_step: 2, group_size: 4}\n")
    rows = [{"step": 1, "time/step_s": 9.0, "perf/tflops_per_step": 3.0, "perf/peak_memory_gib": 20.0,
             "diag/logprob_drift": 0.0},
            {"step": 2, "time/step_s": 2.0, "perf/tflops_per_step": 3.0, "perf/mfu": 0.3, "perf/peak_memory_gib": 21.0,
             "diag/logprob_drift": 1e-7},
            {"step": 3, "time/step_s": 4.0, "perf/tflops_per_step": 3.0, "perf/mfu": 0.1, "perf/peak_memory_gib": 20.5,
             "diag/logprob_drift": 0.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = gc.summarise_run("flow_grpo", tmp_path, "sd35_medium", 2_000_000_000)
    # the first step is not timed: median of 2 s and 4 s; 8 images per step
    assert res == {"model": "sd35_medium", "params_b": 2.0, "steps": 3, "step_s": 3.0, "images_per_s": 8 / 3.0,
                   "tflops_per_step": 3.0, "mfu": 0.2, "peak_memory_gib": 21.0, "max_logprob_drift": 1e-7}


@pytest.mark.slow
def test_sharded_checkpoint_benchmark_small():
    out = _run("benchmarks/sharded_checkpoint.py", "--small", "--repeats", "1").stdout
    assert "| sharded | 1 |" in out and "| full | 0 |" in out and "checkpoint size on disk" in out


@pytest.mark.slow
def test_real_width_benchmark_small(tmp_path):
    archs = "sd35_medium,qwen25_vl_3b,qwen_image_20b,z_image_6b,flux2_klein_9b,wan22_t2v_a14b,flux2_dev,wan22_ti2v_5b"
    out = _run("benchmarks/real_width.py", "--small", "--arch", archs, "--threads", "1",
               "--out", str(tmp_path / "rw.json")).stdout
    data = json.loads((tmp_path / "rw.json").read_text())
    # FLUX.2 [dev]: LoRA only (its full fine-tuning depth points do not fit a 24 GB machine), 4 table rows
    assert len(data["measured"]) == 4 * (2 + 3 + 2 + 2 + 3 + 2 + 2) + 2 * 3 and len(data["table"]) == 7 * 8 + 4
    assert {t["mode"] for t in data["table"] if t["arch"] == "flux2_dev"} == {"lora"}
    assert "flux2_dev: full fine-tuning not measured" in out
    assert all(m["tflops"] > 0 and m["step_peak_gib"] >= 0 for m in data["measured"])
    assert "Extrapolated peak per GPU" in out and "| qwen25_vl_3b | full | on | copies |" in out
    for name in ("qwen_image_20b", "z_image_6b", "flux2_klein_9b", "flux2_dev", "wan22_t2v_a14b", "wan22_ti2v_5b"):
        # their FLOPs come from the estimators (mmrl.perf.flops)
        assert all(m["tflops"] > 0 for m in data["measured"] if m["arch"] == name), name


def test_new_family_architectures_have_their_published_sizes():
    # Qwen-Image: 20B (60 blocks of width 3072); Z-Image: 6B (dim 3840, 30 blocks + 4 refiner blocks); FLUX.2
    # [klein] 9B (8 + 24 blocks of width 4096); Wan2.2-T2V-A14B: two experts of 14.29B (Wan2.1-14B's config)
    assert round(get_architecture("qwen_image_20b").parameters() / 1e9, 2) == 20.43
    assert round(get_architecture("z_image_6b").parameters() / 1e9, 2) == 6.15
    assert round(get_architecture("flux2_klein_9b").parameters() / 1e9, 2) == 9.08
    assert round(get_architecture("wan22_t2v_a14b").parameters() / 1e9, 2) == 28.58
    assert round(get_architecture("flux2_dev").parameters() / 1e9, 2) == 32.22
    assert round(get_architecture("wan22_ti2v_5b").parameters() / 1e9, 2) == 5.0  # dim 3072, 30 layers, 48 channels
    # HunyuanVideo 1.5: 8.3B (54 double-stream blocks of width 2048, 2 refiner blocks)
    assert round(get_architecture("hunyuan_video15_480p_t2v").parameters() / 1e9, 2) == 8.33


def test_vlm_family_architectures_have_their_published_sizes():
    """GLM-4.1V-9B-Thinking: 10.3B on its model card; the count equals the safetensors total published for
    zai-org/GLM-4.6V-Flash (10,292,777,472), a checkpoint of the same glm4v shape (within 0.5% of 10.3B).
    InternVL3.5-1B-HF: exactly the 1,060,897,792 parameters counted in its safetensors (vision tower 304,012,288,
    projector 5,253,120, the rest the Qwen3 decoder and its untied output layer); InternVL3.5-8B: 8.5B on its card."""
    glm = get_architecture("glm41v_9b_thinking").parameters()
    assert glm == 10_292_777_472 and abs(glm / 10.3e9 - 1) < 0.005
    arch = get_architecture("internvl35_1b")
    assert arch.parameters() == 1_060_897_792
    model = arch.build(device="meta")
    parts = {k: sum(p.numel() for n, p in model.named_parameters() if k in n)
             for k in ("vision_tower", "multi_modal_projector")}
    assert parts == {"vision_tower": 304_012_288, "multi_modal_projector": 5_253_120}
    assert round(get_architecture("internvl35_8b").parameters() / 1e9, 1) == 8.5


@pytest.mark.parametrize("name", ["glm41v_9b_thinking", "internvl35_1b"])
def test_real_width_vlm_rows_and_what_their_recipes_train(name):
    """One `--small` measurement of GLM-4.1V and InternVL3.5 (benchmarks/real_width.py's step, in this process):
    each family's row (GLM: 3-D rope grid, 8 x 8 patches of 3 x 2 x 14 x 14 values -> 16 <|image|> between
    <|begin_of_image|> / <|end_of_image|>; InternVL: one 448 x 448 tile -> 256 <IMG_CONTEXT>) and what its recipe
    trains: GLM (train_vision) LoRA on the decoder's projections, its fused gate_up_proj included, and on the vision
    blocks; InternVL full fine-tuning with the vision tower frozen."""
    import re

    import torch
    from torch import nn

    from mmrl.vlm.families import lora_target_pattern

    rw = _script("real_width")
    arch = get_architecture(name, small=True)
    depth = {k: 1 for k in arch.depth}
    model = arch.build(depth, dtype=torch.float32)
    x = arch.inputs(model, arch.small_row, torch.float32)
    ids = x["input_ids"][0].tolist()
    if name == "glm41v_9b_thinking":
        assert x["pixel_values"].shape == (64, 1176) and x["image_grid_thw"].tolist() == [[1, 8, 8]]
        assert ids[:18] == [151339] + [151343] * 16 + [151340] and len(ids) == 18 + 8 + 8
        assert x["mm_token_type_ids"][0].tolist() == [0] + [1] * 16 + [0] * 17
        pattern = lora_target_pattern(model.config, list(arch.lora_targets), True)
        adapted = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and re.fullmatch(pattern, n)}
        assert {"model.language_model.layers.0.mlp.gate_up_proj", "model.visual.blocks.0.attn.qkv",
                "model.visual.blocks.0.mlp.down_proj"} <= set(adapted)
        r = arch.step["lora_rank"]
        expected = sum(r * (m.in_features + m.out_features) for m in adapted.values())
        mode = "lora"
    else:
        assert x["pixel_values"].shape == (1, 3, 448, 448) and ids.count(151671) == 256 and len(ids) == 256 + 2 + 16
        expected = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.vision_tower."))
        mode = "full"
    row = rw.measure({"arch": name, "depth": depth, "mode": mode, "gc": False, "shape": arch.small_row,
                      "small": True, "threads": 1})
    assert row["trainable"] == expected and row["step_peak_gib"] > 0 and row["tflops"] > 0


def test_janus_pro_architecture_size_row_and_what_its_recipe_trains():
    """Janus-Pro-7B: 7.42B on its model card (the count within 0.5%); one `--small` measurement of its row (the
    prompt and its unconditional copy + the image tokens, the recipe's guided log-probs) in each mode: full
    fine-tuning trains the decoder and the generation head only (the recipe's), LoRA adapts exactly the layers of
    the recipe's pattern (decoder projections, generation head)."""
    import re

    import torch
    from torch import nn

    import mmrl.ar_image.architecture  # noqa: F401  (registers janus_pro_7b)
    from mmrl.ar_image.grpo import JANUS_LORA_TARGETS

    assert abs(get_architecture("janus_pro_7b").parameters() / 7.42e9 - 1) < 0.005
    rw = _script("real_width")
    arch = get_architecture("janus_pro_7b", small=True)
    depth = {k: 1 for k in arch.depth}
    model = arch.build(depth, dtype=torch.float32)
    x = arch.inputs(model, arch.small_row, torch.float32)
    assert x["ids"].shape == (1, 8) and x["tokens"].shape == (1, 16)
    full = sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(("model.language_model.", "model.generation_head.")))
    adapted = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and re.fullmatch(JANUS_LORA_TARGETS, n)]
    r = arch.step["lora_rank"]
    lora = sum(r * (m.in_features + m.out_features) for m in adapted)
    assert len(adapted) == 7 + 2  # one decoder layer's 7 projections, the head's proj_out and vision_head
    for mode, expected in (("full", full), ("lora", lora)):
        row = rw.measure({"arch": "janus_pro_7b", "depth": depth, "mode": mode, "gc": mode == "lora",
                          "shape": arch.small_row, "small": True, "threads": 1})
        assert row["trainable"] == expected and row["step_peak_gib"] > 0 and row["tflops"] > 0, (mode, row)


@pytest.mark.slow
def test_gpu_check_small_runs_every_recipe(tmp_path):
    """`benchmarks/gpu_check.py --small`: every recipe, 1 step each on CPU with the random models built at tiny
    widths through the real-size builder; one JSON report with throughput, FLOPs, memory and drift."""
    gc = _script("gpu_check")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--small", "--steps", "1", "--out",
                           str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=3600)
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert proc.returncode == 0 and report["failed"] == [], json.dumps(report, indent=1)
    assert sorted(report["recipes"]) == sorted(gc.RECIPES)
    for name, entry in report["recipes"].items():
        assert entry["steps"] == 1 and entry["tflops_per_step"] > 0 and entry["peak_memory_gib"] > 0, name
        assert ("tokens_per_s" if name.startswith("vlm") else "images_per_s") in entry, name
        if name not in ("dpo",):  # policy-gradient recipes: rollout and training log-probs agree
            assert entry.get("max_logprob_drift", 0.0) < 1e-4, (name, entry)


def test_gpu_check_overrides_are_valid_config_keys(tmp_path):
    """The CUDA-only overrides of every recipe (never run here) name keys and values its config accepts."""
    from mmrl.config import load_config

    gc = _script("gpu_check")
    for name, (config, _, gpu_overrides) in gc.RECIPES.items():
        cfg = load_config(ROOT / config, [f"output_dir={tmp_path / name}", "dtype=bfloat16", "num_threads=0",
                                          "train.max_steps=3", *gpu_overrides])
        assert cfg.dtype == "bfloat16", name
