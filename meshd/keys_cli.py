"""``meshd keys``: make a mesh key, and rotate the keyring of a running mesh.

    meshd keys generate --out PATH
    meshd keys install|use|remove KEY --url URL [--token T] [--timeout S]

KEY is a key (base64), a key file (its first key), or, for ``use`` and
``remove``, a key id.  A rotation step is POSTed to one node's dashboard
(``/api/keys``), which applies it and gossips it to every member; then the
command watches ``GET /api/keys`` on that node until every live member's
metadata (alive or suspect: not dead, not gone) shows the step done, printing
progress as members catch up.  The order is install (every member holds the
new key), use (every member seals with it), remove (nobody holds the old one):
each step starts only once the one before it is done everywhere, so no member
ever receives a packet it cannot open.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .keyring import KeyringError, change_done, encode_key, generate_file, load, parse_change

TOKEN_ENV = "MESHD_DASHBOARD_TOKEN"  # as dashboard.guard names it
POLL_S = 0.5
LIVE = ("alive", "suspect")  # members that must catch up: a suspect one may well be alive
REQUEST_TIMEOUT_S = 5.0

PROGRESS = {"install": "hold key {kid}", "use": "seal with key {kid}", "remove": "have dropped key {kid}"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser(
        "keys", help="make a mesh key; rotate the keyring of a running mesh",
        description="Make a mesh key, or rotate a running mesh's keyring with no downtime: install the "
                    "new key, use it, remove the old one, each step waited for on every live member.")
    steps = keys.add_subparsers(dest="keys_command", metavar="STEP", required=True)
    gen = steps.add_parser("generate", help="write a new mesh key file (mode 0600)",
                           description="Write a key file holding one new mesh key; prints its id.")
    gen.add_argument("--out", required=True, metavar="PATH", help="the new key file (never overwritten)")
    gen.set_defaults(func=_cmd_generate)
    for op, what in (("install", "every member adds KEY to its keyring (it opens packets with it)"),
                     ("use", "every member seals with KEY (install it everywhere first)"),
                     ("remove", "every member drops KEY (use another key everywhere first)")):
        step = steps.add_parser(op, help=what, description=f"{what[0].upper()}{what[1:]}; then wait "
                                "until every live member reports it done.")
        step.add_argument("key", metavar="KEY",
                          help="a key (base64), a key file (its first key)"
                               + ("" if op == "install" else ", or a key id"))
        step.add_argument("--url", required=True, metavar="URL",
                          help="a node's dashboard, e.g. http://127.0.0.1:8080")
        step.add_argument("--token", metavar="T",
                          help=f"the node's dashboard token (default: URL?token=T or ${TOKEN_ENV})")
        step.add_argument("--timeout", type=float, default=60.0, metavar="S",
                          help="give up after S seconds, naming the members behind (default %(default)g)")
        step.set_defaults(func=_cmd_step, op=op)


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    try:
        ring = generate_file(args.out)
    except KeyringError as exc:
        print(f"meshd keys: {exc}", file=sys.stderr)
        return 2
    print(f"meshd keys: new mesh key {ring.primary_id} in {args.out}", flush=True)
    return 0


class KeysError(Exception):
    """The dashboard could not be asked, or refused; the message says which and why."""


def read_key_arg(op: str, text: str) -> tuple[str, str]:
    """``(key id, what to POST)`` for KEY: the key itself for install, its id otherwise, so a
    key only travels where it must.  A KEY naming a file means that file's first key."""
    if os.path.isfile(text):
        text = encode_key(load(text).primary_key)
    kid, key = parse_change(op, text)
    return kid, encode_key(key) if op == "install" else kid


def _cmd_step(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    op = args.op
    try:
        kid, body_key = read_key_arg(op, args.key)
    except KeyringError as exc:
        print(f"meshd keys {op}: {exc}", file=sys.stderr)
        return 2
    base, token = _dashboard(args.url, args.token)
    try:
        _request("POST", f"{base}/api/keys", token, {"op": op, "key": body_key})
    except KeysError as exc:
        print(f"meshd keys {op}: {exc}", file=sys.stderr)
        return 2
    return watch(base, token, op, kid, args.timeout)


def watch(base: str, token: str | None, op: str, kid: str, timeout: float) -> int:
    """Poll ``GET /api/keys`` until every live member has done ``op`` on key ``kid``; prints
    progress as it changes.  0 when done, 1 on timeout (naming who is behind)."""
    said = PROGRESS[op].format(kid=kid)
    deadline = time.monotonic() + timeout
    last_line, behind, error = None, [], None
    while True:
        try:
            view = _request("GET", f"{base}/api/keys", token)
        except KeysError as exc:
            error = str(exc)  # the node may be busy or restarting: keep asking until the deadline
        else:
            error = None
            live = [m for m in view.get("members", []) if m.get("state") in LIVE]
            behind = [m for m in live if not change_done(op, kid, m.get("keyring") or [])]
            line = f"{len(live) - len(behind)}/{len(live)} members {said}"
            if line != last_line:
                print(line, flush=True)
                last_line = line
            if live and not behind:
                print(f"meshd keys {op}: done", flush=True)
                return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if error is not None:
        why = f"the node stopped answering: {error}"
    else:
        why = "not yet: " + ", ".join(f"{m.get('name')} ({m.get('prefix')}, keys "
                                      f"{','.join(m.get('keyring') or []) or 'none'})" for m in behind)
    print(f"meshd keys {op}: timed out after {timeout:g}s; {last_line or 'no answer'}; {why}",
          file=sys.stderr, flush=True)
    return 1


def _dashboard(url: str, token: str | None) -> tuple[str, str | None]:
    """The dashboard's base URL and the token to send (flag, ``?token=``, or the environment)."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    token = token or (parse_qs(parts.query).get("token") or [os.environ.get(TOKEN_ENV, "")])[0] or None
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}", token


def _request(method: str, url: str, token: str | None, body: dict | None = None) -> Any:
    import httpx

    headers = {"X-Meshd-Token": token} if token else {}
    try:
        r = httpx.request(method, url, json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise KeysError(f"cannot reach {url}: {exc}") from exc
    if r.status_code == 401:
        raise KeysError(f"{url} wants the node's token (printed when it starts): --token T, URL?token=T "
                        f"or {TOKEN_ENV}=T")
    try:
        answer = r.json()
    except ValueError:
        raise KeysError(f"{url} answered {r.status_code} without JSON: {r.text[:200]}") from None
    if r.status_code >= 400:
        message = answer.get("error") if isinstance(answer, dict) else None
        raise KeysError(f"{url} refused ({r.status_code}): {message or r.text[:200]}")
    return answer

