import sys
import types
from dataclasses import dataclass, field

import pytest
import yaml

from mmrl import config as C
from mmrl.config import ConfigError, RunConfig, TrainConfig


@dataclass
class ToyTrain(TrainConfig):
    lr: float = 1e-3
    """Learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""


@dataclass
class ToyModel:
    path: str = "m"
    """Model directory."""
    rank: int | None = None
    """LoRA rank; null = full fine-tuning."""


@dataclass
class ToyConfig(RunConfig):
    model: ToyModel = field(default_factory=ToyModel)
    """Model section."""
    train: ToyTrain = field(default_factory=ToyTrain)
    """Training section."""
    rewards: dict[str, float] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    """Reward name -> weight."""
    use_ema: bool = False
    """Keep an EMA copy."""


@pytest.fixture
def toy_recipe(monkeypatch):
    mod = types.ModuleType("mmrl_toy_recipe")
    mod.Config = ToyConfig
    mod.train = lambda cfg: {"ok": True, "lr": cfg.train.lr}
    monkeypatch.setitem(sys.modules, "mmrl_toy_recipe", mod)
    monkeypatch.setitem(C.RECIPES, "toy", "mmrl_toy_recipe")
    return mod


def test_from_dict_nested_and_types():
    cfg = C.from_dict(ToyConfig, {"algorithm": "toy", "train": {"lr": "1e-4", "max_steps": 7}, "model": {"rank": 8}})
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)  # YAML's "1e-4" string becomes a float
    assert cfg.train.max_steps == 7 and cfg.model.rank == 8 and cfg.train.save_every == 50


def test_unknown_key_names_key_path_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        C.from_dict(ToyConfig, {"train": {"lrr": 1}})
    msg = str(e.value)
    assert "train.lrr" in msg and "'lr'" in msg and "max_steps" in msg


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match=r"train.max_steps: expected an integer, got 'ten'"):
        C.from_dict(ToyConfig, {"train": {"max_steps": "ten"}})
    with pytest.raises(ConfigError, match="use_ema: expected true/false"):
        C.from_dict(ToyConfig, {"use_ema": "yes please"})
    with pytest.raises(ConfigError, match="rank"):
        C.from_dict(ToyConfig, {"model": {"rank": 1.5}})


def test_overrides_typed():
    cfg = ToyConfig()
    C.apply_overrides(cfg, ["train.lr=3e-4", "model.rank=null", "train.betas=[0.5, 0.6]", "model.path=007", "use_ema=true"])
    assert cfg.train.lr == 3e-4 and cfg.model.rank is None and cfg.train.betas == [0.5, 0.6]
    assert cfg.model.path == "007" and cfg.use_ema is True
    with pytest.raises(ConfigError, match="unknown config key 'train.nope'"):
        C.apply_overrides(cfg, ["train.nope=1"])
    with pytest.raises(ConfigError, match="not of the form"):
        C.apply_overrides(cfg, ["train.lr"])
    with pytest.raises(ConfigError, match="expected a number"):
        C.apply_overrides(cfg, ["train.lr=fast"])


@dataclass
class ToyInner:
    level: str = "none"
    """Inner choice."""


@dataclass
class ToyOuter:
    enabled: bool = False
    """Whether the inner choice may be set."""
    inner: ToyInner = field(default_factory=ToyInner)
    """Inner section."""

    def __post_init__(self):
        if self.inner.level != "none" and not self.enabled:
            raise ValueError("outer.inner.level needs outer.enabled")


@dataclass
class ToyNested(RunConfig):
    outer: ToyOuter = field(default_factory=ToyOuter)
    """Outer section."""


def test_overrides_rerun_the_checks_of_enclosing_sections():
    """A section's check across its nested sections sees a dotted override of a nested key (the CLI path), after all
    overrides are applied (so their order does not matter)."""
    with pytest.raises(ValueError, match="outer.inner.level needs outer.enabled"):
        C.apply_overrides(ToyNested(), ["outer.inner.level=token"])
    for order in (["outer.inner.level=token", "outer.enabled=true"], ["outer.enabled=true", "outer.inner.level=token"]):
        cfg = C.apply_overrides(ToyNested(), order)
        assert (cfg.outer.enabled, cfg.outer.inner.level) == (True, "token")


def test_yaml_round_trip_with_docs():
    cfg = ToyConfig(algorithm="toy")
    text = C.to_yaml(cfg)
    assert "# Learning rate." in text and "# Newest complete checkpoint" not in text
    assert "# `auto` (newest complete checkpoint" in text  # inherited TrainConfig docs
    back = C.from_dict(ToyConfig, yaml.safe_load(text))
    assert back == cfg


def test_load_config_dispatch_and_errors(tmp_path, toy_recipe):
    p = tmp_path / "c.yaml"
    p.write_text("algorithm: toy\ntrain:\n  lr: 0.5\n")
    cfg = C.load_config(p, ["train.max_steps=3"])
    assert isinstance(cfg, ToyConfig) and cfg.train.lr == 0.5 and cfg.train.max_steps == 3
    p.write_text("algorithm: toy\ntrain:\n  lrate: 0.5\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown config key 'train.lrate'"):
        C.load_config(p)
    p.write_text("algorithm: nope\n")
    with pytest.raises(ConfigError, match="c.yaml: unknown algorithm 'nope'"):
        C.load_config(p)
    p.write_text("")
    with pytest.raises(ConfigError, match="c.yaml: the file is empty"):
        C.load_config(p)
    p.write_text("train: {}\n")
    with pytest.raises(ConfigError, match="missing top-level key 'algorithm'"):
        C.load_config(p)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        C.load_config(tmp_path / "missing.yaml")
    p.write_text("algorithm: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        C.load_config(p)


@pytest.mark.parametrize("command", ["check", "train"])
def test_cross_key_checks_do_not_depend_on_the_order_of_overrides(command, tmp_path, monkeypatch, capsys):
    """`rollout.max_staleness=1 rollout.worker=process` was refused ("needs rollout.worker=process") because the
    section's checks ran after each override; they run once on the final values, for `train` and `config check`."""
    from pathlib import Path

    from mmrl import cli

    trained = []
    monkeypatch.setattr(cli, "recipe_module", lambda name: types.SimpleNamespace(train=trained.append))
    flow = str(Path(__file__).resolve().parents[1] / "configs/diffusion/flow_grpo_tiny.yaml")
    args = (["config", "check"] if command == "check" else ["train"]) + [flow, f"output_dir={tmp_path / 'run'}"]
    for pair in (["rollout.max_staleness=1", "rollout.worker=process"],
                 ["rollout.worker=process", "rollout.max_staleness=1"]):
        assert cli.main(args + pair) == 0, capsys.readouterr().err
    assert cli.main(args + ["rollout.max_staleness=1"]) == 2  # the check itself still holds
    assert "rollout.max_staleness=1 needs rollout.worker=process" in capsys.readouterr().err
    assert len(trained) == (2 if command == "train" else 0)
