"""The `mmrl label` subcommand (registered by `mmrl.cli.build_parser`):

    mmrl label SOURCE --out preferences.jsonl [--host 127.0.0.1] [--port 0] [--token T] [--k 2] [--lease-seconds S]
"""

from __future__ import annotations

import argparse
import signal
from urllib.parse import quote

from mmrl.http_auth import token_from_env

__all__ = ["add_label_subparser", "cmd_label"]


def cmd_label(args: argparse.Namespace) -> int:
    from mmrl.label.pairs import build_queue
    from mmrl.label.server import TOKEN_ENV, LabelServer, check_access

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0 = any free port), got {args.port}")
    token = token_from_env(args.token, TOKEN_ENV)
    check_access(args.host, token, args.lease_seconds)  # before the samples are read and hashed
    items = build_queue(args.source, args.k)
    try:
        server = LabelServer(items, args.out, host=args.host, port=args.port, token=token,
                             lease_seconds=args.lease_seconds, quiet=not args.verbose)
    except (OSError, OverflowError) as exc:
        raise ValueError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    with server.lock:
        p = server.progress()
    print(f"mmrl label: {p['total']} items from {args.source} ({p['labelled']} labelled, {p['skipped']} skipped, "
          f"{p['remaining']} to go) -> {server.store.out}", flush=True)
    print(f"open {server.url}" + (f"?token={quote(token, safe='')}" if token else "") +
          "  (Ctrl-C stops; rerun to continue)",
          flush=True)
    # Ctrl-C and `kill` stop it the same clean way, also when started from a script's background job (a shell
    # without job control starts those with SIGINT ignored, and Python then keeps ignoring it)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        with server.lock:
            p = server.progress()
        server.shutdown()
    print(f"mmrl label: stopped with {p['labelled']} labelled, {p['skipped']} skipped, {p['remaining']} to go; "
          f"pairs in {server.store.out}", flush=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def add_label_subparser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("label", help="a local web page to pick the better of a prompt's samples; writes preference "
                                     "pairs (prompt, image_0, image_1, label_0) for Diffusion-DPO")
    p.add_argument("source", help="a folder of images/videos (grouped by prompts.jsonl or by file name), an mmrl eval "
                                  "folder, or a run directory with eval/ folders (docs/labeling.md)")
    p.add_argument("--out", required=True, help="the preference file (.jsonl) to write; its event log "
                                                 "<name>.events.jsonl goes beside it; rerun with the same --out to "
                                                 "continue")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only; any "
                                                       "other needs --token)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port; the URL is printed)")
    p.add_argument("--token", default=None, help="a token the page's URL carries and scripts send as 'Authorization: "
                                                 "Bearer TOKEN'; default $MMRL_LABEL_TOKEN; unset = no check "
                                                 "(loopback only)")
    p.add_argument("--k", type=int, default=2, help="samples shown side by side (default 2; more: the best one is "
                                                    "paired with each other one)")
    p.add_argument("--lease-seconds", type=float, default=300.0,
                   help="how long a tab holds its item before another tab may get it (a closed tab's item returns "
                        "after this; default 300)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.set_defaults(func=cmd_label)
    return p
