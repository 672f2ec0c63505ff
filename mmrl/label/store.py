"""What `mmrl label` records: an append-only event log, and the preference file rebuilt from it.

``<out stem>.events.jsonl`` beside ``--out`` is the record: one JSON object per line, each written, flushed and
fsynced before the page is told it was recorded. ``label`` events carry everything of the choice (prompt, files in
the order shown, choice, session); ``undo`` retracts the newest choice of that session still in force. The state
(which items are decided) is the replay of the log, so a restart continues where the last one stopped.

``--out`` (Pick-a-Pic columns ``prompt, image_0, image_1, label_0`` as `load_preference_pairs` reads them, plus
``pair_id``, ``choice``, ``session``) is a view of that state, rewritten whole after every event (temporary file,
fsync, rename): undo must remove a row, which an append-only file cannot do, and a reader never sees half a file.
A crash between the log line and the rewrite loses nothing: the next start rewrites the file from the log.

A crash while a line was being written leaves a torn last line (no newline or not JSON): it is dropped with a
warning on the next start (the page never got an answer for it); a bad line before the last stops the start with its
line number, as nothing may be overwritten that cannot be read back.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

from mmrl.label.pairs import Item

CHOICES = ("tie", "skip")  # besides a sample's index (k = 2: "left" = 0, "right" = 1)


def log_path(out: Path) -> Path:
    return out.with_name(out.stem + ".events.jsonl")


def _fsync_write(path: Path, text: str) -> None:
    """`text` into `path` as one step: a reader (or a crash) sees the old file or the new one, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LabelStore:
    """The event log of `out` (opened and locked: one `mmrl label` per output file), its replayed state and the
    preference rows. Not thread-safe: the server calls it under its own lock."""

    def __init__(self, out: str | Path):
        self.out = Path(out).resolve()
        self.log = log_path(self.out)
        if self.out.exists() and not self.log.exists():
            raise ValueError(f"--out {out} exists and has no event log {self.log.name} beside it: it was not written "
                             f"by mmrl label, which would overwrite it; choose another --out")
        if not self.out.parent.is_dir():
            raise FileNotFoundError(f"--out {out}: folder {self.out.parent} does not exist")
        self._f = open(self.log, "a+b")
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.close()
            raise ValueError(f"another mmrl label is writing {self.log} (one labelling server per --out file); stop "
                             f"it or choose another --out") from None
        self.decided: dict[str, dict] = {}  # pair id -> its label event in force
        self.sessions: dict[str, list[str]] = {}  # session -> its choices in force, oldest first (undo pops)
        for event in self._read():
            self._apply(event)
        self.write_preferences()

    def close(self) -> None:
        self._f.close()  # releases the lock

    # ------------------------------------------------------------------ the log

    def _read(self) -> list[dict]:
        self._f.seek(0)
        data = self._f.read()
        lines = data.split(b"\n")
        tail = lines.pop()  # bytes after the last newline: b"" unless the last write was cut
        cut = len(tail)  # bytes to drop from the end
        events = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                if not isinstance(event, dict) or event.get("event") not in ("label", "undo"):
                    raise ValueError("not a label or undo event")
            except ValueError as exc:
                if i == len(lines) and not tail:  # the last line, complete but unreadable: torn too
                    cut = len(line) + 1
                    break
                raise ValueError(f"{self.log} line {i} is not a label event ({exc}); the log is the record of every "
                                 f"choice and is never rewritten: repair or move that line, then restart") from None
            events.append(event)
        if cut:
            print(f"mmrl label: warning: {self.log}: dropped a torn last line ({cut} bytes, written when the server "
                  f"stopped mid-write; that choice was never confirmed to the page)", file=sys.stderr)
            self._f.truncate(len(data) - cut)
            self._f.flush()
            os.fsync(self._f.fileno())
        return events

    def _append(self, event: dict) -> None:
        end = self._f.seek(0, os.SEEK_END)
        try:
            self._f.write((json.dumps(event, ensure_ascii=False) + "\n").encode("utf-8"))
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError:  # disk full, ...: the part written must not glue onto the next event
            self._f.truncate(end)
            raise

    def _apply(self, event: dict) -> None:
        pid, session = event.get("pair_id"), event.get("session", "")
        if event["event"] == "label":
            if pid not in self.decided:
                self.decided[pid] = event
                self.sessions.setdefault(session, []).append(pid)
        else:
            stack = self.sessions.get(session, [])
            if pid in stack:
                stack.remove(pid)
                self.decided.pop(pid, None)

    # ------------------------------------------------------------------ changes

    def record(self, item: Item, choice: int | str, session: str, lease: str = "") -> dict:
        event = {"event": "label", "pair_id": item.pair_id, "choice": choice, "session": session, "lease": lease,
                 "prompt": item.prompt, "files": [str(f) for f in item.files], "time": round(time.time(), 3)}
        self._append(event)
        self._apply(event)
        self.write_preferences()
        return event

    def undo(self, session: str) -> str | None:
        """Retract the newest choice of `session` still in force; its pair id (None: nothing to undo)."""
        stack = self.sessions.get(session)
        if not stack:
            return None
        event = {"event": "undo", "pair_id": stack[-1], "session": session, "time": round(time.time(), 3)}
        self._append(event)
        self._apply(event)
        self.write_preferences()
        return event["pair_id"]

    # ------------------------------------------------------------------ the preference file

    def _path(self, f: str) -> str:
        """Relative to the output file's folder when the sample is inside it (the folder can move), else absolute."""
        p = Path(f)
        return p.relative_to(self.out.parent).as_posix() if p.is_relative_to(self.out.parent) else str(p)

    def rows(self) -> list[dict]:
        out = []
        for pid, e in self.decided.items():
            files, choice = [self._path(f) for f in e["files"]], e["choice"]
            if choice == "skip":
                continue
            base = {"prompt": e["prompt"], "pair_id": pid, "choice": choice, "session": e["session"]}
            if choice == "tie":  # the first sample against each other one, no preference (the DPO loader drops it)
                out += [{**base, "image_0": files[0], "image_1": f, "label_0": 0.5} for f in files[1:]]
            else:  # the chosen sample against each other one
                out += [{**base, "image_0": files[choice], "image_1": f, "label_0": 1}
                        for j, f in enumerate(files) if j != choice] if len(files) > 2 else \
                       [{**base, "image_0": files[0], "image_1": files[1], "label_0": 1 if choice == 0 else 0}]
        return out

    def write_preferences(self) -> None:
        _fsync_write(self.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.rows()))

    def counts(self) -> dict:
        skipped = sum(1 for e in self.decided.values() if e["choice"] == "skip")
        return {"labelled": len(self.decided) - skipped, "skipped": skipped}
