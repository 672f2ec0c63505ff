"""The labelling server behind `mmrl label`: the page and its JSON API on the stdlib ``ThreadingHTTPServer``.

    GET  /                     the page (with ?token=T: sets the token cookie and redirects to /)
    GET  /api/next?session=S   an item no one has decided and no other tab holds: {pair_id, prompt, media, lease, ...}
    POST /api/label            {"pair_id", "choice": "left"|"right"|0..k-1|"tie"|"skip", "lease"}
    POST /api/undo             {"session"}: retracts that session's newest choice and hands its item back
    GET  /api/progress         {labelled, skipped, total, remaining}
    GET  /media/<pair_id>/<i>  sample i of a queued item (files are found by id, never by a path from the request)

A lease (a random token, `lease_seconds` long) hands an item to one session (a browser tab): two tabs never get the
same item while the lease runs; a closed tab's item returns to the queue when it expires. A label is accepted with
the newest lease of its item, also after expiry as long as no other tab took the item. Errors are one-line JSON
``{"error": ...}``: 404 unknown pair id or path, 409 an item already decided (the same request again, a replay, is
answered 200 without a second row) or a lease that is not the item's, 400 bad fields, 401 no token.

Access: bound to loopback by default; any other address needs a token (refused otherwise), sent as
``Authorization: Bearer T`` (scripts) or the cookie the page gets from ``/?token=T``; compared in constant time
(`mmrl.http_auth`). POSTs must be ``Content-Type: application/json``, which a cross-site form cannot send.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import shutil
import sys
import threading
import time
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from mmrl.http_auth import BearerToken, check_token, is_loopback
from mmrl.label.pairs import Item
from mmrl.label.store import CHOICES, LabelStore

TOKEN_ENV = "MMRL_LABEL_TOKEN"
COOKIE = "mmrl_label_token"
MAX_BODY = 64 * 1024
_SESSION = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))  # str operands must be ASCII: bytes take any


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # handler threads never keep the process alive


def check_access(host: str, token: str | None, lease_seconds: float = 300.0) -> None:
    """ValueError for a server other machines could use without a token (and for bad options)."""
    check_token(token, "--token")
    if token is None and not is_loopback(str(host)):
        raise ValueError(f"--host {host} lets other machines reach the page: pass --token (or set {TOKEN_ENV}), "
                         f"or keep the default --host 127.0.0.1")
    if not (isinstance(lease_seconds, (int, float)) and lease_seconds > 0):
        raise ValueError(f"--lease-seconds must be a number > 0, got {lease_seconds!r}")


class LabelServer:
    """Serves `items` for labelling into `out` (see the module docstring). `port=0` picks a free port."""

    def __init__(self, items: list[Item], out: str | Path, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, lease_seconds: float = 300.0, quiet: bool = True):
        check_access(host, token, lease_seconds)
        self.items = {it.pair_id: it for it in items}
        self.order = [it.pair_id for it in items]
        self.auth = BearerToken(token)
        self.lease_seconds = float(lease_seconds)
        self.quiet = quiet
        self.leases: dict[str, tuple[str, str, float]] = {}  # pair id -> (lease token, session, expiry)
        self.lock = threading.Lock()
        self.page = resources.files("mmrl.label").joinpath("page.html").read_bytes()
        self.store = LabelStore(out)
        try:
            self.httpd = _HTTPServer((host, int(port)), self._handler_class())
        except BaseException:
            self.store.close()
            raise
        self.host, self.port = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> "LabelServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="label-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.store.close()

    def __enter__(self) -> "LabelServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ state (called under self.lock)

    def progress(self) -> dict:
        decided = [self.store.decided[p]["choice"] for p in self.order if p in self.store.decided]
        skipped = sum(1 for c in decided if c == "skip")
        return {"labelled": len(decided) - skipped, "skipped": skipped, "total": len(self.order),
                "remaining": len(self.order) - len(decided)}

    def _lease(self, pid: str, session: str) -> dict:
        for other in [p for p, (_, s, _) in self.leases.items() if s == session and p != pid]:
            del self.leases[other]  # a session holds one item at a time
        held = self.leases.get(pid)
        token = held[0] if held and held[1] == session else secrets.token_urlsafe(16)
        self.leases[pid] = (token, session, time.monotonic() + self.lease_seconds)
        it = self.items[pid]
        return {"pair_id": pid, "prompt": it.prompt, "k": len(it.files), "lease": token,
                "media": [f"/media/{pid}/{i}" for i in range(len(it.files))],
                "kinds": [it.media_type(i).split("/")[0] for i in range(len(it.files))],
                "lease_seconds": self.lease_seconds, "progress": self.progress()}

    def next_item(self, session: str) -> dict:
        now = time.monotonic()
        mine = [p for p, (_, s, expiry) in self.leases.items()
                if s == session and expiry > now and p not in self.store.decided]
        if mine:  # a reloaded tab gets its item back
            return self._lease(mine[0], session)
        held = 0
        for pid in self.order:
            if pid in self.store.decided:
                continue
            lease = self.leases.get(pid)
            if lease and lease[1] != session and lease[2] > now:
                held += 1
                continue
            return self._lease(pid, session)
        return {"pair_id": None, "held_by_other_tabs": held, "progress": self.progress()}

    def label(self, body: dict) -> tuple[int, dict]:
        pid, lease, choice = body.get("pair_id"), body.get("lease"), body.get("choice")
        if not isinstance(pid, str) or pid not in self.items:
            raise _Refused(404, f"unknown pair id {pid!r}: label items handed out by GET /api/next")
        it = self.items[pid]
        k = len(it.files)
        named = {"left": 0, "right": 1} if k == 2 else {}
        choice = named.get(choice, choice)
        if not (choice in CHOICES or (isinstance(choice, int) and not isinstance(choice, bool) and 0 <= choice < k)):
            raise _Refused(400, f"choice must be {'left, right, ' if k == 2 else ''}0..{k - 1}, tie or skip, got "
                                f"{body.get('choice')!r}")
        if not isinstance(lease, str):
            raise _Refused(400, "lease missing: send the lease GET /api/next gave with this pair")
        done = self.store.decided.get(pid)
        if done is not None:
            if _same(done.get("lease", ""), lease) and done["choice"] == choice:
                return 200, {"recorded": False, "already_recorded": True, "progress": self.progress()}
            raise _Refused(409, f"pair {pid} is already labelled ({done['choice']}); undo it first (POST /api/undo "
                                f"from the session that labelled it)")
        held = self.leases.get(pid)
        if held is None or not _same(held[0], lease):
            raise _Refused(409, f"lease is not valid for pair {pid}: the pair was handed to another tab (after this "
                                f"lease expired) or never to this one; GET /api/next for a pair")
        self.store.record(it, choice, held[1], lease)
        del self.leases[pid]
        return 200, {"recorded": True, "progress": self.progress()}

    def undo(self, body: dict) -> dict:
        session = body.get("session")
        if not isinstance(session, str) or not _SESSION.fullmatch(session):
            raise _Refused(400, "session missing or malformed: 1-64 characters of A-Z a-z 0-9 _ -")
        pid = self.store.undo(session)
        if pid is None:
            return {"undone": None, "progress": self.progress()}
        if pid not in self.items:  # labelled from another source: no longer in this queue
            return {"undone": pid, "progress": self.progress()}
        return {"undone": pid, "item": self._lease(pid, session), "progress": self.progress()}

    # ------------------------------------------------------------------ HTTP

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "mmrl-label/1"
            timeout = 30  # a stalled client ends its handler thread

            def log_message(self, fmt, *args):  # noqa: N802 - stdlib name
                if not server.quiet:
                    super().log_message(fmt, *args)

            def _send(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.send_header("Cache-Control", "no-store")
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client went away
                    self.close_connection = True

            def _json(self, status: int, obj: Any) -> None:
                self._send(status, json.dumps(obj).encode("utf-8"), "application/json")

            def _authorized(self) -> bool:
                if not server.auth.required or server.auth.matches(self.headers.get("Authorization")):
                    return True
                try:
                    cookie = SimpleCookie(self.headers.get("Cookie") or "").get(COOKIE)
                except CookieError:
                    cookie = None
                return cookie is not None and server.auth.matches(unquote(cookie.value), bare=True)

            def do_GET(self):  # noqa: N802
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                if url.path == "/" and "token" in query and server.auth.required:
                    if not server.auth.matches(query["token"][0], bare=True):
                        return self._json(401, {"error": "wrong token in the address; use the URL mmrl label printed"})
                    return self._send(303, b"", "text/plain", {  # the token leaves the address bar and history
                        "Location": "/", "Set-Cookie": f"{COOKIE}={quote(query['token'][0], safe='')}; HttpOnly; "
                                                        f"SameSite=Strict; Path=/"})
                if not self._authorized():
                    return self._json(401, {"error": "missing or wrong token: open the URL mmrl label printed "
                                                     "(/?token=...), or send 'Authorization: Bearer <token>'"})
                try:
                    if url.path == "/":
                        return self._send(200, server.page, "text/html; charset=utf-8")
                    if url.path == "/api/progress":
                        with server.lock:
                            return self._json(200, server.progress())
                    if url.path == "/api/next":
                        session = (query.get("session") or [""])[0]
                        if not _SESSION.fullmatch(session):
                            raise _Refused(400, "session missing or malformed: /api/next?session=ID (1-64 characters "
                                                "of A-Z a-z 0-9 _ -, one per tab or script)")
                        with server.lock:
                            return self._json(200, server.next_item(session))
                    if url.path.startswith("/media/"):
                        return self._media(url.path)
                    raise _Refused(404, f"unknown path {url.path!r}")
                except _Refused as exc:
                    self._json(exc.status, {"error": str(exc)})

            def _media(self, path: str) -> None:
                # /media/<pair id>/<index>: both looked up in the queue, so no request names a file
                parts = path.split("/")
                it = server.items.get(parts[2]) if len(parts) == 4 else None
                if it is None or not parts[3].isdigit() or int(parts[3]) >= len(it.files):
                    raise _Refused(404, f"no such sample {path!r}: media are /media/<pair id>/<0..k-1> of queued pairs")
                f = it.files[int(parts[3])]
                try:
                    fh = open(f, "rb")
                except OSError as exc:
                    raise _Refused(404, f"sample file unreadable: {f.name} ({exc.strerror})") from None
                with fh:
                    size = f.stat().st_size
                    try:
                        self.send_response(200)
                        self.send_header("Content-Type", it.media_type(int(parts[3])))
                        self.send_header("Content-Length", str(size))
                        self.send_header("Cache-Control", "private, max-age=3600")
                        self.end_headers()
                        shutil.copyfileobj(fh, self.wfile)
                    except OSError:
                        self.close_connection = True

            def do_POST(self):  # noqa: N802
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit() or int(length) > MAX_BODY:
                    self.close_connection = True  # an unread body must not be parsed as the next request
                    return self._json(411 if length is None else 413,
                                      {"error": f"a JSON body of at most {MAX_BODY} bytes with Content-Length"})
                body = self.rfile.read(int(length))
                if not self._authorized():
                    return self._json(401, {"error": "missing or wrong token: send 'Authorization: Bearer <token>'"})
                try:
                    if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                        raise _Refused(415, "Content-Type must be application/json")
                    try:
                        obj = json.loads(body)
                    except (ValueError, UnicodeDecodeError) as exc:
                        raise _Refused(400, f"body is not valid JSON: {exc}") from None
                    if not isinstance(obj, dict):
                        raise _Refused(400, f"body must be a JSON object, got {type(obj).__name__}")
                    path = urlsplit(self.path).path
                    with server.lock:
                        if path == "/api/label":
                            return self._json(*server.label(obj))
                        if path == "/api/undo":
                            return self._json(200, server.undo(obj))
                    raise _Refused(404, f"unknown path {path!r}; POST /api/label or /api/undo")
                except _Refused as exc:
                    self._json(exc.status, {"error": str(exc)})
                except OSError as exc:  # the log or the preference file could not be written: nothing recorded
                    print(f"mmrl label: error: {exc}", file=sys.stderr, flush=True)
                    self._json(500, {"error": f"could not record: {exc}"})

        return Handler
