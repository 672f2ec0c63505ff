"""Serve a reward model over HTTP/JSON and call it from another process (no pickle anywhere).

Server (stdlib ``ThreadingHTTPServer``)::

    serve(load("pickscore", weights=...), host="127.0.0.1", port=8008)   # blocks; block=False -> RewardServer

    GET  /health -> {"status": "ok", "reward": name, "kind": "image"|"text", "max_batch": 64, "max_pixels": ...,
                     "max_request_pixels": ...}
    POST /score  {"images": [base64 PNG, ...], "prompts": [...], "metadata": [{...}], "completions": [...]}
              -> {"scores": [float, ...], "details": {key: JSON value}}

Every field but one of ``images`` / ``completions`` is optional; lists must all have one entry per sample.
Errors are JSON ``{"error": message}``: 400 bad JSON / base64 / not an image / count mismatch / bad input
to the reward (its ValueError), 401 missing or wrong token (when the server has one), 404 unknown path,
408 request body stalled longer than ``read_timeout``, 411 no Content-Length, 413 batch larger than
``max_batch``, body larger than ``max_body_mb``, an image larger than ``max_pixels`` or images larger than
``max_request_pixels`` together (width * height, read from the image headers before any pixel is decoded;
PIL's own decompression-bomb limit, ``2 * Image.MAX_IMAGE_PIXELS``, also answers 413), 500 model failure.

Shared token (optional): ``serve(..., token=T)`` / ``mmrl reward serve --token T`` (or ``$MMRL_REWARD_TOKEN``)
makes every request, ``/health`` included, carry ``Authorization: Bearer T`` (compared in constant time); others
get 401 and their body is not read. The client sends ``token=`` or ``$MMRL_REWARD_TOKEN``. A server bound beyond
localhost without a token warns at start. The token is not encryption: over plain HTTP anyone on the path can
read it; beyond a trusted network, put the server behind TLS (e.g. an SSH tunnel or a reverse proxy).

Bounded resources: ``max_pixels`` (default 4096 * 4096) caps the memory one decoded image can take and
``max_request_pixels`` (default 4 * 4096 * 4096: 64 images of 1024x1024, 0.8 GB as float32) what one request can;
``read_timeout`` (default 30 s) is the socket timeout of each connection, so a client that sends headers
and then stalls (or keeps an idle keep-alive connection) frees its handler thread after that long; the
listen ``backlog`` (default 128) holds bursts of concurrent connections without resets.

Request batching: handler threads decode requests in parallel and put them on a queue; one worker thread
takes the first request, waits up to ``max_wait_ms`` for more requests with the same fields and image
size, scores them in one model call (at most ``max_batch`` samples) and splits the scores and per-sample
details back. A merged call that fails is retried request by request so one bad request fails alone.
The worker is the only thread that calls the model, so the model need not be thread-safe.

Client: ``RemoteReward(url, timeout=30, retries=3, backoff=0.5, check_health=True, token=None)`` (``load("remote",
url=...)``) calls ``GET /health`` when it is built (so a recipe that loads its rewards before its model fails
before the model loads: "reward server URL is not reachable: <reason>"; ``check_health=False`` skips it), takes
the server's ``max_request_pixels`` from that reply to split large batches into requests the server accepts, and
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

Modules: this one (the client: ``RemoteReward``, ``request_json``, the errors), ``remote_server.py`` (``serve``,
``RewardServer``), ``remote_codec.py`` (base64 PNG images, JSON details); all names are importable from here.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, concat_outputs, register, to_image_list
from mmrl.rewards.remote_codec import ImageTooLargeError, decode_image_base64, encode_image_base64, to_jsonable
from mmrl.rewards.remote_server import (DEFAULT_MAX_PIXELS, DEFAULT_MAX_REQUEST_PIXELS, TOKEN_ENV,  # noqa: F401
                                        RewardServer, check_server_options, serve, token_from_env)

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
    differs from the served one is a ValueError. `token` (default: $MMRL_REWARD_TOKEN) is sent as
    ``Authorization: Bearer <token>`` to a server started with one. Image batches are split into requests of at
    most `batch_size` images and at most the server's ``max_request_pixels`` (from /health) pixels.

    Instead of `url`: `env` (a reward env: `mmrl reward env create`, a name under `env_dir` / $MMRL_REWARD_ENV_DIR /
    runs/reward-envs, or a path) and `serve` ({name: REWARD, kw: {...}, weights, device, max_batch,
    startup_timeout}) start that server here (`mmrl.rewards.env_server`); `close()` or the end of the run stops it."""

    name = "remote"

    def __init__(self, url: str | None = None, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
                 batch_size: int = 64, kind: str | None = None, headers: dict[str, str] | None = None,
                 device: Any = None, check_health: bool = True, token: str | None = None, env: str | None = None,
                 serve: Any = None, env_dir: str | None = None):
        self.server = None
        if kind not in ("image", "text", None):
            raise ValueError(f"remote reward kind must be 'image' or 'text', got {kind!r}")
        if env is not None or serve is not None:
            if url is not None:
                raise ValueError("remote reward: give url= (a server you started) or env= with serve= (a server "
                                 "the run starts in a reward env), not both")
            if env is None or serve is None:
                raise ValueError("remote reward: env= and serve= go together: env names the reward env (`mmrl "
                                 "reward env list`), serve = {name: REWARD, kw: {...}} what it serves")
            from mmrl.rewards.env_server import EnvServer

            self.server = EnvServer(env, serve, env_dir=env_dir, device=device)
            url, token = self.server.url, self.server.token
        if url is None:
            raise ValueError("remote reward: pass url= (a running `mmrl reward serve`) or env= with serve= (a reward "
                             "env the run serves it from)")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.batch_size = int(batch_size)
        self.kind = kind or "image"
        self._kind_given = kind is not None
        token = token_from_env(token)
        self.headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **dict(headers or {})}
        self.max_request_pixels: int | None = None  # the server's, from /health
        self.name = f"remote({self.url})"
        if check_health:
            try:
                self.check_health()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Stop the server this client started in a reward env (nothing for a `url=` server)."""
        if self.server is not None:
            self.server.close()

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
            if exc.status == 401:
                raise RemoteRewardUnreachableError(
                    f"reward server {self.url} refused the token ({exc.reason}); set {TOKEN_ENV} (or the remote "
                    "reward's token=) to the server's token", self.url, exc.status, reason=exc.reason) from None
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
        limit = reply.get("max_request_pixels")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            self.max_request_pixels = limit
        return reply

    def __call__(self, images: Any = None, prompts: Sequence[str] | None = None,
                 metadata: Sequence[dict] | None = None, completions: Sequence[str] | None = None) -> RewardOutput:
        if images is None and completions is None:
            raise ValueError(f"reward '{self.name}': pass images=... or completions=[...]")
        encoded, per_request = None, self.batch_size
        if images is not None:
            tensors = to_image_list(images)
            encoded = [encode_image_base64(t) for t in tensors]
            pixels = max((t.shape[-1] * t.shape[-2] for t in tensors), default=1)
            if self.max_request_pixels is not None:  # what the server decodes per request
                per_request = max(1, min(per_request, self.max_request_pixels // pixels))
        n = len(encoded) if encoded is not None else len(completions)
        for what, seq in (("completions", completions), ("prompts", prompts), ("metadata", metadata)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"reward '{self.name}': got {n} inputs but {len(seq)} {what}; pass one per input")
        if n == 0:
            raise ValueError(f"reward '{self.name}': empty batch")
        bs = max(1, int(per_request or n))
        return concat_outputs([self._score(encoded, prompts, metadata, completions, slice(i, min(n, i + bs)))
                               for i in range(0, n, bs)])

    def _score(self, encoded, prompts, metadata, completions, s: slice) -> RewardOutput:
        payload: dict[str, Any] = {}
        for key, seq in (("images", encoded), ("prompts", prompts), ("metadata", metadata), ("completions", completions)):
            if seq is not None:
                payload[key] = list(seq[s])
        try:
            json.dumps(payload)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward '{self.name}': prompts/metadata/completions must be JSON-serialisable: {exc}") from None
        if self.server is not None and (death := self.server.death()):  # no retries against a dead process
            raise RemoteRewardError(death, self.url)
        try:
            reply = request_json(self.url + "/score", payload, timeout=self.timeout, retries=self.retries,
                                 backoff=self.backoff, headers=self.headers)
        except RemoteRewardError as exc:
            if self.server is not None and (death := self.server.death()):
                raise RemoteRewardError(f"{death}; the request failed: {exc.reason}", self.url) from None
            raise
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
