"""Edit data: jsonl and parquet rows (source image path / bytes, instruction, optional mask), rows with a missing or
unreadable image skipped with a warning naming the file, sources and masks as tensors, the synthetic shapes task."""

import io
import json
import re
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.pipelines.data import DataError, load_prompts
from mmrl.pipelines.edits import load_masks, load_sources, make_shapes_edit_file, shapes_edit_example
from mmrl.pipelines.shapes import COLORS

REPO = Path(__file__).resolve().parents[2]


def test_shapes_edit_example_recolours_only_the_shape():
    ex = shapes_edit_example(random.Random(0), 64)
    meta = ex["metadata"]
    assert ex["instruction"] == f"make the {meta['kind']} {meta['target_color']}"
    assert meta["target_color"] not in (meta["source_color"], meta["background"])
    src, tgt = (torch.from_numpy(np.asarray(ex[k], dtype=np.float32) / 255).permute(2, 0, 1) for k in ("source", "target"))
    mask = torch.from_numpy(np.asarray(ex["mask"].convert("L")) > 127)
    assert torch.equal(src[:, ~mask], tgt[:, ~mask])  # outside the mask: identical
    for img, color in ((tgt, meta["target_color"]), (src, meta["source_color"])):  # inside: the shape's colour
        ref = torch.tensor(COLORS[color], dtype=torch.float32)[:, None] / 255
        assert mask.any() and torch.equal(img[:, mask], ref.expand(3, int(mask.sum())))
    assert meta["source_caption"].startswith(f"a {meta['source_color']} {meta['kind']}") or \
        meta["source_caption"].startswith(f"an {meta['source_color']} {meta['kind']}")


def test_jsonl_rows_load_with_sources_and_masks(tmp_path):
    path = make_shapes_edit_file(tmp_path, n=3, seed=2)
    items = load_prompts(path)
    assert len(items) == 3 and items[0].prompt.startswith("make the ")
    src = items[0].metadata["source_image"]
    assert Path(src).is_absolute() or Path(src).is_file()  # resolved against the file's folder
    x = load_sources(items, 32, 32)
    assert x.shape == (3, 3, 32, 32) and 0 <= x.min() and x.max() <= 1
    m = load_masks([it.metadata for it in items], 64, 64)
    assert m.shape == (3, 1, 64, 64) and set(m.unique().tolist()) <= {0.0, 1.0} and 0 < m.mean() < 0.5
    assert load_masks([{}], 8, 8) is None


def test_parquet_rows_with_image_bytes_and_instruction_key(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ex = shapes_edit_example(random.Random(3), 64)
    buf = io.BytesIO()
    ex["source"].save(buf, format="PNG")
    table = pa.table({"instruction": [ex["instruction"]],
                      "source_image": [{"bytes": buf.getvalue(), "path": "x.png"}],
                      "target_color": [ex["metadata"]["target_color"]]})
    pq.write_table(table, tmp_path / "edits.parquet")
    items = load_prompts(tmp_path / "edits.parquet")
    assert items[0].prompt == ex["instruction"] and isinstance(items[0].metadata["source_image"], bytes)
    x = load_sources(items, 64, 64)
    ref = torch.from_numpy(np.asarray(ex["source"], dtype=np.float32) / 255).permute(2, 0, 1)
    assert torch.equal(x[0], ref)


def test_missing_or_broken_source_is_skipped_with_a_warning_naming_it(tmp_path):
    make_shapes_edit_file(tmp_path, n=2, seed=0)
    rows = [json.loads(x) for x in (tmp_path / "edits.jsonl").read_text().splitlines()]
    rows.append({**rows[0], "source_image": "images/missing.png"})
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")
    rows.append({**rows[0], "mask": "images/broken.png"})
    (tmp_path / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning) as record:
        items = load_prompts(tmp_path / "more.jsonl")
    messages = [str(w.message) for w in record]
    assert any("row 2 skipped: source_image file not found" in m and "missing.png" in m for m in messages)
    assert any("row 3 skipped: mask not an image" in m and "broken.png" in m for m in messages)
    assert len(items) == 2
    (tmp_path / "none.jsonl").write_text(json.dumps({**rows[0], "source_image": "nope.png"}) + "\n")
    with pytest.warns(UserWarning, match="nope.png"), pytest.raises(DataError, match="contains no prompts"):
        load_prompts(tmp_path / "none.jsonl")


def test_a_truncated_source_is_skipped_and_a_mask_of_another_size_refused_naming_them(tmp_path):
    """A truncated source PNG (half its bytes) and a 17x23 mask on a 64x64 source passed the start-up read without a
    word: the first failed at the step that drew the row, the second was stretched onto the source."""
    make_shapes_edit_file(tmp_path, n=2, seed=0)
    rows = [json.loads(x) for x in (tmp_path / "edits.jsonl").read_text().splitlines()]
    whole = (tmp_path / rows[0]["source_image"]).read_bytes()
    (tmp_path / "images" / "cut.png").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "cut.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                [rows[0], {**rows[1], "source_image": "images/cut.png"}]))
    with pytest.warns(UserWarning, match=re.escape(f"cut.jsonl: row 1 skipped: source_image a truncated or corrupt "
                                                   f"image: {tmp_path / 'images' / 'cut.png'} (OSError: ")):
        assert len(load_prompts(tmp_path / "cut.jsonl")) == 1
    Image.new("L", (17, 23), 255).save(tmp_path / "images" / "small_mask.png")
    (tmp_path / "masks.jsonl").write_text(json.dumps({**rows[0], "mask": "images/small_mask.png"}) + "\n")
    with pytest.raises(ValueError, match=re.escape("masks.jsonl: row 0: mask is 17x23 (width x height) but "
                                                  "source_image is 64x64; a mask marks pixels of its source, so it "
                                                  "must have the source's size")):
        load_prompts(tmp_path / "masks.jsonl")


def test_module_cli_writes_the_synthetic_task(tmp_path):
    """`python -m mmrl.pipelines.edits OUT N` (docs/editing.md)."""
    proc = subprocess.run([sys.executable, "-m", "mmrl.pipelines.edits", str(tmp_path / "task"), "4"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "task" / "edits.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["target_color"] in COLORS for r in rows)
    assert all((tmp_path / "task" / r["mask"]).is_file() for r in rows)
