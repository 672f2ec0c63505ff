"""The queue `mmrl label` shows: samples grouped by prompt, then every k of one prompt's samples as one item.

Where the samples come from (`SOURCE`, the first rule that applies):

1. a folder with ``prompts.jsonl`` (or that file itself): rows ``{"prompt": ..., "images": [paths]}`` or
   ``{"prompt": ..., "image": path}`` (``video``/``videos`` are read the same way), paths relative to the file's
   folder; rows of one prompt are merged;
2. an `mmrl eval` folder (``eval_report.json``: its ``per_prompt`` prompts and ``images``);
3. a run directory with `mmrl eval` folders (``eval/*/eval_report.json``): all of them merged by prompt, so one
   prompt's samples of different checkpoints are compared with each other (the run's ``samples/`` grids are not
   used: one picture holds many prompts and shows the rewards);
4. any other folder: its images/videos (searched recursively, hidden files skipped), grouped by file name: the
   stem without a trailing ``_N``, ``-N`` or ``_sN`` (``cat_0.png``, ``cat_1.png`` -> ``cat``; ``p0003_s1.png`` ->
   ``p0003``) within one folder; the prompt is the text of ``<group>.txt`` beside the files, else the group name.

Every k-combination of a group's distinct files (k = 2: every pair) is one item. Its id is a hash of the prompt
and the files' contents (not their names or places): a rerun over the same samples, moved or renamed, finds the
same ids, so labelled items are not shown again. Which sample is shown left is decided by the id (not the file
order, which often follows the checkpoint); the queue is in id order, which mixes the prompts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".gif": "image/gif", ".bmp": "image/bmp"}
VIDEO_TYPES = {".mp4": "video/mp4", ".webm": "video/webm"}
MEDIA_TYPES = {**IMAGE_TYPES, **VIDEO_TYPES}
_INDEX_SUFFIX = re.compile(r"(?:_s|_|-)\d+$")


@dataclass(frozen=True)
class Item:
    """One question for the person: a prompt and its k samples, in the order shown (left to right)."""
    pair_id: str
    prompt: str
    files: tuple[Path, ...]

    def media_type(self, k: int) -> str:
        return MEDIA_TYPES[self.files[k].suffix.lower()]


def _file_hash(path: Path, cache: dict) -> str:
    if path not in cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        cache[path] = h.hexdigest()
    return cache[path]


def _media(path: Path, where: str) -> Path:
    if path.suffix.lower() not in MEDIA_TYPES:
        raise ValueError(f"{where}: {path.name!r} is not an image or video file this page shows "
                         f"({', '.join(sorted(MEDIA_TYPES))})")
    if not path.is_file():
        raise FileNotFoundError(f"{where}: sample file not found: {path}")
    return path.resolve()


def _from_jsonl(path: Path) -> dict[str, list[Path]]:
    groups: dict[str, list[Path]] = {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {i}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where} is not valid JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{where}: each row needs a 'prompt' string and 'images' (a list of paths) or 'image'")
        files = [row[k] for k in ("image", "video") if isinstance(row.get(k), str)]
        for k in ("images", "videos"):
            if k in row:
                if not isinstance(row[k], list) or not all(isinstance(x, str) for x in row[k]):
                    raise ValueError(f"{where}: '{k}' must be a list of paths, got {row[k]!r}")
                files += row[k]
        if not files:
            raise ValueError(f"{where}: no 'images' (list of paths) or 'image' (one path) in the row")
        groups.setdefault(row["prompt"], []).extend(_media(path.parent / f, where) for f in files)
    return groups


def _from_reports(reports: list[Path]) -> dict[str, list[Path]]:
    groups: dict[str, list[Path]] = {}
    for report in reports:
        try:
            per_prompt = json.loads(report.read_text(encoding="utf-8"))["per_prompt"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{report}: not an mmrl eval report (no per_prompt list: {exc})") from None
        for row in per_prompt:
            groups.setdefault(row["prompt"], []).extend(_media(report.parent / f, str(report)) for f in row["images"])
    return groups


def _from_names(folder: Path) -> dict[str, list[Path]]:
    by_key: dict[tuple[Path, str], list[Path]] = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and p.suffix.lower() in MEDIA_TYPES and not any(s.startswith(".") for s in rel.parts):
            by_key.setdefault((p.parent, _INDEX_SUFFIX.sub("", p.stem) or p.stem), []).append(p.resolve())
    groups: dict[str, list[Path]] = {}
    for (parent, key), files in by_key.items():
        text = parent / f"{key}.txt"
        prompt = text.read_text(encoding="utf-8").strip() if text.is_file() else key
        groups.setdefault(prompt, []).extend(files)
    return groups


def read_groups(source: str | Path) -> tuple[dict[str, list[Path]], str]:
    """{prompt: sample files} of `source` (rules in the module docstring) and which rule was used."""
    src = Path(source)
    if not src.exists():
        raise FileNotFoundError(f"label source not found: {source} (give a folder of samples, an mmrl eval folder, a "
                                f"run directory or a prompts.jsonl)")
    if src.is_file():
        if src.name == "eval_report.json":
            return _from_reports([src]), "eval report"
        if src.suffix == ".jsonl":
            return _from_jsonl(src), "prompts.jsonl"
        raise ValueError(f"label source {source} is a file: give a folder, a prompts.jsonl or an eval_report.json")
    if (src / "prompts.jsonl").is_file():
        return _from_jsonl(src / "prompts.jsonl"), "prompts.jsonl"
    if (src / "eval_report.json").is_file():
        return _from_reports([src / "eval_report.json"]), "eval report"
    reports = sorted(src.glob("eval/*/eval_report.json"))
    if reports:
        return _from_reports(reports), f"run directory ({len(reports)} eval folders)"
    if (src / "config.yaml").is_file() and (src / "samples").is_dir():
        raise ValueError(f"{source} is a run directory without evaluations: its samples/ grids hold many prompts in "
                         f"one picture with their rewards; run `mmrl eval {source}` first (it writes eval/<step>/)")
    return _from_names(src), "file names"


def build_queue(source: str | Path, k: int = 2) -> list[Item]:
    """Every k-combination of each prompt's distinct samples, in id order (see the module docstring)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 2 <= k <= 9:
        raise ValueError(f"--k must be an integer in 2..9 (samples shown side by side), got {k!r}")
    groups, rule = read_groups(source)
    cache: dict[Path, str] = {}
    items: dict[str, Item] = {}
    for prompt, files in groups.items():
        distinct: dict[str, Path] = {}
        for f in files:  # the same content twice (a copy) is one sample
            distinct.setdefault(_file_hash(f, cache), f)
        for combo in itertools.combinations(sorted(distinct), k):
            pair_id = hashlib.sha256(json.dumps([prompt, list(combo)]).encode("utf-8")).hexdigest()[:20]
            turn = int(pair_id, 16) % k  # the side each sample is shown on does not follow the file order
            shown = combo[turn:] + combo[:turn]
            items[pair_id] = Item(pair_id, prompt, tuple(distinct[h] for h in shown))
    if not items:
        sizes = sorted({len(v) for v in groups.values()})
        raise ValueError(f"label source {source} ({rule}): no prompt has {k} distinct samples to compare "
                         f"({len(groups)} prompts, samples per prompt: {sizes or 'none'}); see docs/labeling.md "
                         f"for how samples are grouped by prompt")
    return [items[i] for i in sorted(items)]
