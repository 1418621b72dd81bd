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

from .argtypes import path, positive_float
from .dashboard_client import TOKEN_ENV, NodeError, ask_node, dashboard_base, json_kind
from .keyring import (
    KEY_BYTES,
    KEY_ID_BYTES,
    KeyringError,
    change_done,
    encode_key,
    generate_file,
    load,
    parse_change,
)

POLL_S = 0.5
LIVE = ("alive", "suspect")  # members that must catch up: a suspect one may well be alive
REQUEST_TIMEOUT_S = 5.0  # for each request, all told: connecting, sending, reading the whole answer

PROGRESS = {"install": "hold key {kid}", "use": "seal with key {kid}", "remove": "have dropped key {kid}"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser(
        "keys", help="make a mesh key; rotate the keyring of a running mesh",
        description="Make a mesh key, or rotate a running mesh's keyring with no downtime: install the "
                    "new key, use it, remove the old one, each step waited for on every live member.")
    steps = keys.add_subparsers(dest="keys_command", metavar="STEP", required=True)
    gen = steps.add_parser("generate", help="write a new mesh key file (mode 0600)",
                           description="Write a key file holding one new mesh key; prints its id.")
    gen.add_argument("--out", type=path, required=True, metavar="PATH",
                     help="the new key file (never overwritten)")
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
        step.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
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


class NotANode(KeysError):
    """The URL answered, but not as a meshd node's dashboard: asking again will not help."""


def read_key_arg(op: str, text: str) -> tuple[str, str]:
    """``(key id, what to POST)`` for KEY: the key itself for install, its id otherwise, so a
    key only travels where it must.  A KEY naming a file means that file's first key; one
    that names nothing and is not shaped like a key is taken for a file that is not there."""
    if os.path.lexists(text):
        if os.path.isdir(text):
            raise KeyringError(f"{text} is a directory, not a mesh key file")
        text = encode_key(load(text).primary_key)
    try:
        kid, key = parse_change(op, text)
    except KeyringError as exc:
        if _key_shaped(op, text):
            raise
        raise KeyringError(f"{text}: no such file (and as a key: {exc})") from None
    return kid, encode_key(key) if op == "install" else kid


def _key_shaped(op: str, text: str) -> bool:
    """Whether ``text`` has the length of a key in base64 (or, for use and remove, of a key id)."""
    lengths = {4 * ((KEY_BYTES + 2) // 3)} | ({2 * KEY_ID_BYTES} if op != "install" else set())
    return len(text.strip()) in lengths


def _cmd_step(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    op = args.op
    try:
        kid, body_key = read_key_arg(op, args.key)
    except KeyringError as exc:
        print(f"meshd keys {op}: {exc}", file=sys.stderr)
        return 2
    try:
        base, url_token = dashboard_base(args.url)
        url = f"{base}/api/keys"
        done = _request("POST", url, args.token or url_token, {"op": op, "key": body_key},
                        timeout=min(REQUEST_TIMEOUT_S, args.timeout))
        if not isinstance(done, dict):
            raise NotANode(f"{url} does not answer as a meshd node: its answer to POST is "
                           f"{json_kind(done)}, not an object")
        if not isinstance(done.get("key_id"), str):
            raise NotANode(f"{url} does not answer as a meshd node: its answer to POST has no 'key_id' "
                           "string")
    except (NodeError, KeysError) as exc:
        print(f"meshd keys {op}: {exc}", file=sys.stderr)
        return 2
    return watch(base, args.token or url_token, op, kid, args.timeout)


def watch(base: str, token: str | None, op: str, kid: str, timeout: float) -> int:
    """Poll ``GET /api/keys`` until every live member has done ``op`` on key ``kid``; prints
    progress as it changes.  0 when done, 1 on timeout (naming who is behind), 2 when the
    node answers as no meshd node does."""
    said = PROGRESS[op].format(kid=kid)
    url = f"{base}/api/keys"
    deadline = time.monotonic() + timeout
    last_line, behind, error = None, [], None
    while True:
        try:
            # No request outlives the deadline: a node that trickles its answer cannot hold us.
            left = max(deadline - time.monotonic(), 0.1)
            members = _members(_request("GET", url, token, timeout=min(REQUEST_TIMEOUT_S, left)), url)
        except NotANode as exc:
            print(f"meshd keys {op}: {exc}", file=sys.stderr, flush=True)
            return 2
        except KeysError as exc:
            error = str(exc)  # the node may be busy or restarting: keep asking until the deadline
        else:
            error = None
            live = [m for m in members if m["state"] in LIVE]
            behind = [m for m in live if not change_done(op, kid, m["keyring"])]
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
        why = "not yet: " + ", ".join(f"{m['name']} ({m['prefix']}, keys {','.join(m['keyring']) or 'none'})"
                                      for m in behind)
    print(f"meshd keys {op}: timed out after {timeout:g}s; {last_line or 'no answer'}; {why}",
          file=sys.stderr, flush=True)
    return 1


def _members(view: Any, url: str) -> list[dict[str, Any]]:
    """The members ``GET /api/keys`` lists, each with ``name``, ``prefix``, ``state`` and
    ``keyring`` (a list of key ids); NotANode, naming what is missing, for any other shape."""
    def wrong(what: str) -> NotANode:
        return NotANode(f"{url} does not answer as a meshd node: {what}")

    if not isinstance(view, dict):
        raise wrong(f"its answer is {json_kind(view)}, not an object")
    members = view.get("members")
    if not isinstance(members, list) or not members:
        raise wrong("its answer has no 'members' list (a node lists itself at least)")
    out = []
    for i, m in enumerate(members):
        if not isinstance(m, dict):
            raise wrong(f"members[{i}] is {json_kind(m)}, not an object")
        for key in ("prefix", "state"):
            if not isinstance(m.get(key), str):
                raise wrong(f"members[{i}] has no '{key}' string")
        ring = m.get("keyring") or []
        if not isinstance(ring, list) or not all(isinstance(k, str) for k in ring):
            raise wrong(f"members[{i}]'s 'keyring' is not a list of key ids")
        name = m.get("name")
        out.append({"name": name if isinstance(name, str) else m["prefix"], "prefix": m["prefix"],
                    "state": m["state"], "keyring": ring})
    return out


def _request(method: str, url: str, token: str | None, body: dict | None = None, *,
             timeout: float = REQUEST_TIMEOUT_S) -> Any:
    headers = {"X-Meshd-Token": token} if token else {}
    try:
        r = ask_node(method, url, headers=headers, body=body, timeout=timeout)
    except NodeError as exc:
        raise KeysError(f"cannot reach {url}: {exc}") from exc
    if r.status == 401:
        raise KeysError(f"{url} wants the node's token (printed when it starts): --token T, URL?token=T "
                        f"or {TOKEN_ENV}=T")
    if r.status == 404:
        raise NotANode(f"{url} answered {r.status} {r.reason}: not a meshd dashboard")
    try:
        answer = r.json()
    except ValueError:
        if r.status >= 400:
            raise KeysError(f"{url} answered {r.status} {r.reason}: {r.text()}") from None
        raise NotANode(f"{url} does not answer as a meshd node: its answer is not JSON "
                       f"({r.text(80) or 'empty'})") from None
    if r.status >= 400:
        message = answer.get("error") if isinstance(answer, dict) else None
        detail = " ".join(message.split())[:200] if isinstance(message, str) else r.text()
        raise KeysError(f"{url} refused ({r.status}): {detail}")
    return answer
