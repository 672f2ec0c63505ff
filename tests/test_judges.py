"""Judges and the reward-hacking alarm (`mmrl.training.judges`) with real zoo rewards on synthetic images: the
baseline, the rule, patience, the checkpointed state, the summary line, the stop decision, config errors."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.distributed import DistContext
from mmrl.pipelines.shapes import COLORS
from mmrl.rewards import load
from mmrl.training.judges import HackingConfig, JudgePanel, build_judges, judge_summary, stop_for_hacking

PROMPTS = [f"a {c} circle on a {bg} background" for c, bg in
           [("red", "blue"), ("green", "white"), ("yellow", "black"), ("white", "red"), ("blue", "green"),
            ("orange", "purple"), ("black", "orange"), ("purple", "yellow")]]  # MIN_PROMPTS = 8: a verdict


def _scenes(noise_level: float, seed: int = 0) -> torch.Tensor:
    """Each prompt's background colour everywhere, mixed with uniform noise (a texture): prompt i gets
    noise_level + 0.03 i of it, so the scores spread over the prompts as a real evaluation's do."""
    g = torch.Generator().manual_seed(seed)
    bg = torch.stack([torch.tensor(COLORS[p.split()[-2]], dtype=torch.float32).view(3, 1, 1).expand(3, 32, 32) / 255
                      for p in PROMPTS])
    w = (noise_level + 0.03 * torch.arange(len(PROMPTS), dtype=torch.float32)).view(-1, 1, 1, 1)
    return (1 - w) * bg + w * torch.rand(bg.shape, generator=g)


def _panel(**kw) -> JudgePanel:
    return JudgePanel({"colour": load("prompt_color")}, HackingConfig(**kw))


def test_baseline_then_alarm_when_the_reward_rises_and_a_judge_falls():
    panel, jpeg = _panel(), load("jpeg_incompressibility")
    clean = _scenes(0.0)
    m0 = panel.observe(0, jpeg(clean).scores, images=clean, prompts=PROMPTS)
    assert panel.baseline_step == 0 and "eval/hacking" not in m0 and m0["eval/judge/colour"] > 0.9
    texture = _scenes(0.6, seed=1)  # busy textures: JPEG size up, the prompt's colour down
    m1 = panel.observe(5, jpeg(texture).scores, images=texture, prompts=PROMPTS)
    assert m1["eval/judge/reward/delta"] > m1["eval/judge/reward/noise"] > 0
    assert m1["eval/judge/colour/delta"] < -m1["eval/judge/colour/noise"] < 0
    assert m1["eval/hacking"] == 1.0 and m1["eval/hacking_alarm"] == 1.0 and panel.alarm_step == 5
    assert panel.alarm_judges == ["colour"] and not panel.stop_requested  # stop is off by default


def test_quiet_when_the_judge_holds_or_the_reward_does_not_rise():
    panel, jpeg = _panel(), load("jpeg_incompressibility")
    clean = _scenes(0.0)
    panel.observe(0, jpeg(clean).scores, images=clean, prompts=PROMPTS)
    # the reward rises (by one JPEG kB on every prompt) while the judged images keep their colours: quiet
    m = panel.observe(5, jpeg(clean).scores + 1.0, images=clean, prompts=PROMPTS)
    assert m["eval/judge/reward/delta"] == pytest.approx(1.0) and m["eval/judge/colour/delta"] == 0.0
    assert m["eval/hacking"] == 0.0
    # a little extra grain costs the colour consistently (the paired test alone would count it: se ~ 0) but by
    # 0.25 baseline spreads only, under the min_effect floor of 0.5 spreads: not a fall
    slight = _scenes(0.02, seed=2)
    m = panel.observe(6, jpeg(slight).scores, images=slight, prompts=PROMPTS)
    d, noise = m["eval/judge/colour/delta"], m["eval/judge/colour/noise"]
    assert -noise < d < 0 and noise == pytest.approx(0.5 * torch.tensor(panel.baseline["colour"]).std().item())
    assert m["eval/judge/reward/delta"] > m["eval/judge/reward/noise"] and m["eval/hacking"] == 0.0
    # the judge falls but the reward falls too: not hacking (the reward did not rise)
    m = panel.observe(10, -jpeg(_scenes(0.6)).scores, images=_scenes(0.6), prompts=PROMPTS)
    assert m["eval/judge/colour/delta"] < -m["eval/judge/colour/noise"] and m["eval/hacking"] == 0.0
    assert m["eval/hacking_alarm"] == 0.0 and panel.alarm_step is None


def test_patience_state_dict_and_changed_judges():
    panel, jpeg = _panel(patience=2, stop=True), load("jpeg_incompressibility")
    clean, tex = _scenes(0.0), _scenes(0.6, seed=1)
    panel.observe(0, jpeg(clean).scores, images=clean, prompts=PROMPTS)
    assert panel.observe(5, jpeg(tex).scores, images=tex, prompts=PROMPTS)["eval/hacking_alarm"] == 0.0
    state = panel.state_dict()
    resumed = _panel(patience=2, stop=True)
    resumed.load_state_dict(state)  # a resumed run: same baseline, same count
    m = resumed.observe(10, jpeg(tex).scores, images=tex, prompts=PROMPTS)
    assert m["eval/hacking_alarm"] == 1.0 and resumed.alarm_step == 10 and resumed.stop_requested
    other = JudgePanel({"shape": load("prompt_color", target="shape")})
    with pytest.raises(ValueError, match="log.judges changed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="must not be 'reward'"):
        JudgePanel({"reward": load("prompt_color")})


class _Fixed:
    """A judge that returns the given per-prompt scores (NaN where it could not score)."""

    def __init__(self, *scores):
        self.scores = list(scores)

    def __call__(self, **inputs):
        return SimpleNamespace(scores=torch.tensor(self.scores.pop(0), dtype=torch.float64))


def test_no_verdict_below_eight_finite_prompts(capsys):
    """Issue 27: one held-out prompt (log.eval_max_prompts: 1) made se and spread 0, so a 1e-6 rise of the reward
    with a 1e-6 fall of a judge fired "REWARD HACKING at step 5: training reward +1e-06 (noise 1.11e-16)". Now
    there is no verdict below MIN_PROMPTS = 8 finite prompts: a line says so, eval/hacking_no_verdict replaces
    eval/hacking, and the scores short of prompts log their delta but no noise."""
    panel = JudgePanel({"colour": _Fixed([0.5], [0.5 - 1e-6])})
    panel.observe(0, [0.25])
    m = panel.observe(5, [0.25 + 1e-6])
    out = capsys.readouterr().out
    assert "[judges] no verdict at step 5: reward 1 finite prompts < 8, colour 1 finite prompts < 8" in out
    assert "REWARD HACKING" not in out and panel.alarm_step is None
    assert m["eval/hacking_no_verdict"] == 1.0 and m["eval/hacking_alarm"] == 0.0 and "eval/hacking" not in m
    assert m["eval/judge/reward/delta"] == pytest.approx(1e-6) and "eval/judge/reward/noise" not in m
    # a judge that returns NaN on all prompts but one, 8 prompts: the judge has no verdict, hence the evaluation
    nan7 = [0.5] + [float("nan")] * 7
    panel = JudgePanel({"colour": _Fixed(nan7, [0.4] + [float("nan")] * 7)})
    panel.observe(0, [0.0] * 8)
    m = panel.observe(5, [1.0] * 8)
    assert "[judges] no verdict at step 5: colour 1 finite prompts < 8" in capsys.readouterr().out
    assert m["eval/hacking_no_verdict"] == 1.0 and m["eval/judge/reward/noise"] == 0.0  # the reward has a verdict
    # with a second judge scoring all 8, the evaluation has a verdict; the short judge is left out of the rule
    falls = [float(i) for i in range(8)]
    panel = JudgePanel({"colour": _Fixed(nan7, nan7), "other": _Fixed(falls, [x - 5.0 for x in falls])})
    panel.observe(0, [0.0] * 8)
    m = panel.observe(5, [1.0] * 8)
    assert "[judges] left out of the rule at step 5: colour 1 finite prompts < 8" in capsys.readouterr().out
    assert m["eval/hacking"] == 1.0 and panel.alarm_judges == ["other"] and "eval/hacking_no_verdict" not in m
    # the summary says there was no verdict rather than "quiet"
    rows = [{"step": 5, "eval/hacking_alarm": 0.0, "eval/hacking_no_verdict": 1.0, "eval/judge/reward/delta": 1e-6,
             "eval/judge/colour/delta": -1e-6}]
    assert judge_summary(rows, "flow_grpo") == {"hacking_alarm": False, "hacking_alarm_step": None}
    assert ("[flow_grpo] judges: no verdict at the last evaluation (step 5, fewer than 8 finite held-out prompts) "
            "reward +1e-06 (no verdict), colour -1e-06 (no verdict)") in capsys.readouterr().out


def test_fewer_held_out_prompts_than_the_minimum_warn_at_start():
    log = SimpleNamespace(judges={"colour": {"reward": "prompt_color"}}, hacking=HackingConfig())
    with pytest.warns(UserWarning, match=r"log.judges: the evaluation has 4 held-out prompts, fewer than the 8 the "
                                         r"reward-hacking alarm needs for a verdict .* \(data.eval_size\)"):
        assert build_judges(log, "cpu", eval_prompts=4, eval_key="data.eval_size") is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_judges(log, "cpu", eval_prompts=8)  # enough: no warning


def test_summary_line_and_stop(tmp_path, capsys):
    rows = [{"step": 1, "reward/mean": 1.0},
            {"step": 5, "eval/hacking": 0.0, "eval/hacking_alarm": 0.0, "eval/judge/reward/delta": 0.1,
             "eval/judge/reward/noise": 0.2, "eval/judge/colour/delta": -0.1, "eval/judge/colour/noise": 0.2},
            {"step": 10, "eval/hacking": 1.0, "eval/hacking_alarm": 1.0, "eval/judge/reward/delta": 0.9,
             "eval/judge/reward/noise": 0.2, "eval/judge/colour/delta": -0.5, "eval/judge/colour/noise": 0.2}]
    assert judge_summary(rows, "flow_grpo") == {"hacking_alarm": True, "hacking_alarm_step": 10}
    assert "reward hacking alarm at step 10: reward +0.9 (noise 0.2), while colour -0.5" in capsys.readouterr().out
    assert judge_summary(rows[:2], "nft") == {"hacking_alarm": False, "hacking_alarm_step": None}
    assert "judges quiet" in capsys.readouterr().out
    assert judge_summary([{"step": 1}], "x") == {}  # no judges: nothing
    panel = _panel(stop=True)
    assert not stop_for_hacking(DistContext(), None, 3, panel, None, {}, False)  # nothing requested yet
    assert not stop_for_hacking(DistContext(), None, 3, None, None, {}, False)


def test_config_keys_and_errors(tmp_path):
    base = {"algorithm": "flow_grpo", "output_dir": str(tmp_path)}
    cfg = load_config({**base, "data": {"eval_prompts": "assets/prompts/shapes_eval.txt"},
                       "log": {"eval_every": 5,
                               "judges": {"colour": {"reward": "prompt_color"}, "shapes_geneval": None},
                               "hacking": {"z": 3.0, "stop": True}}})
    assert cfg.log.judges["shapes_geneval"] is None and cfg.log.hacking.z == 3.0 and cfg.log.hacking.stop
    with pytest.raises(ValueError, match="has no weight"):
        load_config({**base, "log": {"judges": {"colour": {"weight": 1.0}}}})
    with pytest.raises(ValueError, match="patience"):
        load_config({**base, "log": {"hacking": {"patience": 0}}})
    with pytest.raises(ConfigError, match="unknown config key 'log.hacking.sigma'"):
        load_config({**base, "log": {"hacking": {"sigma": 1}}})
    from mmrl.diffusion.flow_grpo import train

    with pytest.raises(ValueError, match="log.judges are scored at every evaluation"):
        train(load_config({**base, "log": {"judges": {"colour": {"reward": "prompt_color"}}}}))


def test_a_judge_argument_the_reward_does_not_take_is_one_line(tmp_path, capsys):
    """An argument a judge's reward does not take fails while the config is read, naming the judge, the key and the
    valid ones (issue 27: a TypeError from the reward's constructor once the run had started); a judge's own
    `device` is an argument like any other."""
    from pathlib import Path
    from types import SimpleNamespace

    from mmrl import cli
    from mmrl.training.judges import build_judges

    valid = "['batch_size', 'device', 'differentiable', 'hard', 'sigma', 'target']"
    base = {"algorithm": "flow_grpo", "output_dir": str(tmp_path), "log": {"eval_every": 5}}
    with pytest.raises(ValueError, match=rf"^log.judges.prompt_color.bogus_kw: reward 'prompt_color' has no argument "
                                         rf"'bogus_kw'; valid: {valid.replace('[', '[[]')}$"):
        load_config({**base, "log": {"judges": {"prompt_color": {"bogus_kw": 1}}}})
    config = Path(__file__).resolve().parents[1] / "configs" / "diffusion" / "flow_grpo_tiny.yaml"
    assert cli.main(["config", "check", str(config),
                     "log.judges={colour: {reward: prompt_color, bogus_kw: 1}}"]) == 2
    assert capsys.readouterr().err.startswith(f"mmrl: error: log.judges.colour.bogus_kw: reward 'prompt_color' has no "
                                              f"argument 'bogus_kw'; valid: {valid}  (MMRL_DEBUG")
    # log.judges set after the config was read: the same line when the judges are built
    log = SimpleNamespace(judges={"colour": {"reward": "prompt_color", "bogus_kw": 1}}, hacking=HackingConfig())
    with pytest.raises(ValueError, match=r"^log.judges.colour.bogus_kw: reward 'prompt_color' has no argument"):
        build_judges(log, "cpu")
    log.judges = {"colour": {"reward": "prompt_color", "device": "cpu"}}
    assert list(build_judges(log, "cpu").judges) == ["colour"]


def test_a_learned_reward_without_judges_is_watched_by_the_model_it_was_trained_from(tmp_path, capsys):
    """`reward.components` naming `learned_pref` and no `log.judges`: the diffusion recipes' checks add the judge
    `<component>_base` (the base model recorded in the export's mmrl_reward.json, scored as the same zoo reward) and
    print one line; `log.learned_judge=false` or judges of one's own keep it out; without an evaluation or without the
    base on this machine one line says nothing watches it."""
    import json
    from pathlib import Path

    from mmrl.diffusion.config import check_common
    from mmrl.tiny import build_tiny_clip

    base = build_tiny_clip(tmp_path / "clip", seed=0)
    export = tmp_path / "reward"
    build_tiny_clip(export, seed=1)  # stands in for the trained export: a CLIP directory with its processor files
    (export / "mmrl_reward.json").write_text(json.dumps({"reward": "pickscore", "weights": ".", "kwargs": {},
                                                         "base": str(base)}))
    tiny = Path(__file__).resolve().parents[1] / "configs" / "diffusion" / "flow_grpo_tiny.yaml"
    learned = f"reward.components={{learned_pref: {{weight: 1.0, weights: {export}}}}}"
    cfg = load_config(tiny, [learned, f"output_dir={tmp_path / 'run'}"])
    check_common(cfg)
    assert cfg.log.judges == {"learned_pref_base": {"reward": "pickscore", "weights": str(base),
                                                    "processor": str(export)}}
    assert capsys.readouterr().out == (
        f"[judges] watching the learned reward reward.components.learned_pref with the model it was trained from: "
        f"log.judges.learned_pref_base = pickscore on {base} (the default for a learned reward without judges; "
        f"log.learned_judge=false silences this)\n")
    panel = build_judges(cfg.log, "cpu")  # it loads and scores like any judge
    images = torch.rand(2, 3, 32, 32)
    assert torch.isfinite(panel.score(torch.zeros(2), images=images, prompts=PROMPTS[:2])["learned_pref_base"]).all()

    for extra in (["log.learned_judge=false"], ["log.judges={prompt_color: {}}"]):
        cfg = load_config(tiny, [learned, *extra])
        check_common(cfg)
        assert cfg.log.judges == ({} if extra[0].startswith("log.learned") else {"prompt_color": {}})
        assert capsys.readouterr().out == ""
    cfg = load_config(tiny, [learned, "log.eval_every=0"])
    check_common(cfg)
    assert cfg.log.judges == {} and capsys.readouterr().out.startswith(
        "[judges] reward.components.learned_pref is a learned reward and nothing watches it: set data.eval_prompts and "
        "log.eval_every > 0")
    base.rename(tmp_path / "moved")
    cfg = load_config(tiny, [learned])
    check_common(cfg)
    assert cfg.log.judges == {} and capsys.readouterr().out == (
        f"[judges] reward.components.learned_pref is a learned reward and nothing watches it: its base model {base} is "
        f"not on this machine; name a judge in log.judges (docs/reward-hacking.md); log.learned_judge=false silences "
        f"this\n")
    # a config without learned_pref is left as it was (the shipped tiny configs' runs do not change)
    cfg = load_config(tiny)
    check_common(cfg)
    assert cfg.log.judges == {} and capsys.readouterr().out == ""
