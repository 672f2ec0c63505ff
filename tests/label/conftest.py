"""Fixtures of the labelling tests: a folder of tiny PNGs grouped by file name, and a server on a free port."""

import http.client
import json
from pathlib import Path

import pytest


def make_samples(folder: Path, prompts: int = 2, per_prompt: int = 3) -> Path:
    """`cube<p>_<j>.png` (8x8, each a different colour) and `cube<p>.txt` holding prompt p's text."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for p in range(prompts):
        (folder / f"cube{p}.txt").write_text(f"a cube number {p}\n")
        for j in range(per_prompt):
            Image.new("RGB", (8, 8), (40 + 100 * p, 60 * j, 200 - 50 * j)).save(folder / f"cube{p}_{j}.png")
    return folder


@pytest.fixture
def samples(tmp_path):
    return make_samples(tmp_path / "samples")


@pytest.fixture
def sample_maker():
    return make_samples


class Client:
    """http.client against a LabelServer; `call` returns (status, parsed JSON or raw bytes)."""

    def __init__(self, server, headers=None):
        self.server, self.headers = server, dict(headers or {})

    def call(self, method, path, body=None, headers=None, raw=False):
        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=10)
        h = {**self.headers, **({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        out = r.read()
        conn.close()
        if raw:
            return r.status, out, dict(r.getheaders())
        return r.status, json.loads(out) if out else None

    def next(self, session="tab1"):
        status, item = self.call("GET", f"/api/next?session={session}")
        assert status == 200, item
        return item

    def label(self, item, choice):
        return self.call("POST", "/api/label", {"pair_id": item["pair_id"], "choice": choice, "lease": item["lease"]})


@pytest.fixture
def serve(samples, tmp_path):
    """serve(out=..., **kw) -> (server, Client); every server is shut down at the end."""
    from mmrl.label import LabelServer, build_queue

    started = []

    def start(out=None, source=None, k=2, **kw):
        server = LabelServer(build_queue(source or samples, k), out or tmp_path / "prefs.jsonl", **kw).start()
        started.append(server)
        return server, Client(server)

    yield start
    for s in started:
        if s._thread is not None and s._thread.is_alive():
            s.shutdown()
