import json
import re

import pytest
from PIL import Image

from mmrl.pipelines.data import (
    DataError, PromptSampler, load_preference_pairs, load_prompts, load_visual_qa, read_records, require_path,
)


def test_prompts_txt_and_jsonl(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("a red circle\n\n# comment\na blue square\n")
    assert [i.prompt for i in load_prompts(p)] == ["a red circle", "a blue square"]
    j = tmp_path / "p.jsonl"
    j.write_text(json.dumps({"prompt": 'a sign that says "HI"', "text": "HI"}) + "\n")
    item = load_prompts(j)[0]
    assert item.metadata == {"text": "HI"}
    j.write_text('{"prompt": "x"}\n{"text": 1}\n')
    with pytest.raises(DataError, match=r"row 1 has no 'prompt'"):
        load_prompts(j)
    j.write_text('{"prompt": "x"}\n{oops\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: invalid JSON"):
        load_prompts(j)
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "none.txt")
    (tmp_path / "e.txt").write_text("\n")
    with pytest.raises(DataError, match="contains no prompts"):
        load_prompts(tmp_path / "e.txt")


@pytest.mark.parametrize("name, text", [("p.txt", "a red circle\nb\n"), ("p.jsonl", '{"prompt": "a red circle"}\n'),
                                        ("p.json", '[{"prompt": "a red circle"}]')])
def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, name, text):
    """Files saved by Windows editors start with U+FEFF: it stayed in the first prompt of a .txt (and a .jsonl or
    .json failed to parse)."""
    (tmp_path / name).write_text(text, encoding="utf-8-sig")
    assert (tmp_path / name).read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_prompts(tmp_path / name)[0].prompt == "a red circle"


@pytest.mark.parametrize("value, shown", [(7, "int 7"), (["a", "b"], "list ['a', 'b']"), ({"x": 1}, "dict {'x': 1}")])
def test_a_prompt_that_is_not_text_is_refused_naming_the_file_and_row(tmp_path, value, shown):
    """A number or a list in the prompt column was trained on as its string form ('7', "['a', 'b']")."""
    j = tmp_path / "p.jsonl"
    j.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": value}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"p.jsonl: row 1: 'prompt' is {shown}, expected a string (the "
                                                  f"prompt text); quote it in the file")):
        load_prompts(j)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": value, "chosen": "a.png", "rejected": "b.png"}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"pairs.jsonl: row 0: 'prompt' is {shown}")):
        load_preference_pairs(pairs)


def test_a_saved_dataset_with_int_prompts_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": [3, 4]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DataError, match=re.escape("ds: row 0: 'prompt' is int 3, expected a string")):
        load_prompts(tmp_path / "ds")


def test_prompt_sampler_resume_is_exact():
    items = load_prompts_list(7)
    a = PromptSampler(items, seed=3)
    first = [x.prompt for x in a.next(10)]
    state = a.state_dict()
    rest = [x.prompt for x in a.next(12)]
    b = PromptSampler(items, seed=3)
    b.load_state_dict(state)
    assert [x.prompt for x in b.next(12)] == rest
    # each epoch is a permutation of all prompts
    c = PromptSampler(items, seed=3)
    assert sorted(x.prompt for x in c.next(7)) == sorted(x.prompt for x in items)
    other = PromptSampler(items, seed=4)
    assert [x.prompt for x in other.next(7)] != first[:7]  # the order depends on the seed


def load_prompts_list(n):
    from mmrl.pipelines.data import PromptItem

    return [PromptItem(f"p{i}") for i in range(n)]


def test_preference_layouts(tmp_path):
    for name in ("a.png", "b.png", "c.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps({"prompt": "x", "chosen": "a.png", "rejected": "b.png"}) + "\n")
    pair = load_preference_pairs(f)[0]
    assert pair.chosen == tmp_path / "a.png" and pair.rejected == tmp_path / "b.png"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "x", "image": "a.png", "score": 0.1}, {"prompt": "x", "image": "b.png", "score": 0.9},
        {"prompt": "x", "image": "c.png", "score": 0.5}, {"prompt": "y", "image": "a.png", "score": 0.3}]))
    pairs = load_preference_pairs(f)
    assert len(pairs) == 1 and pairs[0].chosen.name == "b.png" and pairs[0].rejected.name == "a.png"
    f.write_text(json.dumps({"prompt": "x", "image_0": "a.png", "image_1": "b.png", "label_0": 0.0}) + "\n")
    pair = load_preference_pairs(f)[0]
    assert pair.chosen.name == "b.png"
    f.write_text(json.dumps({"prompt": "x", "img": "a.png"}) + "\n")
    with pytest.raises(DataError, match="rows need either"):
        load_preference_pairs(f)


def test_visual_qa_geo3k_layout_and_corrupt_images(tmp_path):
    Image.new("RGB", (28, 28), "red").save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    rows = [
        {"images": ["ok.png"], "problem": "<image>What colour?", "answer": "red"},
        {"images": ["bad.png"], "problem": "<image>What colour?", "answer": "blue"},
        {"images": ["ok.png"], "problem": "No placeholder here", "answer": "red"},
    ]
    f = tmp_path / "qa.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="bad.png"):
        items = load_visual_qa(f, template=None)
    assert len(items) == 2 and items[0].images[0].size == (28, 28) and items[0].metadata["answer"] == "red"
    assert items[1].prompt.startswith("<image>No placeholder")
    with pytest.raises(DataError, match=r"row 1.*bad.png"):
        load_visual_qa(f, on_error="raise")
    geo = load_visual_qa(f, on_error="skip", limit=1)
    assert "\\boxed{}" in geo[0].prompt and "<think>" in geo[0].prompt


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "text": ["A", "B"]}), tmp_path / "p.parquet")
    assert read_records(tmp_path / "p.parquet") == [{"prompt": "a", "text": "A"}, {"prompt": "b", "text": "B"}]
    assert load_prompts(tmp_path / "p.parquet")[1].metadata == {"text": "B"}


def test_binary_or_broken_files_are_errors_naming_the_file(tmp_path):
    png = tmp_path / "prompts.txt"  # an image saved under a prompt-file name: 0x89 is not UTF-8
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    with pytest.raises(DataError, match=r"prompts\.txt: not a UTF-8 text file \(byte 0x89 at offset 0"):
        load_prompts(png)
    nul = tmp_path / "nul.jsonl"
    nul.write_bytes(b'{"prompt": "a"}\n\x00\x00\x00\n')
    with pytest.raises(DataError, match=r"nul\.jsonl: a binary file \(it contains NUL bytes\)"):
        load_prompts(nul)
    bad_json = tmp_path / "rows.json"
    bad_json.write_text('[{"prompt": "a"},\n oops]')
    with pytest.raises(DataError, match=r"rows\.json: invalid JSON at line 2"):
        read_records(bad_json)
    bad_parquet = tmp_path / "rows.parquet"
    bad_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"rows\.parquet: not a readable parquet file"):
        read_records(bad_parquet)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not a UTF-8 text file \(byte 0xe9 at offset 3"):
        load_prompts(latin1)


def test_require_path_names_the_key(tmp_path):
    (tmp_path / "p.txt").write_text("a\n")
    require_path("data.train_prompts", tmp_path / "p.txt")
    require_path("data.image_root", tmp_path, "image folder", kind="dir")
    with pytest.raises(FileNotFoundError, match=r"data.eval_prompts: prompt file not found: .*nope\.txt \(relative"):
        require_path("data.eval_prompts", tmp_path / "nope.txt", "prompt file")
    with pytest.raises(FileNotFoundError, match=r"data.train_prompts: file .* is not a file"):
        require_path("data.train_prompts", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"data.image_root: image folder .*p\.txt is not a folder"):
        require_path("data.image_root", tmp_path / "p.txt", "image folder", kind="dir")
