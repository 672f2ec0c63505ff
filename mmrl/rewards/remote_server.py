"""The reward server: ``serve(reward, ...)`` / ``RewardServer`` on the stdlib ``ThreadingHTTPServer``, with request
batching and bounded resources. The protocol, status codes and limits are in the ``mmrl.rewards.remote`` docstring.
"""

from __future__ import annotations

import json
import math
import numbers
import queue
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch

from mmrl.http_auth import BearerToken, check_token, is_loopback
from mmrl.http_auth import token_from_env as _token_from_env
from mmrl.rewards.base import RewardModel
from mmrl.rewards.remote_codec import (ImageTooLargeError, base64_image_bytes, decode_image_bytes, image_header_size,
                                       to_jsonable)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Pending:
    """One decoded /score request waiting for the batch worker."""

    __slots__ = ("images", "prompts", "metadata", "completions", "n", "done", "result", "status")

    def __init__(self, images, prompts, metadata, completions, n):
        self.images, self.prompts, self.metadata, self.completions, self.n = images, prompts, metadata, completions, n
        self.done = threading.Event()
        self.result: Any = None
        self.status = 200

    def signature(self) -> tuple:
        return (None if self.images is None else tuple(self.images.shape[1:]), self.prompts is None,
                self.metadata is None, self.completions is None)

    def finish(self, status: int, result: Any) -> None:
        self.status, self.result = status, result
        self.done.set()


def _split_details(details: dict, offsets: list[int], total: int) -> list[dict]:
    """Per-sample details (length-`total` tensors/lists) are sliced per request; the rest is copied."""
    outs: list[dict] = [{} for _ in range(len(offsets) - 1)]
    for k, v in details.items():
        per_sample = (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == total) or \
                     (isinstance(v, (list, tuple, np.ndarray)) and len(v) == total)
        for j in range(len(outs)):
            a, b = offsets[j], offsets[j + 1]
            outs[j][k] = to_jsonable(v[a:b] if per_sample else v)
    return outs


DEFAULT_MAX_PIXELS = 4096 * 4096
# pixels one request may decode in total: 64 images of 1024x1024 (or 4 of the largest allowed); as float32 CHW
# that is 0.8 GB, the bound of what one request can make the server allocate
DEFAULT_MAX_REQUEST_PIXELS = 4 * DEFAULT_MAX_PIXELS
TOKEN_ENV = "MMRL_REWARD_TOKEN"


def token_from_env(token: str | None = None) -> str | None:
    """`token` if given, else $MMRL_REWARD_TOKEN (an empty value counts as unset)."""
    return _token_from_env(token, TOKEN_ENV)



def check_server_options(*, max_batch: Any = 64, max_wait_ms: Any = 5.0, max_body_mb: Any = 256.0,
                         max_pixels: Any = DEFAULT_MAX_PIXELS, read_timeout: Any = 30.0, backlog: Any = 128,
                         max_request_pixels: Any = DEFAULT_MAX_REQUEST_PIXELS, token: Any = None,
                         flags: bool = False) -> None:
    """ValueError naming the first bad server option (as ``--max-batch`` when `flags`, else ``max_batch``)."""
    def name(key: str) -> str:
        return "--" + key.replace("_", "-") if flags else key

    def number(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    for key, v in (("max_batch", max_batch), ("max_pixels", max_pixels), ("max_request_pixels", max_request_pixels),
                   ("backlog", backlog)):
        if not (isinstance(v, numbers.Integral) and not isinstance(v, bool)) or v < 1:
            raise ValueError(f"{name(key)} must be an integer >= 1, got {v!r}")
    for key, v in (("read_timeout", read_timeout), ("max_body_mb", max_body_mb)):
        if not number(v) or v <= 0:
            raise ValueError(f"{name(key)} must be a number > 0, got {v!r}")
    if not number(max_wait_ms) or max_wait_ms < 0:
        raise ValueError(f"{name('max_wait_ms')} must be a number >= 0, got {max_wait_ms!r}")
    check_token(token, name('token'))


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # handler threads never keep the process alive


class RewardServer:
    """HTTP server around one reward model; see the module docstring for the protocol and the limits
    (`max_pixels` per image, `max_request_pixels` per request, `read_timeout` per socket operation, listen
    `backlog`) and the optional shared `token` (every request must carry ``Authorization: Bearer <token>``)."""

    def __init__(self, reward: RewardModel, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
                 max_wait_ms: float = 5.0, max_body_mb: float = 256.0, quiet: bool = True,
                 max_pixels: int = DEFAULT_MAX_PIXELS, read_timeout: float = 30.0, backlog: int = 128,
                 max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS, token: str | None = None):
        check_server_options(max_batch=max_batch, max_wait_ms=max_wait_ms, max_body_mb=max_body_mb,
                             max_pixels=max_pixels, read_timeout=read_timeout, backlog=backlog,
                             max_request_pixels=max_request_pixels, token=token)
        self.reward = reward
        self.max_batch = int(max_batch)
        self.max_wait = float(max_wait_ms) / 1000.0
        self.max_body = int(max_body_mb * 1024 * 1024)
        self.max_pixels = int(max_pixels)
        self.max_request_pixels = int(max_request_pixels)
        self._auth = BearerToken(token)  # compared as whole header values in constant time
        self.read_timeout = float(read_timeout)
        self.quiet = quiet
        self.model_calls = 0  # number of reward invocations (tests check that batching merged requests)
        self._queue: "queue.Queue[_Pending]" = queue.Queue()
        self._stop = threading.Event()
        self.httpd = _HTTPServer((host, int(port)), self._handler_class(), bind_and_activate=False)
        # socketserver listens with a backlog of 5: bursts of concurrent clients overflow it and get
        # dropped or reset connections; the kernel caps the value at net.core.somaxconn
        self.httpd.request_queue_size = int(backlog)
        try:
            self.httpd.server_bind()
            self.httpd.server_activate()
        except BaseException:
            self.httpd.server_close()
            raise
        self.host, self.port = self.httpd.server_address[:2]
        self._worker = threading.Thread(target=self._batch_loop, name="reward-batcher", daemon=True)
        self._worker.start()
        self._thread: threading.Thread | None = None

    @property
    def exposed_without_token(self) -> bool:
        """Bound beyond this machine (e.g. 0.0.0.0) with no token: anyone who can reach the port can use it."""
        return not self._auth.required and not is_loopback(str(self.host))

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the server's token (always True without one)."""
        return self._auth.matches(header)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    # -------------------------------------------------------------- lifecycle

    def start(self) -> "RewardServer":
        """Serve in a background thread (returns immediately)."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="reward-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self._worker.join(timeout=5)
        while True:
            try:
                self._queue.get_nowait().finish(503, {"error": "reward server is shutting down"})
            except queue.Empty:
                break

    def __enter__(self) -> "RewardServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -------------------------------------------------------------- batching

    def _batch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            group, later, total = [first], [], first.n
            deadline = time.monotonic() + self.max_wait
            while total < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    r = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if r.signature() == first.signature() and total + r.n <= self.max_batch:
                    group.append(r)
                    total += r.n
                else:
                    later.append(r)
            for batch in [group] + [[r] for r in later]:
                try:
                    self._run(batch)
                except Exception as exc:  # noqa: BLE001 - never leave a handler waiting forever
                    for r in batch:
                        if not r.done.is_set():
                            r.finish(500, {"error": f"reward server error: {type(exc).__name__}: {exc}"})

    def _run(self, group: list[_Pending]) -> None:
        def cat(field):
            vals = [getattr(r, field) for r in group]
            if vals[0] is None:
                return None
            return torch.cat(vals) if field == "images" else [x for v in vals for x in v]

        try:
            self.model_calls += 1
            with torch.no_grad():  # scores only: no autograd graph for differentiable rewards
                out = self.reward(images=cat("images"), prompts=cat("prompts"), metadata=cat("metadata"),
                                  completions=cat("completions"))
            total = sum(r.n for r in group)
            if len(out) != total:
                raise RuntimeError(f"reward returned {len(out)} scores for {total} inputs")
        except Exception as exc:  # noqa: BLE001 - reported to the client
            if len(group) > 1:  # isolate the failing request
                for r in group:
                    self._run([r])
                return
            status = 400 if isinstance(exc, (ValueError, TypeError)) else 500
            kind = "bad input" if status == 400 else "reward model failed"
            group[0].finish(status, {"error": f"{kind}: {type(exc).__name__}: {exc}"})
            return
        scores = out.scores.detach().float().cpu()
        offsets = [0]
        for r in group:
            offsets.append(offsets[-1] + r.n)
        try:
            details = _split_details(out.details, offsets, offsets[-1])
        except Exception as exc:  # noqa: BLE001
            details = [{"details_error": str(exc)}] * len(group)
        for j, r in enumerate(group):
            r.finish(200, {"scores": scores[offsets[j]:offsets[j + 1]].tolist(), "details": details[j]})

    # -------------------------------------------------------------- request parsing

    def _parse(self, body: bytes) -> _Pending:
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadRequest(400, f"body is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise _BadRequest(400, f"body must be a JSON object, got {type(obj).__name__}")
        unknown = set(obj) - {"images", "prompts", "metadata", "completions"}
        if unknown:
            raise _BadRequest(400, f"unknown fields {sorted(unknown)}; valid: images, prompts, metadata, completions")
        fields = {}
        for key in ("images", "prompts", "metadata", "completions"):
            v = obj.get(key)
            if v is not None and not isinstance(v, list):
                raise _BadRequest(400, f"'{key}' must be a list, got {type(v).__name__}")
            fields[key] = v
        if fields["images"] is None and fields["completions"] is None:
            raise _BadRequest(400, "pass 'images' (base64 PNG strings) or 'completions'")
        counts = {k: len(v) for k, v in fields.items() if v is not None}
        if len(set(counts.values())) > 1:
            raise _BadRequest(400, f"count mismatch: {counts}; every list needs one entry per sample")
        n = next(iter(counts.values()))
        if n == 0:
            raise _BadRequest(400, "empty batch")
        if n > self.max_batch:
            raise _BadRequest(413, f"batch of {n} exceeds max_batch={self.max_batch}; split the request")
        if fields["prompts"] is not None and not all(isinstance(p, str) for p in fields["prompts"]):
            raise _BadRequest(400, "'prompts' must be a list of strings")
        if fields["metadata"] is not None and not all(isinstance(m, dict) for m in fields["metadata"]):
            raise _BadRequest(400, "'metadata' must be a list of objects")
        images = None
        if fields["images"] is not None:
            try:
                images = self._decode_images(fields["images"])
            except ImageTooLargeError as exc:
                raise _BadRequest(413, str(exc)) from None
            except ValueError as exc:
                raise _BadRequest(400, str(exc)) from None
        return _Pending(images, fields["prompts"], fields["metadata"], fields["completions"], n)

    def _decode_images(self, encoded: list) -> torch.Tensor:
        """[n, 3, H, W] float images. Every header is read first: the size limits (`max_pixels` per image,
        `max_request_pixels` in total) and the one-size rule are checked before a single pixel is decoded, and
        the batch is allocated once (no stacked copy)."""
        blobs = [base64_image_bytes(s, i) for i, s in enumerate(encoded)]
        sizes = [image_header_size(b, i) for i, b in enumerate(blobs)]
        for i, (w, h) in enumerate(sizes):
            if w * h > self.max_pixels:
                raise ImageTooLargeError(f"images[{i}] is {w}x{h} = {w * h} pixels, more than max_pixels="
                                         f"{self.max_pixels}; resize it (the server refuses to decode it)")
        total = sum(w * h for w, h in sizes)
        if total > self.max_request_pixels:
            raise ImageTooLargeError(f"the request's {len(sizes)} images hold {total} pixels, more than "
                                     f"max_request_pixels={self.max_request_pixels}; send fewer images per request "
                                     f"(the server refuses to decode them)")
        if len(set(sizes)) > 1:
            hw = sorted({(h, w) for w, h in sizes})
            raise ValueError(f"images in one request must share a size, got {[(3, h, w) for h, w in hw]}")
        w, h = sizes[0]
        images = torch.empty(len(blobs), 3, h, w)
        for i, b in enumerate(blobs):
            images[i] = decode_image_bytes(b, i, max_pixels=self.max_pixels)
        return images

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "mmrl-reward/1"
            # socket timeout of every read/write on the connection (StreamRequestHandler.setup applies it):
            # a stalled request line/headers or an idle keep-alive connection ends the handler thread
            timeout = server.read_timeout

            def log_message(self, fmt, *args):  # noqa: N802 - stdlib name
                if not server.quiet:
                    super().log_message(fmt, *args)

            def _send(self, status: int, obj: Any) -> None:
                body = json.dumps(obj).encode("utf-8")
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client went away or stopped reading (write timeout): drop the connection
                    self.close_connection = True

            def _refuse_unauthorized(self) -> bool:
                """401 (one line) for a request without the server's token; the body is not read."""
                if server.authorized(self.headers.get("Authorization")):
                    return False
                self.close_connection = True  # an unread body must not be parsed as the next request
                self._send(401, {"error": "missing or wrong token: send the header 'Authorization: Bearer <token>' "
                                          f"(the client reads ${TOKEN_ENV}, the server's --token)"})
                return True

            def do_GET(self):  # noqa: N802
                if self._refuse_unauthorized():
                    return
                if self.path.rstrip("/") == "/health":
                    self._send(200, {"status": "ok", "reward": server.reward.name, "kind": server.reward.kind,
                                     "max_batch": server.max_batch, "max_pixels": server.max_pixels,
                                     "max_request_pixels": server.max_request_pixels})
                else:
                    self._send(404, {"error": f"unknown path {self.path!r}; use GET /health or POST /score"})

            def do_POST(self):  # noqa: N802
                if self._refuse_unauthorized():
                    return
                if self.path.rstrip("/") != "/score":
                    self._drain()
                    self._send(404, {"error": f"unknown path {self.path!r}; use POST /score"})
                    return
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    self.close_connection = True
                    self._send(411, {"error": "Content-Length header required"})
                    return
                if int(length) > server.max_body:
                    self.close_connection = True
                    self._send(413, {"error": f"body of {length} bytes exceeds {server.max_body} bytes"})
                    return
                try:
                    body = self.rfile.read(int(length))
                except TimeoutError:
                    self.close_connection = True
                    self._send(408, {"error": f"request body not received: nothing arrived for "
                                              f"{server.read_timeout:g} s (read_timeout)"})
                    return
                if len(body) < int(length):  # the client closed the connection early
                    self.close_connection = True
                    return
                try:
                    req = server._parse(body)
                except _BadRequest as exc:
                    self._send(exc.status, {"error": str(exc)})
                    return
                if server._stop.is_set():
                    self._send(503, {"error": "reward server is shutting down"})
                    return
                server._queue.put(req)
                req.done.wait()
                self._send(req.status, req.result)

            def _drain(self):
                length = self.headers.get("Content-Length")
                if length and length.isdigit() and int(length) <= server.max_body:
                    self.rfile.read(int(length))
                else:
                    self.close_connection = True

        return Handler


def serve(reward: RewardModel, host: str = "127.0.0.1", port: int = 8008, max_batch: int = 64,
          max_wait_ms: float = 5.0, block: bool = True, quiet: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS,
          read_timeout: float = 30.0, backlog: int = 128, max_body_mb: float = 256.0,
          max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS, token: str | None = None) -> RewardServer:
    """Serve `reward` on http://host:port. `block=True` serves until Ctrl-C; `block=False` starts a background
    thread and returns the `RewardServer` (``.url``, ``.shutdown()``). port=0 picks a free port. `token`: every
    request must send ``Authorization: Bearer <token>`` (None: no check; `mmrl reward serve` reads
    $MMRL_REWARD_TOKEN). Unless `quiet`, a server bound beyond localhost without a token warns on stderr."""
    server = RewardServer(reward, host=host, port=port, max_batch=max_batch, max_wait_ms=max_wait_ms, quiet=quiet,
                          max_pixels=max_pixels, read_timeout=read_timeout, backlog=backlog, max_body_mb=max_body_mb,
                          max_request_pixels=max_request_pixels, token=token)
    if server.exposed_without_token and not quiet:
        print(f"mmrl reward: warning: serving on {server.url} without a token: anyone who can reach this address "
              f"can use the reward model; pass --token or set {TOKEN_ENV} (clients send it from {TOKEN_ENV})",
              file=sys.stderr, flush=True)
    if not block:
        return server.start()
    print(f"serving reward '{reward.name}' on {server.url} (POST /score, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return server
