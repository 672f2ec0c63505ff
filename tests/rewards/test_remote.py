"""Reward server + client over HTTP on 127.0.0.1 (free ports only; nothing leaves loopback)."""

import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

import mmrl.rewards.remote as R
from mmrl.rewards import RewardModel, load
from mmrl.rewards.remote import RemoteReward, RemoteRewardError, serve

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _images(n=4, seed=0, size=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255  # on the uint8 grid


def _post_raw(url, body: bytes, content_type="application/json"):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with _NO_PROXY.open(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _b64png(t):
    return R.encode_image_base64(t)


@pytest.fixture
def jpeg_server():
    srv = serve(load("jpeg_compressibility"), port=0, block=False, max_batch=8, max_wait_ms=50)
    yield srv
    srv.shutdown()


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ----------------------------------------------------------------------------- round trip


def test_png_encoding_is_lossless_on_uint8_grid():
    img = _images(1)[0]
    back = R.decode_image_base64(_b64png(img))
    assert torch.equal(back, img)
    assert torch.equal(R.decode_image_base64(R.encode_image_base64(img, data_url=True)), img)
    # off-grid floats are rounded to the nearest uint8 level
    off = torch.full((3, 2, 2), 0.5)
    assert torch.equal(R.decode_image_base64(_b64png(off)), torch.full((3, 2, 2), 128 / 255))


def test_round_trip_equals_local_exactly(jpeg_server):
    local = load("jpeg_compressibility")
    client = load("remote", url=jpeg_server.url)
    assert isinstance(client, RemoteReward)
    imgs = _images(6)
    rem, loc = client(imgs), local(imgs)
    assert torch.equal(rem.scores, loc.scores)
    assert torch.equal(rem.details["jpeg_kb"], loc.details["jpeg_kb"])
    # client-side chunking keeps requests within the server's max_batch (8)
    many = _images(19, seed=1)
    assert torch.equal(RemoteReward(jpeg_server.url, batch_size=8)(many).scores, local(many).scores)
    # PIL / path inputs go through the same encoding
    pil = [Image.fromarray((im.permute(1, 2, 0) * 255).round().byte().numpy()) for im in imgs]
    assert torch.equal(client(pil).scores, loc.scores)


def test_health(jpeg_server):
    h = RemoteReward(jpeg_server.url).health()
    assert h == {"status": "ok", "reward": "jpeg_compressibility", "kind": "image", "max_batch": 8}


def test_text_reward_served():
    srv = serve(load("math_accuracy"), port=0, block=False)
    try:
        client = load("remote", url=srv.url, kind="text")
        out = client(completions=[r"\boxed{\frac{1}{2}}", "7"], metadata=[{"answer": "0.5"}, {"answer": "8"}])
        assert out.scores.tolist() == [1.0, 0.0]
        assert out.details["extracted"] == [r"\frac{1}{2}", "7"]
        # a reward ValueError (missing ground truth key) is the client's fault: 400, no retries
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"HTTP 400.*no ground-truth key") as ei:
            RemoteReward(srv.url, backoff=5)(completions=["1"], metadata=[{"x": 1}])
        assert ei.value.status == 400 and time.monotonic() - t0 < 4
    finally:
        srv.shutdown()


# ----------------------------------------------------------------------------- 4xx / 5xx


def test_bad_requests_get_clear_4xx(jpeg_server):
    url = jpeg_server.url + "/score"
    img = _b64png(_images(1)[0])
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompts": ["a"]}).encode(), 400, "pass 'images'"),
        (json.dumps({"images": ["###notbase64###"]}).encode(), 400, r"images[0] is not valid base64"),
        (json.dumps({"images": [img, base64.b64encode(b"hello world").decode()]}).encode(), 400,
         "images[1] is not a decodable image"),
        (json.dumps({"images": [img, img], "prompts": ["only one"]}).encode(), 400, "count mismatch"),
        (json.dumps({"images": [img] * 9}).encode(), 413, "exceeds max_batch=8"),
        (json.dumps({"images": img}).encode(), 400, "'images' must be a list"),
        (json.dumps({"images": [img], "extra": 1}).encode(), 400, "unknown fields ['extra']"),
        (json.dumps({"images": []}).encode(), 400, "empty batch"),
    ]
    for body, status, msg in cases:
        code, reply = _post_raw(url, body)
        assert code == status, (body[:40], reply)
        assert msg in reply["error"], reply
    code, reply = _post_raw(jpeg_server.url + "/nope", b"{}")
    assert code == 404 and "POST /score" in reply["error"]
    # mixed sizes in one request
    small = _b64png(_images(1, size=8)[0])
    code, reply = _post_raw(url, json.dumps({"images": [img, small]}).encode())
    assert code == 400 and "share a size" in reply["error"]


def test_client_4xx_raises_immediately_with_server_message(jpeg_server):
    client = RemoteReward(jpeg_server.url, batch_size=20, retries=3, backoff=5)
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"HTTP 413.*exceeds max_batch=8") as ei:
        client(_images(9))
    assert ei.value.status == 413 and time.monotonic() - t0 < 4  # no backoff sleeps


class _Broken(RewardModel):
    name = "broken"

    def score_images(self, images, prompts, metadata):
        raise RuntimeError("CUDA out of memory (simulated)")


def test_model_failure_is_500_with_message():
    srv = serve(_Broken(), port=0, block=False)
    try:
        code, reply = _post_raw(srv.url + "/score", json.dumps({"images": [_b64png(_images(1)[0])]}).encode())
        assert code == 500 and "reward model failed: RuntimeError: CUDA out of memory (simulated)" in reply["error"]
        with pytest.raises(RemoteRewardError, match=r"after 2 attempt\(s\).*HTTP 500.*CUDA out of memory") as ei:
            RemoteReward(srv.url, retries=1, backoff=0.01)(_images(1))
        assert srv.url in str(ei.value)
    finally:
        srv.shutdown()


# ----------------------------------------------------------------------------- batching / concurrency


def test_concurrent_clients_get_their_own_scores():
    # a generous merge window so the merge happens even on a loaded machine
    jpeg_server = serve(load("jpeg_compressibility"), port=0, block=False, max_batch=64, max_wait_ms=300)
    local = load("jpeg_compressibility")
    batches = [_images(1 + i % 3, seed=100 + i) for i in range(8)]
    expected = [local(b).scores for b in batches]
    results, errors = [None] * 8, []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait(timeout=10)
            results[i] = RemoteReward(jpeg_server.url)(batches[i]).scores
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    jpeg_server.shutdown()
    assert not errors
    for got, want in zip(results, expected):
        assert torch.equal(got, want)
    assert jpeg_server.model_calls < 8  # some requests were merged into one model call


def test_merged_batch_failure_is_isolated():
    srv = serve(load("math_accuracy"), port=0, block=False, max_wait_ms=200)
    try:
        out, barrier = {}, threading.Barrier(2)

        def good():
            barrier.wait(10)
            out["good"] = RemoteReward(srv.url, kind="text")(completions=["3"], metadata=[{"answer": "3"}]).scores

        def bad():
            barrier.wait(10)
            try:
                RemoteReward(srv.url, kind="text")(completions=["3"], metadata=[{"nope": "3"}])
            except RemoteRewardError as exc:
                out["bad"] = exc.status

        ts = [threading.Thread(target=good), threading.Thread(target=bad)]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert out["good"].tolist() == [1.0] and out["bad"] == 400
    finally:
        srv.shutdown()


# ----------------------------------------------------------------------------- retries


class _FlakyHandler(BaseHTTPRequestHandler):
    fails_left = 2
    calls = 0
    delay = 0.0

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.delay:
            time.sleep(self.delay)
        if type(self).fails_left > 0:
            type(self).fails_left -= 1
            status, obj = 503, {"error": "warming up"}
        else:
            status, obj = 200, {"scores": [1.5], "details": {"k": [2.0], "s": "x"}}
        body = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _flaky_server(fails, delay=0.0):
    handler = type("H", (_FlakyHandler,), {"fails_left": fails, "calls": 0, "delay": delay})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, handler, f"http://127.0.0.1:{httpd.server_address[1]}"


def test_retry_after_two_503_then_success():
    httpd, handler, url = _flaky_server(fails=2)
    try:
        out = RemoteReward(url, retries=3, backoff=0.01)(_images(1))
        assert out.scores.tolist() == [1.5] and out.details["k"].tolist() == [2.0] and out.details["s"] == "x"
        assert handler.calls == 3
        handler.fails_left, handler.calls = 5, 0
        with pytest.raises(RemoteRewardError, match=r"failed after 2 attempt\(s\).*HTTP 503: warming up") as ei:
            RemoteReward(url, retries=1, backoff=0.01)(_images(1))
        assert url in str(ei.value) and handler.calls == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_timeout_is_retried_then_reported():
    httpd, handler, url = _flaky_server(fails=0, delay=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError, match="timed out|timeout"):
            RemoteReward(url, timeout=0.2, retries=1, backoff=0.01)(_images(1))
        assert time.monotonic() - t0 < 5
        # the client may give up before a busy server thread has even counted the 2nd request: wait for it
        deadline = time.monotonic() + 10
        while handler.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handler.calls == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_dead_port_raises_after_retries_within_bounded_time():
    url = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RemoteRewardError) as ei:
        load("remote", url=url, retries=2, backoff=0.05, timeout=2)(_images(1))
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert url in msg and "after 3 attempt(s)" in msg and "refused" in msg.lower()
    assert 0.15 <= elapsed < 5  # 0.05 + 0.1 s of backoff, no hanging


def test_client_validates_inputs():
    with pytest.raises(ValueError, match="http://"):
        RemoteReward("127.0.0.1:8000")
    c = RemoteReward("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="2 inputs but 1 prompts"):
        c(_images(2), prompts=["a"])
    with pytest.raises(ValueError, match="JSON-serialisable"):
        c(_images(1), metadata=[{"x": object()}])


def test_no_pickle_in_protocol():
    src = open(R.__file__).read()
    assert "import pickle" not in src and "pickle.loads" not in src and "torch.load" not in src
