"""What `mmrl reward score` reads and writes: image files and directories, prompt files (.txt, or .jsonl with
`prompt`, `metadata`, `completion`), and the rows of scores, written as each chunk is scored (CSV or JSON lines),
unreadable or oversized images skipped with a warning or stopping the run (`--on-error`)."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from mmrl.pipelines.data import read_text

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class CLIError(Exception):
    """A user error: printed without a traceback, exit code 2."""


def fail(msg: str) -> "None":
    raise CLIError(msg)


def collect_images(items: Sequence[str]) -> list[Path]:
    """Files as given; directories expanded to their image files (sorted, non-recursive)."""
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() in IMAGE_EXTENSIONS)
            if not found:
                fail(f"no images ({', '.join(IMAGE_EXTENSIONS)}) in directory {item!r}")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            fail(f"image file or directory not found: {item!r}")
    return out


def read_prompts(path: str) -> tuple[list[str], list[dict] | None, list[str] | None]:
    """(prompts, metadata or None, completions or None) from a .txt or .jsonl file."""
    p = Path(path)
    if not p.is_file():
        fail(f"prompts file not found: {path!r}")
    lines = read_text(p).splitlines()  # UTF-8, binary files named, a byte-order mark dropped
    if p.suffix.lower() != ".jsonl":
        return [ln for ln in lines if ln.strip()], None, None
    prompts, metadata, completions = [], [], []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except ValueError as exc:
            fail(f"{path}:{i}: invalid JSON ({exc})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt", ""), str):
            fail(f"{path}:{i}: expected an object with a string 'prompt'")
        prompts.append(row.get("prompt", ""))
        meta = row.get("metadata")
        if meta is None:
            meta = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
        if not isinstance(meta, dict):
            fail(f"{path}:{i}: 'metadata' must be an object")
        metadata.append(meta)
        completions.append(row.get("completion"))
    has_completions = any(c is not None for c in completions)
    if has_completions and any(c is None for c in completions):
        fail(f"{path}: either every row or no row has a 'completion'")
    return prompts, metadata, (completions if has_completions else None)


def per_sample_columns(details: dict, n: int) -> dict[str, list]:
    """Detail entries with one value per sample (length-n tensors / lists), as CSV-friendly lists."""
    cols: dict[str, list] = {}
    for k, v in details.items():
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == n:
            cols[k] = v.detach().float().cpu().tolist()
        elif isinstance(v, (list, tuple)) and len(v) == n:
            cols[k] = [x if isinstance(x, (str, int, float)) or x is None else json.dumps(x, default=str) for x in v]
    return cols


def resolve_out_path(out: str) -> Path:
    """--out as a file path: an existing directory (or a path ending in a separator) -> DIR/scores.csv; the
    parent directories are created. CLIError if the path cannot be a file."""
    p = Path(out)
    if p.is_dir() or out.endswith(("/", "\\")):
        p = p / "scores.csv"
        if p.is_dir():
            fail(f"--out {out!r} is a directory and {str(p)!r} is a directory too; pass a file path")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                fail(f"--out {out!r}: {str(parent)!r} is a file, not a directory")
            break
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--out {out!r}: cannot create directory {str(p.parent)!r}: {exc.strerror or exc}")
    return p


class _RowWriter:
    """CSV (header from the first rows written) or JSONL rows, flushed after every write."""

    def __init__(self, f, fmt: str):
        self.f, self.fmt = f, fmt
        self.header: list[str] | None = None
        self.writer: csv.DictWriter | None = None
        self.count = 0

    def write(self, rows: list[dict], detail_keys: list[str]) -> None:
        if not rows:  # e.g. a chunk of unreadable images: the CSV header waits for rows with their details
            return
        if self.fmt == "jsonl":
            for r in rows:
                self.f.write(json.dumps({k: _json_value(v) for k, v in r.items()}, allow_nan=False) + "\n")
        else:
            if self.writer is None:
                fixed = ("path", "prompt", "score")
                self.header = [*fixed, *[k for k in detail_keys if k not in fixed]]
                self.writer = csv.DictWriter(self.f, fieldnames=self.header, extrasaction="ignore")
                self.writer.writeheader()
            for r in rows:
                self.writer.writerow({k: r.get(k, "") for k in self.header})
        self.count += len(rows)
        self.f.flush()


def _json_value(v: Any) -> Any:
    """Non-finite floats -> null so every JSONL line is strict JSON."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _load_image_file(path: Path, max_pixels: int | None = None) -> torch.Tensor:
    """The image as a float CHW tensor; ValueError, before any pixel is decoded, when its header declares more
    than `max_pixels` pixels (the server's `--max-pixels` check)."""
    from PIL import Image

    from mmrl.pipelines.images import load_image
    from mmrl.rewards.base import to_image_list

    if max_pixels is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is judged here
                with Image.open(path) as im:  # reads the header only
                    w, h = im.size
        except Exception:  # noqa: BLE001 - not an image, a bomb, ...: load_image names the problem below
            w = h = 0
        if w * h > max_pixels:
            raise ValueError(f"{w}x{h} = {w * h} pixels, more than --max-pixels={max_pixels} (not decoded)")
    return to_image_list([load_image(path)])[0]


def score_to(f, fmt: str, args: argparse.Namespace, reward, paths, prompts, metadata, completions,
              out_path: Path | None = None) -> int:
    """Score chunk by chunk, writing each chunk's rows (in input order) as soon as they are scored."""
    from tqdm import tqdm

    n = len(paths) if paths is not None else len(completions)
    writer = _RowWriter(f, fmt)
    skipped: list[str] = []
    said: list[str] = []  # the reward's warnings (e.g. ocr: a prompt without quoted text scores NaN)
    total, nonfinite = 0.0, 0
    where = f" -> {out_path}" if out_path is not None else ""
    bar = tqdm(total=n, desc=f"reward {args.reward}", unit="sample", file=sys.stderr,
               disable=args.no_progress or os.environ.get("MMRL_NO_PROGRESS") == "1")
    try:
        for start in range(0, n, args.batch_size):
            idx = list(range(start, min(n, start + args.batch_size)))
            chunk_len = len(idx)
            images: dict[int, torch.Tensor] = {}
            stop: str | None = None  # --on-error raise: the error, raised once the images before it are written
            if paths is not None:
                for i in idx:
                    try:
                        images[i] = _load_image_file(paths[i], args.max_pixels)
                    except Exception as exc:  # noqa: BLE001 - any unreadable file (truncated, bomb, bad mode)
                        reason = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
                        reason = reason.replace(f"cannot read image file {str(paths[i])!r}: ", "")  # named once
                        if args.on_error == "raise":
                            stop = f"cannot read image {str(paths[i])!r}: {reason}"
                            break
                        bar.clear()
                        print(f"mmrl reward: warning: skipping {paths[i]}: {reason}", file=sys.stderr)
                        skipped.append(str(paths[i]))
                idx = [i for i in idx if i in images]
            # rewards take one image size per call: score each size group of the chunk separately
            groups: dict[tuple, list[int]] = {}
            for i in idx:
                groups.setdefault(tuple(images[i].shape) if paths is not None else (), []).append(i)
            rows: list[dict[str, Any]] = []
            detail_keys: list[str] = []
            for sel in groups.values():
                with warnings.catch_warnings(record=True) as caught:  # said in one line each, at the end
                    warnings.simplefilter("always")
                    out = reward(images=None if paths is None else torch.stack([images[i] for i in sel]),
                                 prompts=None if prompts is None else [prompts[i] for i in sel],
                                 metadata=None if metadata is None else [metadata[i] for i in sel],
                                 completions=None if completions is None else [completions[i] for i in sel])
                said += [m for m in (str(w.message).splitlines()[0] for w in caught) if m not in said]
                cols = per_sample_columns(out.details, len(sel))
                scores = out.scores.detach().float().cpu().tolist()
                detail_keys += [k for k in cols if k not in detail_keys]
                for r, i in enumerate(sel):
                    rows.append({"_i": i, "path": "" if paths is None else str(paths[i]),
                                 "prompt": "" if prompts is None else prompts[i],
                                 "score": scores[r], **{k: v[r] for k, v in cols.items()}})
            rows.sort(key=lambda r: r.pop("_i"))
            writer.write(rows, detail_keys)
            total += sum(r["score"] for r in rows if math.isfinite(r["score"]))
            nonfinite += sum(not math.isfinite(r["score"]) for r in rows)
            if stop is not None:
                fail(f"{stop} (--on-error raise; the {writer.count} row(s) before it were written{where})")
            bar.update(chunk_len)
    except KeyboardInterrupt:
        bar.close()
        print(f"mmrl reward: interrupted; {writer.count} scored row(s) kept{where}", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        bar.close()
    note = f"; skipped {len(skipped)} unreadable image(s)" if skipped else ""
    if writer.count == 0:
        fail(f"none of the {n} image(s) could be read{note}")
    mean = f"mean {total / (writer.count - nonfinite):.6g}" if writer.count > nonfinite else "mean nan"
    if nonfinite:  # why, in the same line: the reward's first warning (else: it returned NaN without saying why)
        mean += (f" over the {writer.count - nonfinite} finite scores" if writer.count > nonfinite else "") + \
            f"; {nonfinite} of {writer.count} scores are NaN ({said.pop(0) if said else 'the reward gave no reason'})"
    for message in said:  # other warnings of the reward: one line each, not Python's file:line form
        print(f"mmrl reward: warning: {message}", file=sys.stderr)
    print(f"scored {writer.count} samples with {args.reward}: {mean}{where}{note}", file=sys.stderr)
    return 0
