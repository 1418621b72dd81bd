"""How meshd writes: the contract's event lines on stdout, everything else through logging on stderr.

Event lines (``meshd node …``, ``meshd stage-map …``, ``meshd member …``, ``meshd
path …``) are what users' scripts and the tests match from the start of the
line: they stay exactly as the contract writes them.  Every other message goes
through :mod:`logging`, one line each with its time (UTC), level, the node's run
name and prefix, and the logger:

    2026-12-01T21:04:33.512Z INFO stage-1 3f0c9e21 meshd.relay.client: relay ws://r:3478: connected …

``--log-format json`` turns both into JSON lines: an event line becomes
``{"ts", "event", "line", ..its key=value fields}`` on stdout, a log record
``{"ts", "level", "node", "prefix", "logger", "message"}`` on stderr.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

FORMATS = ("text", "json")


class _Context(logging.Filter):
    """The node this process runs, stamped on every record (``-`` until it is known)."""

    def __init__(self) -> None:
        super().__init__()
        self.node, self.prefix = "-", "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.node, record.prefix = self.node, self.prefix
        return True


CONTEXT = _Context()
_json = False


def _utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class _Text(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (f"{_utc(record.created)} {record.levelname} {getattr(record, 'node', '-')} "
                f"{getattr(record, 'prefix', '-')} {record.name}: {record.getMessage()}")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _utc(record.created), "level": record.levelname,
                               "node": getattr(record, "node", "-"), "prefix": getattr(record, "prefix", "-"),
                               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(verbose: bool = False, fmt: str = "text") -> None:
    """One handler on stderr for every logger: meshd's at INFO (DEBUG with ``verbose``),
    the libraries' at WARNING."""
    global _json
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    _json = fmt == "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(CONTEXT)
    handler.setFormatter(_Json() if _json else _Text())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger("meshd").setLevel(logging.DEBUG if verbose else logging.INFO)


def set_node(name: str, prefix: str) -> None:
    """Name the node in every later log line (``stage-1``, ``3f0c9e21``)."""
    CONTEXT.node, CONTEXT.prefix = name, prefix


def event(line: str) -> None:
    """An event line on stdout: as the contract writes it, or as a JSON line.  A stdout that
    is gone (its terminal closed: EIO; its reader left: EPIPE) loses the line, never the
    node, which goes on serving or leaving."""
    if _json:
        words = line.split()
        out: dict[str, Any] = {"ts": _utc(time.time()), "event": words[1] if len(words) > 1 else "",
                               "line": line}
        for word in words[2:]:
            key, sep, value = word.partition("=")
            if sep and key not in out:
                out[key] = value
        line = json.dumps(out)
    try:
        print(line, flush=True)
    except OSError:
        pass


class Quieted:
    """A log line per key (a sender, a source address) at most once per ``interval`` seconds;
    the ones held back in between are counted and said with the next.  For what anyone on
    the network can cause as fast as it sends: one line per packet would fill the disk.
    Remembers at most ``keys`` keys, the oldest dropped first."""

    def __init__(self, interval: float = 60.0, keys: int = 1024) -> None:
        self.interval = interval
        self.keys = keys
        self._seen: dict[Any, tuple[float, int]] = {}  # key -> (last logged, held back since)

    def due(self, key: Any, now: float) -> int | None:
        """None when a line for ``key`` was logged within the interval (this one is counted);
        else how many were held back since that line, and this one is to be logged."""
        last, held = self._seen.pop(key, (-self.interval, 0))
        if now - last < self.interval:
            self._seen[key] = (last, held + 1)
            return None
        self._seen[key] = (now, 0)  # last: the oldest key goes first
        while len(self._seen) > self.keys:
            del self._seen[next(iter(self._seen))]
        return held
