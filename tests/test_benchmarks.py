"""Helpers of the benchmark scripts (benchmarks/ is not a package): `_timing` (call order, statistics and the
speed-up wording, with a fake clock: nothing is timed), the EOS bias of vlm_step.py, run_all's argument check, and
the stack folding of profile_flow_grpo_step.py on hand-written py-spy lines."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    """Import benchmarks/<name>.py the way running it does: its folder on sys.path (for `from _timing import`)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


timing = load_script("_timing")


class FakeClock:
    """A clock that only moves when a timed function advances it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_interleaved_rotates_order_warms_up_and_times_each_call():
    clock, calls = FakeClock(), []
    costs = {"a": iter([9.0, 1.0, 2.0, 3.0]), "b": iter([9.0, 10.0, 30.0, 20.0])}  # first value: warm-up

    def make(name):
        def f():
            calls.append(name)
            clock.now += next(costs[name])
        return f

    t = timing.interleaved({"a": make("a"), "b": make("b")}, repeats=3, warmup=1, clock=clock)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then A B / B A / A B
    assert t["a"].values == (1.0, 2.0, 3.0) and t["b"].values == (10.0, 30.0, 20.0)
    assert (t["b"].min, t["b"].median, t["b"].max) == (10.0, 20.0, 30.0)
    # a's slowest run is 3 s -> 6 items / 3 s = 2 items/s is the min rate
    assert t["a"].rate(6).values == (6.0, 3.0, 2.0) and t["a"].rate(6).min == 2.0
    assert t["b"].fmt(scale=1e3, digits=0) == "10000 / 20000 / 30000"
    assert t["a"].fmt_median(digits=1) == "2.0 (1.0-3.0)"


def test_speedup_is_ratio_of_medians_and_flags_overlapping_ranges():
    fast, slow = timing.spread_of([1.0, 1.1, 1.2]), timing.spread_of([2.0, 2.5, 3.0])
    assert timing.speedup(slow, fast) == f"{2.5 / 1.1:.2f}x"
    noisy = timing.spread_of([1.1, 1.3, 2.2])  # its range [1.1, 2.2] overlaps fast's [1.0, 1.2]
    assert timing.speedup(noisy, fast) == f"{1.3 / 1.1:.2f}x (within spread)"
    assert timing.overlaps(noisy, fast) and not timing.overlaps(slow, fast)


def test_markdown_table_rows_and_separator():
    assert timing.markdown_table(["a", "b c"], [("1", "2"), (3, 4.5)]) == "| a | b c |\n|---|---|\n| 1 | 2 |\n| 3 | 4.5 |"
    assert timing.markdown_table(["x"], []) == "| x |\n|---|"


def test_bad_arguments_raise_one_clear_error():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        timing.interleaved({"a": lambda: None}, repeats=0)
    with pytest.raises(ValueError, match="no functions"):
        timing.interleaved({})
    with pytest.raises(ValueError, match="no values"):
        timing.spread_of([])


def test_vlm_step_eos_bias_gives_the_asked_eos_probability():
    """V = 1009 equal logits but EOS + b: p = e^b / (e^b + 1008) with e^b = (1/24) / (23/24) * 1008 = 1008 / 23,
    so p = 1 / (1 + 23) = 1/24."""
    import torch

    b = load_script("vlm_step").eos_bias(1009, 24)
    logits = torch.zeros(1009, dtype=torch.float64)
    logits[993] = b
    assert torch.softmax(logits, 0)[993].item() == pytest.approx(1 / 24, rel=1e-12)


def test_run_all_rejects_an_unknown_benchmark_name():
    with pytest.raises(SystemExit, match=r"unknown benchmark\(s\) \['nope'\]; valid: \['flow_grpo_step'"):
        load_script("run_all").main(["--only", "flow_grpo_step,nope"])


def test_run_all_runs_every_benchmark_and_reports_a_failure_without_stopping(tmp_path, monkeypatch):
    run_all = load_script("run_all")
    (tmp_path / "bad.py").write_text("import sys\nprint('boom: no such model', file=sys.stderr)\nsys.exit(3)\n")
    (tmp_path / "ok.py").write_text("import sys\nprint('| a | b |', sys.argv[1:])\n")
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    monkeypatch.setattr(run_all, "BENCHMARKS", {"bad": [], "ok": ["--out", "x/{stamp}"], "ok:again": ["--v", "2"]})
    assert run_all.main(["--out", str(tmp_path / "report.md")]) == 1
    report = (tmp_path / "report.md").read_text()
    assert "`python benchmarks/bad.py` FAILED (exit 3)" in report and "boom: no such model" in report
    assert "| a | b | ['--out', 'x/2" in report  # ran after the failure, with this pass's stamp filled in
    assert "## ok:again\n\n`python benchmarks/ok.py --v 2`" in report and "| a | b | ['--v', '2']" in report
    assert report.rstrip().endswith("FAILED: bad")


def test_profile_fold_categories_by_hand():
    """profile_flow_grpo_step.fold: samples outside a step are dropped, the first matching category wins, and the
    framework samples are attributed to the innermost mmrl function."""
    prof = load_script("profile_flow_grpo_step")
    step = "train (mmrl/diffusion/flow_grpo.py:240);train_on_rollout (mmrl/diffusion/grpo_update.py:80)"
    rollout = "train (mmrl/diffusion/flow_grpo.py:236);sample_groups (mmrl/diffusion/sampling.py:199)"
    lines = [
        f"{step};_transition (mmrl/diffusion/grpo_update.py:120);forward (diffusers/models/transformers/"
        f"transformer_sd3.py:316) 50",
        f"{step};backward (torch/_tensor.py:625);_engine_run_backward (torch/autograd/graph.py:841) 20",
        f"{rollout};FlowModel.vae_decode (mmrl/diffusion/models/base.py:150);conv (torch/nn/conv.py:1) 7",
        "train (mmrl/diffusion/flow_grpo.py:236);PromptEmbedCache.__call__ (mmrl/diffusion/models/base.py:300);"
        "SD3Model.encode_prompts (mmrl/diffusion/models/sd3.py:19);forward (transformers/models/t5/modeling_t5.py:9) 3",
        "train (mmrl/diffusion/flow_grpo.py:236);SD3Model.encode_prompts (mmrl/diffusion/models/sd3.py:19);"
        "_encode_plus (transformers/tokenization_utils_tokenizers.py:1) 2",
        f"{rollout};sde_step_with_logprob (mmrl/diffusion/sde.py:122) 4",
        f"{step};UpdateGuard.step (mmrl/training/guards.py:152);_single_tensor_adam (torch/optim/adam.py:1) 1",
        "train (mmrl/diffusion/flow_grpo.py:290);plot_reward_curve (mmrl/run/plots.py:61) 99",  # after the steps
        " 535",  # a sample without Python frames
    ]
    cats, framework = prof.fold(lines)
    assert cats == {"transformer forward": 50, "transformer backward": 20, "VAE decode": 7, "text encoders": 3,
                    "framework": 7}
    assert framework == {"SD3Model.encode_prompts": 2, "sde_step_with_logprob": 4, "UpdateGuard.step": 1}
    text = prof.table(cats, framework, top=2)
    assert "| framework | 7 | 8.0% |" in text and "| **all step samples** | 87 | 100% |" in text
    assert "`sde_step_with_logprob` | 4 | 4.60%" in text and "UpdateGuard" not in text  # top 2 only


def test_families_benchmark_refuses_unknown_families_and_too_few_steps():
    families = load_script("families")
    assert {"wan21", "wan22_a14b", "z_image", "flux2", "flux2_klein", "qwen_image", "qwen_image_edit",
            "qwen_image_edit_plus", "flux_kontext"} <= set(families.FAMILIES)
    from mmrl.diffusion.models import tiny_cases

    assert list(families.FAMILIES) == list(tiny_cases())  # every tiny case of every registered family
    with pytest.raises(SystemExit, match=r"--families: unknown \['sdxl'\]; valid: \['flux2_klein', 'flux2', "):
        families.main(["--families", "wan21,sdxl"])
    with pytest.raises(SystemExit, match="--steps must be >= 2"):
        families.main(["--steps", "1"])
    assert "families" in load_script("run_all").BENCHMARKS


@pytest.mark.parametrize("family", ["glm4v", "internvl"])
def test_vlm_families_rollout_benchmark_compares_equal_tokens(tmp_path, family):
    """benchmarks/vlm_families_rollout.py's comparison: both sides timed, exactly --new-tokens tokens each, the
    same tokens."""
    import mmrl.tiny as tiny

    bench = load_script("vlm_families_rollout")
    path = getattr(tiny, f"build_tiny_{family}")(tmp_path / family, seed=0)
    times, equal, tokens = bench.compare(path, repeats=1, new_tokens=8)
    assert equal and tokens == 8 and set(times) == {"mmrl", "transformers"}
    assert "vlm_families_rollout" in load_script("run_all").BENCHMARKS


def test_janus_rollout_benchmark_compares_equal_tokens(tmp_path):
    """benchmarks/janus_rollout.py's comparison on the 16-token tiny Janus: both sides timed, the same tokens."""
    from mmrl.tiny import build_tiny_janus

    bench = load_script("janus_rollout")
    path = build_tiny_janus(tmp_path / "m", seed=0, image_size=16, patch_size=4, aligner_dim=32)
    times, equal, tokens = bench.compare(path, repeats=1)
    assert equal and tokens == 16 and set(times) == {"mmrl", "transformers"}
    assert "janus_rollout" in load_script("run_all").BENCHMARKS


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["process", "ranks"])
def test_async_rollout_quick_mode_runs_every_variant(tmp_path, mode):
    """`benchmarks/async_rollout.py --quick` on vlm_grpo (the command of docs/async.md, short form): every variant
    runs, the table lists them, the overlap table follows, and both async variants trained on batches one policy
    version stale; with `--mode ranks` the async variants run on a rollout rank under torchrun."""
    import json
    import subprocess

    from mmrl.testing import child_env

    proc = subprocess.run([sys.executable, str(BENCH / "async_rollout.py"), "--quick", "--recipes", "vlm_grpo",
                           "--out", str(tmp_path / "bench"), "--mode", mode], cwd=BENCH.parent, env=child_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = [[line.split("|")[1].strip() for line in block.splitlines() if line.startswith("| ")][1:]
              for block in proc.stdout.split("\n\n")]
    tables = [t for t in tables if t]
    assert tables[0] == ["sync 2 threads", "sync 1 thread", "async, decoupled PPO", "async, bypass"]
    # the overlap table: each async variant's own async/* means, and the A/B pair
    assert tables[1] == ["async, decoupled PPO (in-run)", "async, bypass (in-run)",
                         "async, bypass vs sync 1 thread (A/B)"]
    for variant in ("async_decoupled_PPO", "async_bypass"):
        rows = [json.loads(x) for x in (tmp_path / "bench" / "vlm_grpo" / variant / "metrics.jsonl").read_text()
                .splitlines() if x.strip()]
        assert [r["rollout/staleness/max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
def test_compare_diffusion_algos_time_to_target_and_speedups_by_hand():
    cmp = load_script("compare_diffusion_algos")
    curve = [(0.0, -1.0), (10.0, -0.8), (20.0, -0.4), (30.0, -0.5)]
    assert cmp.time_to_target(curve, -0.6) == pytest.approx(15.0)  # between (10, -0.8) and (20, -0.4)
    assert cmp.time_to_target(curve, -1.2) == 0.0 and cmp.time_to_target(curve, -0.3) is None
    assert cmp.mean_std([2.0, 4.0]) == (3.0, pytest.approx(2 ** 0.5)) and cmp.mean_std([5.0]) == (5.0, 0.0)

    def rows(evals):  # one metrics row per step: (cpu s, held-out eval or None)
        return [{"step": i + 1, "reward/mean": 0.0, "eval/reward/mean": e, "bench/cpu_s": c, "bench/wall_s": 2 * c,
                 "bench/train_evals": 10 * c} for i, (c, e) in enumerate(evals)]

    runs = {"flow_grpo": {0: rows([(10, -0.9), (20, -0.7), (30, -0.5), (40, -0.5)]),
                          1: rows([(10, -0.8), (20, -0.6), (30, -0.6), (40, -0.4)])},
            "fast": {0: rows([(5, -0.5), (10, -0.3), (15, None), (20, -0.2)]),
                     1: rows([(5, -0.9), (10, -0.9), (15, -0.9), (20, -0.9)])}}
    s = cmp.summarise(runs, {0: -1.0, 1: -1.0})
    assert s["targets"] == {0: -0.5, 1: pytest.approx(-0.5)}  # mean of Flow-GRPO's last two evals per seed
    # seed 0: Flow-GRPO reaches -0.5 at 30 s, "fast" at 5 s -> 6x; seed 1: Flow-GRPO between (30, -0.6) and (40, -0.4)
    # = 35 s, "fast" never -> one seed, reported as 1/2 reached
    assert s["flow_grpo"]["seeds"][1]["ttt_cpu_s"] == pytest.approx(35.0)
    assert s["fast"]["seeds"][0]["ttt_cpu_s"] == 5.0 and s["fast"]["seeds"][1]["ttt_cpu_s"] is None
    assert s["fast"]["speedup_cpu_s"] == (6.0, 0.0) and s["fast"]["reached_cpu_s"] == "1/2"
    assert s["fast"]["speedup_train_evals"] == (6.0, 0.0)  # the same curve on the T-eval clock (x10)
    assert s["flow_grpo"]["speedup_cpu_s"] == (1.0, 0.0) and s["flow_grpo"]["reached_cpu_s"] == "2/2"
    with pytest.raises(SystemExit, match="unknown algorithm"):
        cmp.main(["--only", "sdxl_dpo"])
    assert "compare_diffusion_algos" in load_script("run_all").BENCHMARKS


def test_compare_diffusion_algos_grid_bound_and_stop_by_hand():
    cmp = load_script("compare_diffusion_algos")
    curve = [(0.0, -1.0), (10.0, -0.8), (20.0, -0.4)]
    assert cmp.grid_bound(curve, -0.6) == (pytest.approx(10.0 / 15.0), False)  # crossed at 15 s in (10, 20)
    assert cmp.grid_bound(curve, -0.9) == (pytest.approx(10.0 / 5.0), True)  # before the first evaluation
    assert cmp.grid_bound(curve, -0.3) is None and cmp.grid_bound(curve, -1.0) is None  # never / at the start
    stop = cmp.StopAt(target=-0.5, cpu_cap=100.0)
    stop.on_log(1, {"bench/cpu_s": 5.0})
    stop.on_log(2, {"bench/cpu_s": 9.0, "eval/reward/mean": -0.6})
    assert not stop.stop_requested
    stop.on_log(3, {"bench/cpu_s": 12.0, "eval/reward/mean": -0.5})
    assert stop.stop_requested and stop.why.startswith("target")
    capped = cmp.StopAt(target=None, cpu_cap=10.0)
    capped.on_log(1, {"bench/cpu_s": 10.0})
    assert capped.stop_requested and capped.why.startswith("CPU cap")
    # every algorithm of the table has a cited row: config present, evaluation grid, label; the queue knows them all
    assert set(cmp.ALGOS) == set(cmp.QUEUE_ORDER) | {"flow_grpo"}
    for name, algo in cmp.ALGOS.items():
        assert (cmp.REPO / "configs/diffusion" / algo.config).is_file() and algo.eval_every >= 1 and algo.label


@pytest.mark.slow
def test_compare_diffusion_algos_quick_mode_stops_each_run_at_its_target(tmp_path):
    cmp = load_script("compare_diffusion_algos")
    s = cmp.main(["--quick", "--seeds", "0", "1", "--out", str(tmp_path)])
    names = cmp.QUICK["algos"]
    assert set(names) <= set(s) and sorted(s["targets"]) == [0, 1]
    for n in names:
        for seed, v in s[n]["seeds"].items():
            steps = [step for step, _, _ in v["curve"]]
            assert steps == list(range(1, v["steps"] + 1)), (n, seed)  # evaluated every step
            assert v["cpu_s"] > 0 and v["train_evals"] > 0
            if n != "flow_grpo" and v["steps"] < cmp.QUICK["steps"] * 4:  # stopped early: target or CPU cap
                cap = s["flow_grpo"]["seeds"][seed]["cpu_s"]
                assert v["eval_final"] >= s["targets"][seed] or v["cpu_s"] >= cap, (n, seed)
                assert v["eval_best"] < s["targets"][seed] or v["eval_final"] >= s["targets"][seed], (n, seed)
        assert (tmp_path / f"{n}_s0" / "metrics.jsonl").is_file()
    assert [v["steps"] for v in s["flow_grpo"]["seeds"].values()] == [2, 2]  # the baseline runs its whole budget
    assert s["flow_grpo"]["reached_cpu_s"] == "2/2"
    if any(v["ttt_cpu_s"] > 0 for v in s["flow_grpo"]["seeds"].values()):
        assert s["flow_grpo"]["speedup_cpu_s"] == (1.0, 0.0)
    assert (tmp_path / "compare_diffusion_algos.png").is_file() and (tmp_path / "summary.json").is_file()
    again = cmp.main(["--quick", "--seeds", "0", "1", "--out", str(tmp_path)])  # finished runs are kept
    assert again["awm"]["seeds"][0]["cpu_s"] == s["awm"]["seeds"][0]["cpu_s"]


def test_preference_loop_hidden_preference_by_hand():
    from PIL import Image

    from mmrl.pipelines.shapes import Shape, render_scene

    loop = load_script("preference_loop")
    blank = render_scene([], "red", size=64)
    assert loop.foreground(blank, "a green circle on a red background") == 0.0
    assert loop.foreground(blank, "a red circle on a blue background") == 1.0  # every pixel is far from blue
    half = Image.new("RGB", (64, 64), (220, 30, 30))
    half.paste((30, 170, 50), (0, 0, 32, 64))  # the left half green: half the pixels are foreground on red
    assert loop.foreground(half, "a green square on a red background") == 0.5
    big = render_scene([Shape("circle", "green", 0.5, 0.5, 0.4)], "red", size=64)
    small = render_scene([Shape("circle", "green", 0.5, 0.5, 0.1)], "red", size=64)
    a, b = (loop.foreground(x, "a green circle on a red background") for x in (big, small))
    assert a > b + loop.MARGIN and loop.prefer(a, b) == 1.0 and loop.prefer(b, a) == 0.0
    assert loop.prefer(0.30, 0.30 + loop.MARGIN / 2) == 0.5  # closer than the margin: a tie
    assert "preference_loop" in load_script("run_all").BENCHMARKS


@pytest.mark.slow
def test_preference_loop_quick_mode_runs_every_stage(tmp_path):
    """`benchmarks/preference_loop.py --quick` (docs/reward-training.md, "The whole loop"): base samples, the scripted
    labeller through the label server's HTTP API, reward_bt on its pairs, Flow-GRPO against the export (with its
    judge) and offline DPO on the same pairs, then the paired held-out measurement."""
    import json

    loop = load_script("preference_loop")
    r = loop.main(["--quick", "--out", str(tmp_path)])
    events = [json.loads(x) for x in (tmp_path / "preferences.events.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (tmp_path / "preferences.jsonl").read_text().splitlines()]
    lab = r["labels"]
    assert len(events) == len(rows) == lab["left"] + lab["right"] + lab["tie"] == loop.QUICK["pairs"]
    assert {e["session"] for e in events} == {"scripted"}  # every label came in through POST /api/label
    assert lab["progress"]["labelled"] == loop.QUICK["pairs"]
    for row in rows:  # the labeller's choice is the hidden preference of the two images written
        from PIL import Image

        cov = [loop.foreground(Image.open(tmp_path / row[k]), row["prompt"]) for k in ("image_0", "image_1")]
        assert row["label_0"] == loop.prefer(*cov)
    spec = json.loads((tmp_path / "reward_bt" / "reward" / "mmrl_reward.json").read_text())
    assert spec["train_pairs"] + spec["eval_pairs"] == lab["left"] + lab["right"]  # ties dropped
    grpo = [json.loads(x) for x in (tmp_path / "flow_grpo_s0" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/learned_pref", "eval/judge/shapes_geneval", "eval/judge/prompt_color"} <= set(grpo[-1])
    assert (tmp_path / "dpo_s0" / "checkpoints" / "step_1").is_dir()
    for algo in ("flow_grpo", "dpo"):
        row = r["runs"][algo][0]
        assert 0.0 <= row["win_rate"] <= 1.0 and 0.0 <= row["coverage"] <= 1.0
    assert (tmp_path / "summary.json").is_file()


def test_algo_step_cost_counts_the_published_transformer_evaluations_by_hand(tmp_path):
    """8 samples per step (--quick). Flow-GRPO published: 10 SDE steps with CFG (x2) + 9 trained steps with CFG + 9
    reference steps with CFG = 56 rows per sample; DGPO: 10 CFG steps + 4 trained + 4 reference + 4 old points without
    CFG = 32; on the task (8 steps, no CFG) 8 + 7 + 7 = 22 and 8 + 4 + 4 + 4 = 20."""
    cost = load_script("algo_step_cost").main(["--quick", "--only", "dgpo", "--out", str(tmp_path)])
    assert cost["flow_grpo"]["published"]["evals"] == 8 * 56 and cost["dgpo"]["published"]["evals"] == 8 * 32
    assert cost["flow_grpo"]["task"]["evals"] == 8 * 22 and cost["dgpo"]["task"]["evals"] == 8 * 20
    assert cost["flow_grpo"]["per_step_x"] == 1.0 and cost["dgpo"]["per_step_x"] > 0
    assert (tmp_path / "cost.json").is_file()


@pytest.mark.slow
def test_janus_color_demo_runs_both_arms_and_evaluates(tmp_path):
    """`benchmarks/janus_color_demo.py` in its shortest form (1 seed, 6 steps, 1 image per held-out prompt): both
    arms train in parallel processes, the table has a row per arm, the control at lr 1e-8 ends where it started on
    the held-out prompts (same sampling seed, weights moved by ~1e-8), and the held-out grids are written."""
    import json
    import subprocess

    from mmrl.testing import child_env

    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, str(BENCH / "janus_color_demo.py"), "--seeds", "0", "--steps", "6",
                           "--eval-images", "1", "--jobs", "2", "--out", str(out)], cwd=BENCH.parent,
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"trained", "control"} and all(r["steps"] == 6 for r in runs.values())
    assert abs(runs["control"]["held_out_end"] - runs["control"]["held_out_start"]) < 0.02
    assert "| 0 | trained |" in proc.stdout and "| 0 | control |" in proc.stdout
    assert (out / "held_out_start.png").is_file() and (out / "held_out_trained.png").is_file()
