"""Serve a reward model over HTTP/JSON and call it from another process (no pickle anywhere).

Server (stdlib ``ThreadingHTTPServer``)::

    serve(load("pickscore", weights=...), host="127.0.0.1", port=8008)   # blocks; block=False -> RewardServer

    GET  /health -> {"status": "ok", "reward": name, "kind": "image"|"text", "max_batch": 64}
    POST /score  {"images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}], "completions": [...]}
              -> {"scores": [float, ...], "details": {key: JSON value}}

Every field but one of ``images`` / ``completions`` is optional; lists must all have one entry per sample.
Errors are JSON ``{"error": message}``: 400 bad JSON / base64 / not an image / count mismatch / bad input
to the reward (its ValueError), 404 unknown path, 408 request body stalled longer than ``read_timeout``,
411 no Content-Length, 413 batch larger than ``max_batch``, body larger than ``max_body_mb`` or an image
larger than ``max_pixels`` (width * height, read from the image header before any pixel is decoded; PIL's
own decompression-bomb limit, ``2 * Image.MAX_IMAGE_PIXELS``, also answers 413), 500 model failure.

Bounded resources: ``max_pixels`` (default 4096 * 4096) caps the memory one decoded image can take;
``read_timeout`` (default 30 s) is the socket timeout of each connection, so a client that sends headers
and then stalls (or keeps an idle keep-alive connection) frees its handler thread after that long; the
listen ``backlog`` (default 128) holds bursts of concurrent connections without resets.

Request batching: handler threads decode requests in parallel and put them on a queue; one worker thread
takes the first request, waits up to ``max_wait_ms`` for more requests with the same fields and image
size, scores them in one model call (at most ``max_batch`` samples) and splits the scores and per-sample
details back. A merged call that fails is retried request by request so one bad request fails alone.
The worker is the only thread that calls the model, so the model need not be thread-safe.

Client: ``RemoteReward(url, timeout=30, retries=3, backoff=0.5, check_health=True)`` (``load("remote",
url=...)``) calls ``GET /health`` when it is built (so a recipe that loads its rewards before its model fails
before the model loads: "reward server URL is not reachable: <reason>"; ``check_health=False`` skips it) and
encodes images as base64 PNG. PNG is lossless for uint8 images; float images are rounded to the uint8 grid first
(``round(clamp(x, 0, 1) * 255)``, the same rounding ``to_pil_list`` uses), so a reward that itself reads
uint8 pixels (JPEG size, every PIL-based preprocessor) scores identically remotely and locally.
Connection errors, timeouts, 408/429 and 5xx are retried with exponential backoff
(``backoff * 2**k`` seconds before retry k+1); then ``RemoteRewardError`` names the url and the last error.
Other 4xx raise ``RemoteRewardError`` at once with the server's message. Every reply is validated: a JSON
object whose ``scores`` is a flat list with one number per input (no strings, nulls, booleans or nested
lists), else ``RemoteRewardError`` naming the url, what was expected and (truncated) what came. JSON
``NaN`` / ``Infinity`` scores are numbers: they come back as ``nan`` / ``inf`` in ``scores`` and are not an
error here; the training recipes' reward validation (``reward.on_nonfinite``) rejects or drops them.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import json
import math
import numbers
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

import numpy as np
import torch

from mmrl.rewards.base import RewardModel, RewardOutput, register, to_image_list, to_pil_list

__all__ = ["RemoteRewardError", "RemoteRewardUnreachableError", "ImageTooLargeError", "RemoteReward", "RewardServer",
           "serve", "check_server_options", "request_json", "encode_image_base64", "decode_image_base64",
           "to_jsonable"]


class RemoteRewardError(RuntimeError):
    """A remote reward request failed; `url`, `status` (HTTP code or None) and the message say why."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.url, self.status = url, status
        self.reason = reason if reason is not None else message  # the cause alone, without the url preamble


class RemoteRewardUnreachableError(RemoteRewardError, ValueError):
    """The start-up health check failed. Also a ValueError: a wrong url or a server not started yet is fixed
    by the user, so the CLI prints it as one line (exit 2) instead of a traceback."""


class ImageTooLargeError(ValueError):
    """An image whose header says it has more pixels than allowed (decoding it could exhaust memory)."""


# ----------------------------------------------------------------------------------- encoding


def encode_image_base64(image: torch.Tensor, data_url: bool = False) -> str:
    """Float CHW [0,1] tensor -> base64 PNG (uint8 after ``round(x * 255)``); `data_url` prefixes
    ``data:image/png;base64,``."""
    buf = io.BytesIO()
    to_pil_list(image.unsqueeze(0) if image.dim() == 3 else image)[0].save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode("ascii")
    return f"data:image/png;base64,{b64}" if data_url else b64


def decode_image_base64(s: Any, index: int = 0, max_pixels: int | None = None) -> torch.Tensor:
    """Base64 image (bare or data URL) -> float CHW RGB tensor in [0,1]; ValueError naming `index`.
    Never treats the string as a path or URL. With `max_pixels`, an image whose header declares more than
    that many pixels (width * height) raises `ImageTooLargeError` before any pixel is decoded, as does one
    over PIL's decompression-bomb limit."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(s, str):
        raise ValueError(f"images[{index}] must be a base64 string, got {type(s).__name__}")
    if s.startswith("data:"):
        s = s.partition(",")[2]
    try:
        data = base64.b64decode("".join(s.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"images[{index}] is not valid base64: {exc}") from None
    try:
        with Image.open(io.BytesIO(data)) as im:  # reads the header only
            w, h = im.size
            if max_pixels is not None and w * h > max_pixels:
                raise ImageTooLargeError(f"images[{index}] is {w}x{h} = {w * h} pixels, more than max_pixels="
                                         f"{max_pixels}; resize it (the server refuses to decode it)")
            im.load()
            rgb = im if im.mode == "RGB" else im.convert("RGB")
            arr = np.array(rgb, dtype=np.uint8)  # one writable copy, shared by the tensor below
    except ImageTooLargeError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"images[{index}] is too large to decode safely: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"images[{index}] is not a decodable image ({len(data)} bytes): {exc}") from None
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)


def to_jsonable(v: Any) -> Any:
    """Tensors / numpy -> lists, containers recursively, other objects -> str."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().tolist()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {str(k): to_jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


# ----------------------------------------------------------------------------------- HTTP client helper

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_RETRY_4XX = {408, 429}


def _opener(url: str):
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in _LOOPBACK:  # never route loopback through an http_proxy from the environment
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def _http_error_message(err: urllib.error.HTTPError) -> str:
    try:
        body = err.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001
        return str(err.reason)
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and "error" in obj:
            err_obj = obj["error"]  # ours: a string; OpenAI-style: {"message": ...}
            if isinstance(err_obj, dict) and isinstance(err_obj.get("message"), str):
                return err_obj["message"]
            return str(err_obj)
        if isinstance(obj, dict) and isinstance(obj.get("message"), str):
            return obj["message"]
    except ValueError:
        pass
    return body.strip()[:500] or str(err.reason)


def request_json(url: str, payload: Any = None, *, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
                 headers: dict[str, str] | None = None, method: str | None = None, max_backoff: float = 30.0) -> Any:
    """POST `payload` as JSON (GET when None) and return the decoded JSON reply, retrying connection errors,
    timeouts, invalid replies, 408/429 and 5xx with exponential backoff (``backoff * 2**k`` s, at most
    `max_backoff`); other 4xx raise at once. `timeout` applies to each socket operation (urllib semantics)."""
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    hdrs = {"Accept": "application/json", **({"Content-Type": "application/json"} if data is not None else {}),
            **(headers or {})}
    opener = _opener(url)
    last = "no attempt made"
    attempts = max(0, int(retries)) + 1
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(max_backoff, backoff * 2 ** (attempt - 1)))
        req = urllib.request.Request(url, data=data, headers=hdrs, method=method or ("GET" if data is None else "POST"))
        try:
            with opener.open(req, timeout=timeout) as resp:
                body = resp.read()
            return json.loads(body)
        except urllib.error.HTTPError as err:
            msg = _http_error_message(err)
            if 400 <= err.code < 500 and err.code not in _RETRY_4XX:
                raise RemoteRewardError(f"{url} rejected the request (HTTP {err.code}): {msg}", url, err.code,
                                        reason=f"HTTP {err.code}: {msg}") from None
            last = f"HTTP {err.code}: {msg}"
        except urllib.error.URLError as err:
            last = f"{type(err.reason).__name__}: {err.reason}"
        except (TimeoutError, socket.timeout) as err:
            last = f"timeout after {timeout}s ({err})"
        except (ConnectionError, http.client.HTTPException, OSError) as err:
            last = f"{type(err).__name__}: {err}"
        except ValueError as err:  # JSON decode
            last = f"invalid JSON reply: {err}"
    raise RemoteRewardError(f"request to {url} failed after {attempts} attempt(s) ({retries} retries); "
                            f"last error: {last}", url, reason=f"{last} (after {attempts} attempt(s))")


# ----------------------------------------------------------------------------------- client


@register("remote")
class RemoteReward(RewardModel):
    """Reward computed by an `mmrl reward serve` server at `url` (JSON over HTTP, retries with backoff).

    `check_health=True` calls ``GET /health`` here, with the same timeout and retries as scoring, and raises
    `RemoteRewardUnreachableError` ("reward server URL is not reachable: <reason>") if it fails. `kind=None`
    takes the served reward's kind from that reply ("image" without a health check); an explicit `kind` that
    differs from the served one is a ValueError."""

    name = "remote"

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
                 batch_size: int = 64, kind: str | None = None, headers: dict[str, str] | None = None,
                 device: Any = None, check_health: bool = True):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
        if kind not in ("image", "text", None):
            raise ValueError(f"remote reward kind must be 'image' or 'text', got {kind!r}")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.batch_size = int(batch_size)
        self.kind = kind or "image"
        self._kind_given = kind is not None
        self.headers = dict(headers or {})
        self.name = f"remote({self.url})"
        if check_health:
            self.check_health()

    def health(self) -> dict:
        """The server's ``GET /health`` reply (a JSON object; RemoteRewardError if it is anything else)."""
        reply = request_json(self.url + "/health", None, timeout=self.timeout, retries=self.retries,
                             backoff=self.backoff, headers=self.headers)
        if not isinstance(reply, dict):
            raise RemoteRewardError(f"{self.url}/health: expected a JSON object, got {_preview(reply)}", self.url,
                                    reason=f"/health replied {_preview(reply)}, expected a JSON object")
        return reply

    def check_health(self) -> dict:
        """`health()`, raising `RemoteRewardUnreachableError` naming the url and the reason if it fails,
        and ValueError if the server serves a reward of another kind (image vs text)."""
        try:
            reply = self.health()
        except RemoteRewardError as exc:
            raise RemoteRewardUnreachableError(f"reward server {self.url} is not reachable: {exc.reason}",
                                               self.url, exc.status, reason=exc.reason) from None
        if reply.get("status", "ok") != "ok":
            raise RemoteRewardUnreachableError(f"reward server {self.url} is not healthy: /health replied "
                                               f"{_preview(reply)}", self.url)
        served = reply.get("kind")
        if served in ("image", "text") and not self._kind_given:
            self.kind = served
        elif served in ("image", "text") and served != self.kind:
            raise ValueError(f"reward server {self.url} serves a {served} reward ({reply.get('reward')!r}) but "
                             f"the client was built with kind={self.kind!r}; pass kind={served!r}")
        return reply

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None) -> RewardOutput:
        if images is None and completions is None:
            raise ValueError(f"reward '{self.name}': pass images=... or completions=[...]")
        encoded = None
        if images is not None:
            encoded = [encode_image_base64(t) for t in to_image_list(images)]
        n = len(encoded) if encoded is not None else len(completions)
        for what, seq in (("completions", completions), ("prompts", prompts), ("metadata", metadata)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"reward '{self.name}': got {n} inputs but {len(seq)} {what}; pass one per input")
        if n == 0:
            raise ValueError(f"reward '{self.name}': empty batch")
        return self._chunked(n, lambda s: self._score(encoded, prompts, metadata, completions, s))

    def _score(self, encoded, prompts, metadata, completions, s: slice) -> RewardOutput:
        payload: dict[str, Any] = {}
        for key, seq in (("images", encoded), ("prompts", prompts), ("metadata", metadata), ("completions", completions)):
            if seq is not None:
                payload[key] = list(seq[s])
        try:
            json.dumps(payload)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward '{self.name}': prompts/metadata/completions must be JSON-serialisable: {exc}") from None
        reply = request_json(self.url + "/score", payload, timeout=self.timeout, retries=self.retries,
                             backoff=self.backoff, headers=self.headers)
        scores = _validate_scores(reply, s.stop - s.start, self.url + "/score")
        details = reply.get("details")
        if details is not None and not isinstance(details, dict):
            raise RemoteRewardError(f"{self.url}/score: expected 'details' to be a JSON object, got "
                                    f"{_preview(details)}", self.url)
        details = {k: _from_json_detail(v) for k, v in (details or {}).items()}
        return RewardOutput(scores, details)


def _preview(v: Any, limit: int = 200) -> str:
    """Short description of a JSON value for error messages: type and (truncated) text."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text)} chars)"
    return f"{type(v).__name__} {text}"


def _validate_scores(reply: Any, n: int, url: str) -> torch.Tensor:
    """The reply's ``scores`` as a float32 tensor of shape [n], or RemoteRewardError saying what was expected
    and what came. JSON NaN/Infinity literals are numbers here (nan/inf): the recipes decide what to do."""
    expected = f"a JSON object with 'scores': a flat list of {n} number(s)"
    if not isinstance(reply, dict):
        raise RemoteRewardError(f"{url}: expected {expected}, got {_preview(reply)}", url)
    if "scores" not in reply:
        raise RemoteRewardError(f"{url}: expected {expected}, got an object without 'scores' "
                                f"(keys {sorted(reply)[:10]}): {_preview(reply)}", url)
    scores = reply["scores"]
    if not isinstance(scores, list):
        raise RemoteRewardError(f"{url}: expected 'scores' to be a flat list of {n} number(s), got "
                                f"{_preview(scores)}", url)
    if len(scores) != n:
        raise RemoteRewardError(f"{url}: expected {n} score(s), one per input, got {len(scores)}: "
                                f"{_preview(scores)}", url)
    for i, x in enumerate(scores):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise RemoteRewardError(f"{url}: expected scores[{i}] to be a number, got {_preview(x)} "
                                    f"(scores: {_preview(scores)})", url)
    return torch.tensor([_to_float(x) for x in scores], dtype=torch.float32)


def _to_float(x: int | float) -> float:
    try:
        return float(x)
    except OverflowError:  # an integer beyond float range: non-finite, like a JSON Infinity
        return math.copysign(math.inf, x)


def _from_json_detail(v: Any) -> Any:
    """Lists of numbers come back as float tensors (like local details); everything else as JSON."""
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return torch.tensor(v, dtype=torch.float32)
    return v


# ----------------------------------------------------------------------------------- server


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


def check_server_options(*, max_batch: Any = 64, max_wait_ms: Any = 5.0, max_body_mb: Any = 256.0,
                         max_pixels: Any = DEFAULT_MAX_PIXELS, read_timeout: Any = 30.0, backlog: Any = 128,
                         flags: bool = False) -> None:
    """ValueError naming the first bad server option (as ``--max-batch`` when `flags`, else ``max_batch``)."""
    def name(key: str) -> str:
        return "--" + key.replace("_", "-") if flags else key

    def number(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    for key, v in (("max_batch", max_batch), ("max_pixels", max_pixels), ("backlog", backlog)):
        if not (isinstance(v, numbers.Integral) and not isinstance(v, bool)) or v < 1:
            raise ValueError(f"{name(key)} must be an integer >= 1, got {v!r}")
    for key, v in (("read_timeout", read_timeout), ("max_body_mb", max_body_mb)):
        if not number(v) or v <= 0:
            raise ValueError(f"{name(key)} must be a number > 0, got {v!r}")
    if not number(max_wait_ms) or max_wait_ms < 0:
        raise ValueError(f"{name('max_wait_ms')} must be a number >= 0, got {max_wait_ms!r}")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # handler threads never keep the process alive


class RewardServer:
    """HTTP server around one reward model; see the module docstring for the protocol and the limits
    (`max_pixels` per image, `read_timeout` per socket operation, listen `backlog`)."""

    def __init__(self, reward: RewardModel, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
                 max_wait_ms: float = 5.0, max_body_mb: float = 256.0, quiet: bool = True,
                 max_pixels: int = DEFAULT_MAX_PIXELS, read_timeout: float = 30.0, backlog: int = 128):
        check_server_options(max_batch=max_batch, max_wait_ms=max_wait_ms, max_body_mb=max_body_mb,
                             max_pixels=max_pixels, read_timeout=read_timeout, backlog=backlog)
        self.reward = reward
        self.max_batch = int(max_batch)
        self.max_wait = float(max_wait_ms) / 1000.0
        self.max_body = int(max_body_mb * 1024 * 1024)
        self.max_pixels = int(max_pixels)
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
                tensors = [decode_image_base64(s, i, max_pixels=self.max_pixels)
                           for i, s in enumerate(fields["images"])]
            except ImageTooLargeError as exc:
                raise _BadRequest(413, str(exc)) from None
            except ValueError as exc:
                raise _BadRequest(400, str(exc)) from None
            sizes = sorted({tuple(t.shape[1:]) for t in tensors})
            if len(sizes) > 1:
                raise _BadRequest(400, f"images in one request must share a size, got {sizes}")
            images = torch.stack(tensors)
        return _Pending(images, fields["prompts"], fields["metadata"], fields["completions"], n)

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

            def do_GET(self):  # noqa: N802
                if self.path.rstrip("/") == "/health":
                    self._send(200, {"status": "ok", "reward": server.reward.name, "kind": server.reward.kind,
                                     "max_batch": server.max_batch})
                else:
                    self._send(404, {"error": f"unknown path {self.path!r}; use GET /health or POST /score"})

            def do_POST(self):  # noqa: N802
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
          read_timeout: float = 30.0, backlog: int = 128, max_body_mb: float = 256.0) -> RewardServer:
    """Serve `reward` on http://host:port. `block=True` serves until Ctrl-C; `block=False` starts a background
    thread and returns the `RewardServer` (``.url``, ``.shutdown()``). port=0 picks a free port."""
    server = RewardServer(reward, host=host, port=port, max_batch=max_batch, max_wait_ms=max_wait_ms, quiet=quiet,
                          max_pixels=max_pixels, read_timeout=read_timeout, backlog=backlog, max_body_mb=max_body_mb)
    if not block:
        return server.start()
    print(f"serving reward '{reward.name}' on {server.url} (POST /score, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return server
