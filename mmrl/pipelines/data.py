"""Datasets shared by the recipes: prompt files, preference pairs, visual QA (jsonl / parquet).

Every loader reports bad rows with the file, row number and key; corrupt images are either skipped
(with a warning naming the path) or raise, as `on_error` says.
"""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

# EasyR1 / verl geometry3k prompt: reasoning in <think>, answer boxed.
# source: EasyR1 examples/format_prompt/math.jinja (wording re-written)
GEO3K_TEMPLATE = (
    "{problem} You FIRST think about the reasoning process as an internal monologue and then provide the "
    "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
    "MUST BE put in \\boxed{{}}."
)


class DataError(ValueError):
    """A dataset file or row does not have the expected form."""


def read_text(path: str | Path) -> str:
    """The UTF-8 text of a data file; a binary (NUL bytes) or otherwise non-UTF-8 file is a DataError naming it."""
    path = Path(path)
    hint = "prompt and data files are UTF-8 text (.txt, .jsonl, .json) or .parquet"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not a UTF-8 text file (byte 0x{exc.object[exc.start]:02x} at offset {exc.start} "
                        f"is not UTF-8); {hint}") from None
    if "\x00" in text:
        raise DataError(f"{path}: a binary file (it contains NUL bytes), not text; {hint}")
    return text.removeprefix("\ufeff")  # a byte-order mark (Windows editors) is not part of the first prompt


def is_saved_dataset(path: str | Path) -> bool:
    """True for a directory written by Hugging Face datasets' `save_to_disk` (a Dataset or a DatasetDict)."""
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in ("state.json", "dataset_dict.json"))


def require_path(key: str, path: str | Path, what: str = "file", kind: str = "file") -> None:
    """Fail fast (before any model loads) when the file (`kind="file"`), folder (`"dir"`) or data source (`"data"`:
    a file or a `save_to_disk` directory) a config key names is missing: FileNotFoundError "<key>: <what> not
    found: <path>"."""
    p = Path(path)
    if p.is_file() if kind == "file" else p.is_dir() if kind == "dir" else (p.is_file() or is_saved_dataset(p)):
        return
    expected = {"file": "file", "dir": "folder", "data": "file or a directory saved with datasets' save_to_disk"}
    problem = f"{what} not found: {p}" if not p.exists() else f"{what} {p} is not a {expected[kind]}"
    raise FileNotFoundError(f"{key}: {problem} (relative paths are taken from the current directory, {Path.cwd()})")


def read_saved_dataset(path: str | Path) -> list[dict]:
    """Rows of a `save_to_disk` directory (`datasets.load_from_disk`); of a DatasetDict, its `train` split or its only
    split. Image columns come back as PIL images."""
    path = Path(path)
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a directory saved with Hugging Face datasets' save_to_disk; reading it needs the "
                        f"datasets package: pip install 'mmrl[datasets]'") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        splits = sorted(data)
        if "train" not in data and len(splits) != 1:
            raise DataError(f"{path}: a DatasetDict with splits {splits} and no 'train' split; save the split to use "
                            f"(e.g. ds['{splits[0]}'].save_to_disk(...))")
        data = data["train" if "train" in data else splits[0]]
    return [dict(row) for row in data]


def read_records(path: str | Path) -> list[dict]:
    """Rows of a .jsonl / .json (list) / .parquet file, or of a directory saved with datasets' `save_to_disk`, as
    dicts."""
    path = Path(path)
    if is_saved_dataset(path):
        return read_saved_dataset(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path} (relative paths are taken from the current directory, {Path.cwd()})")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as exc:  # not parquet, truncated, ...
            raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    if suffix == ".json":
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        return data
    if suffix == ".jsonl":
        rows = []
        for i, line in enumerate(read_text(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{i}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
        return rows
    raise DataError(f"{path}: unsupported data file type '{suffix}' (use .jsonl, .json or .parquet)")


def _require(row: dict, key: str, path: Any, i: int) -> Any:
    if key not in row or row[key] is None:
        raise DataError(f"{path}: row {i} has no '{key}' (keys: {sorted(row)})")
    return row[key]


def _require_text(row: dict, key: str, path: Any, i: int) -> str:
    """`row[key]` that must be text (a prompt): a number or a list is refused, not trained on as its string form."""
    value = _require(row, key, path, i)
    if not isinstance(value, str):
        raise DataError(f"{path}: row {i}: '{key}' is {type(value).__name__} {value!r:.60}, expected a string (the "
                        f"prompt text); quote it in the file")
    return value


# ------------------------------------------------------------------------------------------ prompts


@dataclass
class PromptItem:
    prompt: str
    metadata: dict = field(default_factory=dict)


def load_prompts(path: str | Path, image_root: str | Path | None = None) -> list[PromptItem]:
    """A .txt file (one prompt per line, blank lines and `#` comments skipped) or .jsonl/.json/.parquet (or a
    `save_to_disk` directory) with a `prompt` key (other keys become metadata, e.g. the OCR target text).

    Edit rows (`mmrl.pipelines.edits`): a `source_image` (and optional `mask`) makes a row an edit of that image;
    `instruction` may stand for `prompt`; image paths are taken relative to `image_root` (default: the file's
    folder) and a row whose image is missing or unreadable is skipped with a warning naming the file."""
    from mmrl.pipelines.edits import is_edit_row, resolve_edit_row

    path = Path(path)
    if not path.is_file() and not is_saved_dataset(path):
        raise FileNotFoundError(f"prompt file not found: {path} (relative paths are taken from the current directory, {Path.cwd()})")
    if path.suffix.lower() == ".txt":
        items = [PromptItem(line.strip()) for line in read_text(path).splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
    else:
        items = []
        root = Path(image_root) if image_root else path.parent
        for i, row in enumerate(read_records(path)):
            if is_edit_row(row):
                row = resolve_edit_row(row, root, path, i)
                if row is None:
                    continue
            key = "instruction" if "prompt" not in row and "instruction" in row else "prompt"
            prompt = _require_text(row, key, path, i)
            meta = {k: v for k, v in row.items() if k != key}
            items.append(PromptItem(prompt, meta))
    if not items:
        raise DataError(f"prompt file {path} contains no prompts")
    return items


class PromptSampler:
    """Endless, seeded, epoch-shuffled stream of prompts with a resumable position.

    `state_dict()` stores (epoch, index); a resumed sampler yields exactly what the original would have.
    """

    def __init__(self, items: Sequence[PromptItem], seed: int = 0, shuffle: bool = True):
        if not items:
            raise DataError("PromptSampler needs at least one prompt")
        self.items = list(items)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[PromptItem]:
        out = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._make_order()
            out.append(self.items[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = self._make_order()


# ------------------------------------------------------------------------------------------ preference pairs


@dataclass
class PreferencePair:
    prompt: str
    chosen: Any  # image path / PIL / bytes
    rejected: Any
    metadata: dict = field(default_factory=dict)


def load_preference_pairs(path: str | Path, image_root: str | Path | None = None,
                          min_score_gap: float = 0.0) -> list[PreferencePair]:
    """Preference data in one of two layouts:

    - pairs: rows with `prompt`, `chosen`, `rejected` (image paths relative to `image_root` or the
      file's folder; Pick-a-Pic style `label_0` = 1 means image 0 preferred when using `image_0/image_1`);
    - scored: rows with `prompt`, `image`, `score`: for every prompt the best and worst image form a pair
      when their scores differ by more than `min_score_gap`.
    """
    path = Path(path)
    rows = read_records(path)
    root = Path(image_root) if image_root else path.parent

    def resolve(v: Any) -> Any:
        if isinstance(v, str) and not v.startswith("data:"):
            p = Path(v)
            return p if p.is_absolute() else root / p
        if isinstance(v, dict) and "bytes" in v:  # parquet image struct
            return v["bytes"]
        return v

    pairs: list[PreferencePair] = []
    if rows and "chosen" in rows[0]:
        for i, row in enumerate(rows):
            pairs.append(PreferencePair(_require_text(row, "prompt", path, i),
                                        resolve(_require(row, "chosen", path, i)),
                                        resolve(_require(row, "rejected", path, i)),
                                        {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}))
    elif rows and "image_0" in rows[0]:
        for i, row in enumerate(rows):
            label = float(_require(row, "label_0", path, i))
            if label == 0.5:  # ties carry no preference
                continue
            a, b = resolve(_require(row, "image_0", path, i)), resolve(_require(row, "image_1", path, i))
            w, l = (a, b) if label > 0.5 else (b, a)
            pairs.append(PreferencePair(_require_text(row, "prompt", path, i), w, l))
    elif rows and "score" in rows[0]:
        by_prompt: dict[str, list[tuple[float, Any]]] = {}
        for i, row in enumerate(rows):
            by_prompt.setdefault(_require_text(row, "prompt", path, i), []).append(
                (float(_require(row, "score", path, i)), resolve(_require(row, "image", path, i))))
        for prompt, scored in by_prompt.items():
            scored.sort(key=lambda s: s[0])
            if len(scored) >= 2 and scored[-1][0] - scored[0][0] > min_score_gap:
                pairs.append(PreferencePair(prompt, scored[-1][1], scored[0][1],
                                            {"score_chosen": scored[-1][0], "score_rejected": scored[0][0]}))
    elif rows:
        raise DataError(f"{path}: rows need either prompt/chosen/rejected, prompt/image_0/image_1/label_0 or "
                        f"prompt/image/score keys; got {sorted(rows[0])}")
    if not pairs:
        raise DataError(f"{path}: no preference pairs could be built")
    return pairs


# ------------------------------------------------------------------------------------------ visual QA


@dataclass
class VQAItem:
    prompt: str          # user text with one `<image>` placeholder per image
    images: list         # PIL images (already loaded and RGB)
    answer: str
    metadata: dict = field(default_factory=dict)


def load_visual_qa(path: str | Path, image_root: str | Path | None = None, template: str | None = GEO3K_TEMPLATE,
                   problem_key: str | None = None, answer_key: str = "answer", images_key: str | None = None,
                   on_error: str = "skip", limit: int | None = None) -> list[VQAItem]:
    """Visual QA rows: `prompt` (the question text with `<image>` placeholders, one is prepended per image when there
    are none; `problem`, geometry3k's name, is read when a row has no `prompt`), `images` (a list of paths /
    {"bytes":..} / base64 / PIL images; `image`, TRL's name, for one image or a list), `answer`. `template` formats
    the text (`{prompt}` or `{problem}`); `problem_key` / `images_key` name other columns.

    `on_error="skip"` drops a row whose image cannot be read and warns with its path; `"raise"` fails.
    """
    from mmrl.pipelines.images import ImageLoadError, load_image

    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    path = Path(path)
    root = Path(image_root) if image_root else path.parent
    items: list[VQAItem] = []
    for i, row in enumerate(read_records(path)):
        if limit is not None and len(items) >= limit:
            break
        text_key = problem_key or ("problem" if "prompt" not in row and "problem" in row else "prompt")
        problem = str(_require(row, text_key, path, i))
        answer = str(_require(row, answer_key, path, i))
        image_key = images_key or ("image" if "images" not in row and "image" in row else "images")
        raw = row.get(image_key) or []
        if not isinstance(raw, list):
            raw = [raw]
        try:
            images = []
            for im in raw:
                if isinstance(im, dict):
                    im = im.get("bytes") or im.get("path")
                images.append(load_image(_resolve_image_ref(im, root)))
        except ImageLoadError as exc:
            if on_error == "raise":
                raise DataError(f"{path}: row {i}: {exc}") from None
            warnings.warn(f"{path}: row {i} skipped: {exc}", stacklevel=2)
            continue
        n_ph = problem.count("<image>")
        if n_ph == 0 and images:
            problem = "<image>" * len(images) + problem
        elif n_ph != len(images):
            msg = f"{path}: row {i} has {n_ph} <image> placeholders but {len(images)} images"
            if on_error == "raise":
                raise DataError(msg)
            warnings.warn(msg + "; skipped", stacklevel=2)
            continue
        text = template.format(problem=problem, prompt=problem) if template else problem
        meta = {k: v for k, v in row.items() if k != image_key}
        meta["answer"] = answer
        items.append(VQAItem(text, images, answer, meta))
    if not items:
        raise DataError(f"{path}: no usable rows")
    return items


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _resolve_image_ref(im: Any, root: Path) -> Any:
    """A relative image path is taken relative to `root`; base64 strings and bytes pass through."""
    if not isinstance(im, str) or im.startswith("data:") or len(im) > 4096 or Path(im).is_absolute():
        return im
    candidate = root / im
    if candidate.exists() or im.lower().endswith(_IMAGE_SUFFIXES):
        return str(candidate)  # a missing file is then reported with its full path
    return im
