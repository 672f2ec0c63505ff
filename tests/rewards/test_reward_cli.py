"""`mmrl reward list|score|serve`: through an argparse parser built here and through `python -m mmrl.cli`."""

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.rewards import load
from mmrl.rewards.base import jpeg_size_kb, to_image_tensor
from mmrl.rewards.cli import add_reward_subparsers, parse_kw
from mmrl.testing import png_claiming_size

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "NO_PROXY": "127.0.0.1,localhost"}


def run(argv):
    parser = argparse.ArgumentParser(prog="mmrl")
    add_reward_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def image_dir(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    for i, amount in enumerate([0.0, 0.5, 1.0]):
        arr = (128 * (1 - amount) + torch.randint(0, 256, (16, 16, 3), generator=g) * amount).round().byte().numpy()
        Image.fromarray(arr).save(d / f"img_{i}.png")
    (d / "notes.txt").write_text("not an image")
    return d


def read_csv(p):
    with open(p, newline="") as f:
        return list(csv.DictReader(f))


def test_list_prints_names_with_descriptions(capsys):
    assert run(["reward", "list"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    for name in ["jpeg_compressibility", "geo3k", "math_accuracy", "remote", "vlm_judge", "composite", "iou"]:
        assert name in lines
    assert "Reward = -JPEG size in kB" in lines["jpeg_compressibility"]
    assert "0.9 * math accuracy" in lines["geo3k"]
    # what each scores (they showed a parameter's note, or the edit module's one line for all three)
    assert lines["ocr"].endswith("Text rendering: the image's OCR text (RapidOCR) against the prompt's quoted text, "
                                 "1 - edit distance / length.")
    assert lines["edit_preservation"].endswith("Preservation: the edited image's similarity to its source outside "
                                               "the edit mask (1 = unchanged).")
    assert lines["clip_direction"].endswith("Edit direction: CLIP cosine of (edited - source) image change with the "
                                            "(target - source) caption change.")
    assert lines["edit_region_color"].endswith("Edit following: the share of the mask's pixels in the target colour "
                                               "(synthetic shapes edits).")
    assert lines["vlm_edit_judge"].endswith("'Final Score: x' (1-5) -> x/5.")


def test_score_directory_with_prompts_matches_local(image_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a grey square\n\nnoisy, a bit\npure noise\n")  # blank lines are skipped
    out = tmp_path / "out" / "scores.csv"
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir),
                "--prompts", str(prompts), "--out", str(out), "--batch-size", "2", "--device", "cpu",
                "--no-progress"]) == 0
    rows = read_csv(out)
    assert list(rows[0]) == ["path", "prompt", "score", "jpeg_kb"]
    paths = sorted(image_dir.glob("*.png"))
    assert [r["path"] for r in rows] == [str(p) for p in paths]
    assert [r["prompt"] for r in rows] == ["a grey square", "noisy, a bit", "pure noise"]
    local = load("jpeg_compressibility")(to_image_tensor([str(p) for p in paths])).scores
    assert [float(r["score"]) for r in rows] == local.tolist()
    assert "scored 3 samples" in capsys.readouterr().err


def test_score_files_of_mixed_sizes_kw_and_stdout(image_dir, capsys):
    small = image_dir / "small.png"
    Image.new("RGB", (8, 8), (10, 200, 30)).save(small)
    files = [str(image_dir / "img_2.png"), str(small), str(image_dir / "img_0.png")]
    assert run(["reward", "score", "jpeg_incompressibility", "--kw", "quality=50",
                "--images", *files, "--no-progress"]) == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert [r["path"] for r in rows] == files  # order kept although sizes were scored in separate calls
    want = [jpeg_size_kb(to_image_tensor(f), 50).item() for f in files]
    assert [float(r["score"]) for r in rows] == want


def test_score_yaml_composite_has_component_columns(image_dir, tmp_path):
    spec = tmp_path / "mix.yaml"
    spec.write_text("jpeg_compressibility: 1.0\njpeg_incompressibility:\n  weight: 2.0\n")
    out = tmp_path / "s.csv"
    assert run(["reward", "score", str(spec), "--images", str(image_dir), "--out", str(out),
                "--no-progress"]) == 0
    rows = read_csv(out)
    assert {"jpeg_compressibility", "jpeg_incompressibility", "jpeg_compressibility/jpeg_kb"} <= set(rows[0])
    for r in rows:  # -kb + 2 kb = kb
        assert float(r["score"]) == pytest.approx(float(r["jpeg_incompressibility"]), rel=1e-6)


def test_score_text_reward_from_jsonl(tmp_path):
    data = tmp_path / "qa.jsonl"
    rows = [{"prompt": "1+1?", "completion": "<think>easy</think> \\boxed{2}", "answer": "2"},
            {"prompt": "half?", "completion": "\\boxed{0.5}", "metadata": {"answer": "\\frac{1}{2}"}},
            {"prompt": "3*3?", "completion": "<think>x</think> \\boxed{6}", "answer": "9"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "t.csv"
    assert run(["reward", "score", "geo3k", "--prompts", str(data), "--out", str(out), "--no-progress"]) == 0
    got = read_csv(out)
    assert [float(r["score"]) for r in got] == pytest.approx([1.0, 0.9, 0.1])
    assert [r["accuracy/extracted"] for r in got] == ["2", "0.5", "6"]


@pytest.mark.parametrize("argv,msg", [
    (["jpeg_compressibility", "--images", "/no/such/dir"], "not found: '/no/such/dir'"),
    (["no_such_reward", "--images", "{img}"], "unknown reward 'no_such_reward'"),
    (["jpeg_compressibility", "--images", "{img}", "--prompts", "{prompts}"], "3 images but 2 prompts"),
    (["jpeg_compressibility", "--images", "{img}", "--kw", "oops"], "KEY=VALUE"),
    (["jpeg_compressibility", "--images", "{img}", "--weights", "/no/weights"], "--weights path not found"),
    (["/tmp/definitely_missing_mmrl.yaml", "--images", "{img}"], "reward YAML not found"),
    (["geo3k", "--images", "{img}"], "scores text"),
    (["jpeg_compressibility"], "pass --images"),
    (["jpeg_compressibility", "--images", "{img}", "--device", "tpu"], "unknown device 'tpu'"),
    (["{bad_yaml}", "--images", "{img}"], "is not valid YAML"),
    (["jpeg_incompressibility", "--images", "{img}", "--kw", "quality=abc"],  # was: int() of 'abc', key unnamed
     "mmrl reward: error: --kw quality: reward 'jpeg_incompressibility' takes an integer for 'quality' (default 95), "
     "got 'abc'\n"),
    (["jpeg_incompressibility", "--images", "{img}", "--kw", "qualty=5"],
     "mmrl reward: error: --kw qualty: reward 'jpeg_incompressibility' has no argument 'qualty'; valid: "
     "['batch_size', 'device', 'quality']\n"),
])
def test_score_errors_exit_2(image_dir, tmp_path, capsys, argv, msg):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("jpeg_compressibility: [1\n")
    argv = [a.format(img=image_dir, prompts=prompts, bad_yaml=bad_yaml) for a in argv]
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", *argv, "--no-progress"])
    assert ei.value.code == 2
    assert msg in capsys.readouterr().err


def test_score_prompts_drop_a_byte_order_mark(image_dir, tmp_path, capsys):
    """A prompt file saved with a BOM (U+FEFF): it stayed in the first prompt's CSV cell."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a grey square\nnoisy\nnoise\n", encoding="utf-8-sig")
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir), "--prompts", str(prompts),
                "--no-progress"]) == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert [r["prompt"] for r in rows] == ["a grey square", "noisy", "noise"]


def test_score_ocr_says_in_one_line_why_scores_are_nan(image_dir, tmp_path, capsys):
    """Prompts without quoted text: ocr scores NaN. The summary said `mean nan` after a raw Python warning (file,
    line and source); now it gives the mean of the finite scores and says why the others are NaN, in one line."""
    pytest.importorskip("rapidocr_onnxruntime")
    prompts = tmp_path / "p.txt"
    prompts.write_text('a sign saying "HELLO"\na sign\nanother sign\n')
    assert run(["reward", "score", "ocr", "--images", str(image_dir), "--prompts", str(prompts), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err == ("scored 3 samples with ocr: mean 0 over the 1 finite scores; 2 of 3 scores are NaN (ocr: prompt "
                   "'a sign' has no quoted text and no metadata['text']: scored nan (no_target='nan': no text to "
                   "compare the image with); put the text to render in quotes, or in training drop such samples with "
                   "reward.on_nonfinite=drop_sample)\n")


def test_score_and_serve_name_the_reward_the_same_way(image_dir, capsys):
    """`mmrl reward score NAME` like `mmrl reward serve NAME`; no reward is a one-line error, and `--reward` is
    not an option (one spelling)."""
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir), "--no-progress"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "--images", str(image_dir), "--no-progress"])
    assert ei.value.code == 2 and "which reward? mmrl reward score NAME_OR_YAML" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "--reward", "jpeg_compressibility", "--images", str(image_dir)])
    assert ei.value.code == 2 and "unrecognized arguments: --reward" in capsys.readouterr().err


def test_serve_bad_port_exits_2(capsys):
    with pytest.raises(SystemExit) as ei:
        run(["reward", "serve", "jpeg_compressibility", "--port", "99999"])
    assert ei.value.code == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err


def test_parse_kw_types():
    assert parse_kw(["a=1", "b=0.5", "c=true", "d=hello", "e=[1, 2]", "f="]) == \
        {"a": 1, "b": 0.5, "c": True, "d": "hello", "e": [1, 2], "f": ""}


# ----------------------------------------------------------------------------- through the real `mmrl` CLI


@pytest.mark.slow  # three fresh interpreters importing torch: ~25 s on a loaded 2-core machine
def test_python_m_mmrl_cli_reward_list_and_score(image_dir, tmp_path):
    r = subprocess.run([PY, "-m", "mmrl.cli", "reward", "list"], capture_output=True, text=True, env=ENV,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "jpeg_compressibility" in r.stdout and "geo3k" in r.stdout
    out = tmp_path / "cli.csv"
    r = subprocess.run([PY, "-m", "mmrl.cli", "reward", "score", "jpeg_compressibility", "--images",
                        str(image_dir), "--out", str(out)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(read_csv(out)) == 3
    r = subprocess.run([PY, "-m", "mmrl.cli", "reward", "score", "jpeg_compressibility", "--images",
                        str(tmp_path / "missing")], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "not found" in r.stderr


def test_python_m_mmrl_cli_reward_serve(image_dir):
    import socket

    from mmrl.rewards.remote import RemoteReward, RemoteRewardError

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([PY, "-m", "mmrl.cli", "reward", "serve", "jpeg_compressibility", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        client = RemoteReward(f"http://127.0.0.1:{port}", retries=0, timeout=5, check_health=False)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert client.health()["reward"] == "jpeg_compressibility"
                break
            except RemoteRewardError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
        imgs = to_image_tensor([str(p) for p in sorted(image_dir.glob("*.png"))])
        assert torch.equal(client(imgs).scores, load("jpeg_compressibility")(imgs).scores)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ----------------------------------------------------------------------------- bad files, incremental output


@pytest.fixture
def dir_with_truncated(image_dir):
    """img_0..img_2 (good) plus img_1b.png: a PNG cut in half (header readable, pixels not)."""
    good = (image_dir / "img_1.png").read_bytes()
    (image_dir / "img_1b.png").write_bytes(good[: len(good) // 2])
    return image_dir


def test_score_skips_unreadable_images_and_keeps_the_rest(dir_with_truncated, tmp_path, capsys):
    out = tmp_path / "s.csv"
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(dir_with_truncated),
                "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    rows = read_csv(out)
    good = [dir_with_truncated / f"img_{i}.png" for i in range(3)]
    assert [r["path"] for r in rows] == [str(p) for p in good]
    want = load("jpeg_compressibility")(to_image_tensor([str(p) for p in good])).scores
    assert [float(r["score"]) for r in rows] == want.tolist()
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "skipping" in warnings[0] and "img_1b.png" in warnings[0]
    assert "truncated" in warnings[0]
    assert "scored 3 samples" in err and "skipped 1 unreadable image(s)" in err


def test_score_skip_keeps_prompts_aligned(dir_with_truncated, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("zero\none\nbad one\ntwo\n")  # sorted names: img_0, img_1, img_1b, img_2
    out = tmp_path / "s.jsonl"
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(dir_with_truncated),
                "--prompts", str(prompts), "--out", str(out), "--no-progress"]) == 0
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [(Path(r["path"]).name, r["prompt"]) for r in rows] == \
        [("img_0.png", "zero"), ("img_1.png", "one"), ("img_2.png", "two")]
    assert set(rows[0]) == {"path", "prompt", "score", "jpeg_kb"} and isinstance(rows[0]["score"], float)


@pytest.mark.parametrize("batch_size", ["1", "16"])  # 16: the images before the bad one share its chunk
def test_score_on_error_raise_stops_naming_the_file_and_keeps_rows_written(dir_with_truncated, tmp_path, capsys,
                                                                           batch_size):
    out = tmp_path / "s.csv"
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "jpeg_compressibility", "--images", str(dir_with_truncated),
             "--out", str(out), "--batch-size", batch_size, "--on-error", "raise", "--no-progress"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read image" in err[0] and "img_1b.png" in err[0] and "2 row(s)" in err[0]
    assert [Path(r["path"]).name for r in read_csv(out)] == ["img_0.png", "img_1.png"]


def test_score_csv_header_comes_from_the_first_scored_rows(image_dir, tmp_path):
    (image_dir / "a_bad.png").write_bytes(b"not a png")  # sorted first: its chunk scores nothing
    out = tmp_path / "s.csv"
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir),
                "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    rows = read_csv(out)
    assert list(rows[0]) == ["path", "prompt", "score", "jpeg_kb"] and len(rows) == 3


def test_score_all_unreadable_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "jpeg_compressibility", "--images", str(bad), "--no-progress"])
    assert ei.value.code == 2
    assert "none of the 1 image(s) could be read; skipped 1 unreadable image(s)" in capsys.readouterr().err


class _InterruptOnSecondCall:
    """Wraps a reward: the 2nd call records the --out file's content, the 3rd raises KeyboardInterrupt."""

    def __init__(self, reward, out):
        self.reward, self.out, self.calls, self.seen = reward, out, 0, None
        self.kind = reward.kind

    def __call__(self, **kw):
        self.calls += 1
        if self.calls == 2:
            self.seen = self.out.read_text()
        if self.calls == 3:
            raise KeyboardInterrupt
        return self.reward(**kw)


def test_score_writes_rows_as_they_are_scored_and_an_abort_keeps_them(image_dir, tmp_path, monkeypatch, capsys):
    import mmrl.rewards.cli as cli

    out = tmp_path / "s.csv"
    wrapped = _InterruptOnSecondCall(load("jpeg_compressibility"), out)
    monkeypatch.setattr(cli, "load_reward_from_args", lambda *a, **k: wrapped)
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir),
             "--out", str(out), "--batch-size", "1", "--no-progress"])
    assert ei.value.code == 130
    assert wrapped.seen.splitlines()[0] == "path,prompt,score,jpeg_kb" and len(wrapped.seen.splitlines()) == 2
    assert [Path(r["path"]).name for r in read_csv(out)] == ["img_0.png", "img_1.png"]
    assert "interrupted; 2 scored row(s) kept" in capsys.readouterr().err


def test_score_out_directory_writes_scores_csv_inside(image_dir, tmp_path, capsys):
    d = tmp_path / "results"
    d.mkdir()
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir),
                "--out", str(d), "--no-progress"]) == 0
    assert len(read_csv(d / "scores.csv")) == 3
    assert str(d / "scores.csv") in capsys.readouterr().err
    (d / "scores.csv").unlink()
    (d / "scores.csv").mkdir()
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir), "--out", str(d)])
    assert ei.value.code == 2 and "is a directory too" in capsys.readouterr().err


def test_score_out_under_a_file_is_one_line_error(image_dir, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir),
             "--out", str(f / "s.csv"), "--no-progress"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{str(f)!r} is a file, not a directory" in err[0]


@pytest.mark.parametrize("argv,msg", [
    (["--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
    (["--max-batch", "-4"], "--max-batch must be an integer >= 1, got -4"),
    (["--max-pixels", "0"], "--max-pixels must be an integer >= 1, got 0"),
    (["--read-timeout", "0"], "--read-timeout must be a number > 0, got 0.0"),
    (["--read-timeout", "-1"], "--read-timeout must be a number > 0, got -1.0"),
    (["--read-timeout", "nan"], "--read-timeout must be a number > 0, got nan"),
    (["--max-wait-ms", "-5"], "--max-wait-ms must be a number >= 0, got -5.0"),
])
def test_serve_bad_limits_exit_2_before_loading_the_reward(monkeypatch, capsys, argv, msg):
    import mmrl.rewards.cli as cli
    import mmrl.rewards.remote as remote

    def must_not_run(*a, **k):
        raise AssertionError("reached the reward load / serve with a bad option")

    monkeypatch.setattr(cli, "load_reward_from_args", must_not_run)
    monkeypatch.setattr(remote, "serve", must_not_run)
    with pytest.raises(SystemExit) as ei:
        run(["reward", "serve", "jpeg_compressibility", "--port", "0", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


# ----------------------------------------------------------------------------- image size limit (--max-pixels)


def test_score_skips_images_over_max_pixels_from_the_header(image_dir, tmp_path, capsys):
    """A 12000x12000 PNG (144 megapixels: 1.7 GB as a float tensor) is skipped by its header, as the server refuses
    it: the file below holds only the header, so a decode attempt would report a truncated file instead. A real
    image over a small --max-pixels is skipped the same way; the others are scored."""
    (image_dir / "huge.png").write_bytes(png_claiming_size(12000, 12000))
    out = tmp_path / "s.csv"
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir), "--out", str(out),
                "--no-progress"]) == 0
    rows = read_csv(out)
    assert [Path(r["path"]).name for r in rows] == ["img_0.png", "img_1.png", "img_2.png"]
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert warnings == [f"mmrl reward: warning: skipping {image_dir / 'huge.png'}: 12000x12000 = 144000000 pixels, "
                        f"more than --max-pixels=16777216 (not decoded)"]
    assert "skipped 1 unreadable image(s)" in err
    (image_dir / "huge.png").unlink()
    Image.new("RGB", (40, 20)).save(image_dir / "wide.png")  # 800 pixels (the others: 16x16 = 256)
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir), "--out", str(out),
                "--max-pixels", "800", "--no-progress"]) == 0
    assert [Path(r["path"]).name for r in read_csv(out)] == ["img_0.png", "img_1.png", "img_2.png", "wide.png"]
    capsys.readouterr()
    assert run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir), "--out", str(out),
                "--max-pixels", "799", "--no-progress"]) == 0
    assert [Path(r["path"]).name for r in read_csv(out)] == ["img_0.png", "img_1.png", "img_2.png"]
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert line.endswith("wide.png: 40x20 = 800 pixels, more than --max-pixels=799 (not decoded)")
    with pytest.raises(SystemExit) as ei:
        run(["reward", "score", "jpeg_compressibility", "--images", str(image_dir), "--max-pixels", "0"])
    assert ei.value.code == 2 and "--max-pixels must be >= 1, got 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- shared token (real server process)


def _wait_for_server(client, proc, deadline_s=60):
    from mmrl.rewards.remote import RemoteRewardError

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return client.health()
        except RemoteRewardError as exc:
            if exc.status == 401:
                return None
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)


def test_python_m_mmrl_cli_reward_serve_with_a_token_from_the_environment(image_dir):
    """`MMRL_REWARD_TOKEN=... mmrl reward serve` on 127.0.0.1: a client with the token (from its own environment or
    token=) scores; without it or with another one, 401 in one line, at the start-up health check already."""
    import socket

    from mmrl.rewards.remote import RemoteReward, RemoteRewardError, RemoteRewardUnreachableError

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([PY, "-m", "mmrl.cli", "reward", "serve", "jpeg_compressibility", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "MMRL_REWARD_TOKEN": "tok-3f9a"}, cwd=ROOT)
    try:
        client = RemoteReward(url, retries=0, timeout=5, check_health=False, token="tok-3f9a")
        assert _wait_for_server(client, proc)["reward"] == "jpeg_compressibility"
        imgs = to_image_tensor([str(p) for p in sorted(image_dir.glob("*.png"))])
        assert torch.equal(client(imgs).scores, load("jpeg_compressibility")(imgs).scores)
        for token in (None, "tok-3f9b", "tok-3f9a-and-more"):
            with pytest.raises(RemoteRewardUnreachableError, match=r"refused the token \(HTTP 401: missing or wrong "
                                                                   r"token: send the header 'Authorization: Bearer"):
                RemoteReward(url, retries=0, timeout=5, token=token)
            with pytest.raises(RemoteRewardError, match="HTTP 401") as ei:
                RemoteReward(url, retries=3, backoff=5, timeout=5, check_health=False, token=token)(imgs)  # no retry
            assert ei.value.status == 401
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert "warning" not in err  # bound to 127.0.0.1: no warning about a missing token (there is one anyway)
