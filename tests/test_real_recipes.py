"""The configs' header comments and docs/real-recipes.md: every `mmrl train` command they show validates against its
recipe's config schema, every dotted key they mention exists, the header's model path is the config's own, and the
page's Pick-a-Pic conversion produces a preference file the DPO recipe reads."""

import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest
from PIL import Image

from mmrl.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))
REAL = [p for p in CONFIGS if "tiny" not in p.stem]
PAGE = REPO / "docs" / "real-recipes.md"
FILE_SUFFIXES = {"py", "sh", "txt", "yaml", "yml", "json", "jsonl", "parquet", "md", "safetensors", "jinja", "pth", "pt"}


def header(path: Path) -> str:
    """The leading comment block of a YAML file, without the '#'."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return "\n".join(lines)


def mmrl_train_commands(text: str) -> list[list[str]]:
    """`mmrl train CONFIG key=value ...` command lines in `text` ('\\' continuations joined), as argument lists."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [shlex.split(m.group(1)) for m in re.finditer(r"^\s*mmrl train (.+)$", joined, flags=re.M)]


def has_key(cfg, dotted: str) -> bool:
    """Whether `dotted` names a field of the config (dict-valued fields such as reward.components take any key)."""
    obj = cfg
    for part in dotted.split("."):
        if isinstance(obj, dict):
            if part not in obj:
                return True  # a free-form mapping: any entry name is valid
            obj = obj[part]
        elif dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}:
            obj = getattr(obj, part)
        else:
            return False
    return True


def mentioned_keys(text: str, sections: set[str]) -> set[str]:
    """Dotted config keys mentioned in prose: `section.name[.more]` for the config's own sections (file names such
    as train.py and dotted Python names such as mmrl.pipelines.data.X are not keys)."""
    found = set()
    for m in re.finditer(r"(?<![\w/.\-])([a-z_]+(?:\.[A-Za-z_]\w*)+)", text):
        key = m.group(1)
        if key.split(".")[0] in sections and key.split(".")[-1] not in FILE_SUFFIXES:
            found.add(key)
    return found


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_headers_use_current_keys_and_a_command_that_validates(path):
    cfg = load_config(path)
    text = header(path)
    sections = {f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))}
    stale = sorted(k for k in mentioned_keys(text, sections) if not has_key(cfg, k))
    assert not stale, f"{path.name}: its header mentions config keys that do not exist: {stale}"
    rel = str(path.relative_to(REPO))
    commands = mmrl_train_commands(text)
    if path in REAL:
        assert any(c[0] == rel for c in commands), f"{path.name}: its header shows no `mmrl train {rel} ...` command"
    for cmd in commands:
        overrides = [a for a in cmd[1:] if "=" in a]
        load_config(REPO / cmd[0], overrides)  # ConfigError on an unknown key or a bad value
        if cmd[0] == rel:
            for o in overrides:
                key, _, value = o.partition("=")
                if key == "model.path":  # the path the header shows is the one the YAML holds
                    assert value == str(cfg.model.path), f"{path.name}: header {o} but the YAML says {cfg.model.path}"


def test_the_real_recipes_page_names_every_real_config_with_a_command_that_validates(capsys):
    from mmrl.cli import main

    text = PAGE.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = [c for b in blocks for c in mmrl_train_commands(b)]
    shown = {c[0] for c in commands}
    missing = sorted(str(p.relative_to(REPO)) for p in REAL if str(p.relative_to(REPO)) not in shown)
    assert not missing, f"docs/real-recipes.md shows no command for {missing}"
    for cmd in commands:  # the short form of each command: its config resolved with the same overrides
        assert main(["config", "check", str(REPO / cmd[0]), *cmd[1:]]) == 0, cmd
        assert f"algorithm: {load_config(REPO / cmd[0]).algorithm}" in capsys.readouterr().out
        headers = mmrl_train_commands(header(REPO / cmd[0]))
        assert cmd in headers, f"{cmd} is not the command in the header of {cmd[0]}"


def _jpeg(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="JPEG")
    return buf.getvalue()


def test_the_pages_pick_a_pic_conversion_gives_a_preference_file(tmp_path, monkeypatch):
    """The page's pyarrow snippet, run on two shards shaped like Pick-a-Pic v2's (its column names, JPEG bytes,
    extra columns, a tie), writes the file `data.preference_file` expects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmrl.pipelines.data import load_preference_pairs

    shards = tmp_path / "pickapic_v2" / "data"
    shards.mkdir(parents=True)
    rows = [("a red cat", "red", "blue", 1.0), ("a blue dog", "red", "blue", 0.0), ("a tie", "red", "blue", 0.5)]
    for i, part in enumerate((rows[:2], rows[2:])):
        pq.write_table(pa.table({
            "are_different": [True] * len(part), "caption": [r[0] for r in part],
            "jpg_0": [_jpeg(r[1]) for r in part], "jpg_1": [_jpeg(r[2]) for r in part],
            "label_0": [r[3] for r in part], "label_1": [1 - r[3] for r in part],
        }), shards / f"train-0000{i}-of-00002.parquet")
    (snippet,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "pickapic_v2").mkdir(parents=True)
    exec(compile(snippet.replace("/data/pickapic_v2", str(tmp_path / "pickapic_v2")), str(PAGE), "exec"), {})
    out = tmp_path / "data" / "pickapic_v2" / "train.parquet"
    assert pq.read_table(out).column_names == ["prompt", "image_0", "image_1", "label_0"]
    pairs = load_preference_pairs(out)
    assert [p.prompt for p in pairs] == ["a red cat", "a blue dog"]  # the tie is dropped
    from mmrl.pipelines.images import load_image

    assert load_image(pairs[0].chosen).getpixel((4, 4))[0] > 200  # label_0 = 1: image 0 (red) preferred
    assert load_image(pairs[1].chosen).getpixel((4, 4))[2] > 200  # label_0 = 0: image 1 (blue) preferred
    cfg = load_config(REPO / "configs/diffusion/dpo_sd35_pickapic.yaml")
    assert cfg.data.preference_file == "data/pickapic_v2/train.parquet"  # where the page writes it
