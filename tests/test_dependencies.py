"""What mmrl declares it needs matches what it uses: accelerate is only a launcher (an extra, never imported),
transformers and diffusers are bounded below the next major version, and qwen-vl-utils does the Qwen-VL resizing
(no copy of it in mmrl)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imported_top_level_names() -> set[str]:
    names = set()
    for path in (ROOT / "mmrl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def _requirement(name: str, group: list[str]) -> str | None:
    return next((r for r in group if re.match(rf"^{re.escape(name)}\b", r)), None)


def test_accelerate_is_an_optional_launcher_extra_and_never_imported():
    assert "accelerate" not in _imported_top_level_names()
    assert _requirement("accelerate", PROJECT["dependencies"]) is None
    assert _requirement("accelerate", PROJECT["optional-dependencies"]["accelerate"])


def test_transformers_and_diffusers_are_bounded_below_their_next_major():
    assert _requirement("transformers", PROJECT["dependencies"]).endswith(",<6")
    assert _requirement("diffusers", PROJECT["dependencies"]).endswith(",<1")


def test_qwen_vl_resizing_comes_from_qwen_vl_utils():
    """The resize arithmetic is qwen_vl_utils' (no local copy of round/ceil/floor_by_factor)."""
    source = (ROOT / "mmrl" / "pipelines" / "images.py").read_text()
    assert "from qwen_vl_utils import vision_process" in source
    assert not re.search(r"def _?(round|ceil|floor)_by_factor", source)
    assert _requirement("qwen-vl-utils", PROJECT["dependencies"])
