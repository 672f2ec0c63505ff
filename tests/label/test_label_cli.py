"""`mmrl label` from the command line (the commands docs/labeling.md shows): the printed URL, a choice through the
API, Ctrl-C, a rerun that continues; the token from the environment; a wide bind without a token refused."""

import http.client
import json
import re
import signal
import subprocess
import sys
from urllib.parse import urlsplit

from mmrl.cli import main
from mmrl.testing import child_env


def _start(args, env=None):
    proc = subprocess.Popen([sys.executable, "-m", "mmrl.cli", "label", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(**(env or {})))
    head = proc.stdout.readline()
    url_line = proc.stdout.readline()
    if not url_line:
        proc.kill()
        raise AssertionError(f"mmrl label did not start: {head}{proc.stderr.read()}")
    return proc, head, re.match(r"open (\S+)  \(Ctrl-C stops; rerun to continue\)$", url_line.rstrip("\n")).group(1)


def _call(url, method, path, body=None, headers=None):
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    h = {**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data)


def _stop(proc):
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=20)
    return proc.returncode, out, err


def test_python_m_mmrl_cli_label_serves_the_page_and_a_rerun_with_a_token_continues(samples, tmp_path):
    out = tmp_path / "preferences.jsonl"
    proc, head, url = _start([str(samples), "--out", str(out)])
    try:
        assert head == f"mmrl label: 6 items from {samples} (0 labelled, 0 skipped, 6 to go) -> {out}\n"
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)  # --port 0: a free port, loopback by default
        status, item = _call(url, "GET", "/api/next?session=script")
        assert status == 200
        assert _call(url, "POST", "/api/label", {"pair_id": item["pair_id"], "choice": "left",
                                                  "lease": item["lease"]})[0] == 200
    finally:
        code, rest, err = _stop(proc)
    assert code == 0 and rest == f"mmrl label: stopped with 1 labelled, 0 skipped, 5 to go; pairs in {out}\n", err
    assert json.loads(out.read_text())["pair_id"] == item["pair_id"]
    # the rerun continues; this time with a token from the environment (the second command docs/labeling.md shows)
    proc, head, url = _start([str(samples), "--out", str(out), "--host", "127.0.0.1"],
                             env={"MMRL_LABEL_TOKEN": "change-me"})
    try:
        assert head == f"mmrl label: 6 items from {samples} (1 labelled, 0 skipped, 5 to go) -> {out}\n"
        assert url.endswith("/?token=change-me")  # the URL to open carries it
        assert _call(url, "GET", "/api/progress")[0] == 401
        auth = {"Authorization": "Bearer change-me"}
        assert _call(url, "GET", "/api/progress", headers=auth) == (
            200, {"labelled": 1, "skipped": 0, "total": 6, "remaining": 5})
        assert _call(url, "GET", "/api/next?session=script", headers=auth)[1]["pair_id"] != item["pair_id"]
    finally:
        _stop(proc)


def test_a_wide_bind_without_a_token_and_a_missing_source_are_one_line_errors(samples, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MMRL_LABEL_TOKEN", raising=False)
    assert main(["label", str(samples), "--out", str(tmp_path / "p.jsonl"), "--host", "0.0.0.0"]) == 2
    assert capsys.readouterr().err == (
        "mmrl: error: --host 0.0.0.0 lets other machines reach the page: pass --token (or set MMRL_LABEL_TOKEN), or "
        "keep the default --host 127.0.0.1  (MMRL_DEBUG=1 shows the traceback)\n")
    assert main(["label", str(tmp_path / "nowhere"), "--out", str(tmp_path / "p.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"mmrl: error: label source not found: {tmp_path / 'nowhere'} (give a "
                                              f"folder of samples")
    assert not (tmp_path / "p.jsonl").exists()


def test_a_wheel_ships_the_page(tmp_path):
    """page.html is package data (pyproject's [tool.setuptools.package-data]): without it a wheel or a non-editable
    install has no page to serve."""
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside pyproject.toml
    shutil.copytree(root / "mmrl", src / "mmrl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("mmrl-*.whl")
    assert "mmrl/label/page.html" in zipfile.ZipFile(wheel).namelist()
