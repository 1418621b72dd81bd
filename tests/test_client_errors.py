"""``meshd doctor``, ``meshd peers`` and ``meshd keys`` against a URL that is no meshd node's:
one line naming the URL and what is wrong, exit 2, and never longer than ``--timeout``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meshd import keyring
from meshd.cli import main

Answer = Callable[[BaseHTTPRequestHandler, threading.Event], None]


def json_answer(obj: object, status: int = 200) -> Answer:
    return raw_answer(json.dumps(obj).encode(), status, "application/json")


def raw_answer(body: bytes, status: int = 200, kind: str = "text/plain") -> Answer:
    def answer(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return answer


def trickle(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
    """A byte of a valid answer every 0.3 s: each read is quick, the answer takes a minute."""
    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}" * 8:
        if stop.wait(0.3):
            return
        h.wfile.write(bytes([byte]))
        h.wfile.flush()


def silent(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
    """Takes the request and never answers (until the test ends)."""
    stop.wait(30)


class Stub:
    """An HTTP server on loopback answering each (method, path) as told; 404 otherwise."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Answer] = {}
        self.stop = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                path = self.path.split("?")[0]
                answer = stub.routes.get((self.command, path), raw_answer(b"not found", 404))
                try:
                    answer(self, stub.stop)
                except OSError:
                    pass  # the client gave up, as it should

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def stub(monkeypatch) -> Iterator[Stub]:
    monkeypatch.delenv("MESHD_DASHBOARD_TOKEN", raising=False)
    server = Stub()
    yield server
    server.close()


@pytest.fixture
def key_file(tmp_path) -> tuple[str, str]:
    """A mesh key file and its key's id."""
    path = tmp_path / "mk1"
    return str(path), keyring.generate_file(path).primary_id


def run(capsys, *argv: str) -> tuple[int, str, float]:
    """``meshd ARGV`` in this process: (exit code, its one stderr line, seconds it took), past
    argparse's usage line.  A traceback fails the test as the exception it is."""
    capsys.readouterr()
    start = time.monotonic()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage error
        code = exc.code if isinstance(exc.code, int) else 2
    took = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage: ")]
    assert "Traceback" not in err and len(lines) == 1, err
    return code, lines[0], took


# --- 1: a URL that is none


@pytest.mark.parametrize("argv", [("doctor", "http://[::1"), ("peers", "http://[::1"),
                                  ("doctor", "http://[::1]:x"), ("keys", "install", "KEY", "--url", "http://[::1")])
def test_a_url_that_is_no_url_is_one_line_and_exit_2(capsys, key_file, argv):
    argv = tuple(key_file[0] if a == "KEY" else a for a in argv)
    url = argv[-1]
    code, line, _ = run(capsys, *argv)
    assert code == 2
    command = " ".join(argv[:2]) if argv[0] == "keys" else argv[0]
    assert line.startswith(f"meshd {command}: {url!r} is not a URL: "), line


# --- 2: JSON that is not a meshd node's


@pytest.mark.parametrize("command", ["doctor", "peers"])
@pytest.mark.parametrize("snapshot, missing", [({"self": {}}, "self has no 'id' string"),
                                               ([1, 2, 3], "its answer is a JSON array, not an object"),
                                               ({"foo": 1}, "its answer has no 'self' object"),
                                               ({"self": {"id": "a", "prefix": "b"}, "members": [7]},
                                                "members[0] is a JSON number, not an object"),
                                               ({"self": {"id": "a", "prefix": "b", "stages": "x"}},
                                                "its snapshot does not fit (ValueError: ")])
def test_a_snapshot_no_meshd_node_gives_is_named_at_once(capsys, stub, command, snapshot, missing):
    stub.routes["GET", "/api/snapshot"] = json_answer(snapshot)
    code, line, _ = run(capsys, command, stub.url)
    assert code == 2
    said = f"meshd {command}: {stub.url}/api/snapshot does not answer as a meshd node: {missing}"
    assert line.startswith(said), line


@pytest.mark.parametrize("post, get, missing", [
    ([1, 2, 3], None, "its answer to POST is a JSON array, not an object"),
    ({"foo": 1}, None, "its answer to POST has no 'key_id' string"),
    ("OK", {"foo": 1}, "its answer has no 'members' list (a node lists itself at least)"),
    ("OK", [1, 2, 3], "its answer is a JSON array, not an object"),
    ("OK", {"members": [{"prefix": "ab", "state": "alive", "keyring": "x"}]},
     "members[0]'s 'keyring' is not a list of key ids"),
])
def test_keys_against_json_no_meshd_node_gives_stops_at_once(capsys, stub, key_file, post, get, missing):
    path, kid = key_file
    posted = {"op": "install", "key_id": kid} if post == "OK" else post
    stub.routes["POST", "/api/keys"] = json_answer(posted, 202)
    stub.routes["GET", "/api/keys"] = json_answer(get)
    code, line, took = run(capsys, "keys", "install", path, "--url", stub.url, "--timeout", "5")
    assert code == 2 and took < 2, "no waiting out --timeout for an answer no node gives"
    assert line == f"meshd keys install: {stub.url}/api/keys does not answer as a meshd node: {missing}"


# --- 3: an overall deadline on each request


@pytest.mark.parametrize("command", ["doctor", "peers"])
def test_a_server_that_trickles_its_answer_is_given_up_on_after_the_timeout(capsys, stub, command):
    stub.routes["GET", "/api/snapshot"] = trickle
    code, line, took = run(capsys, command, stub.url, "--timeout", "1")
    assert code == 2 and took < 3, took
    assert line == f"meshd {command}: cannot read {stub.url}/api/snapshot: no complete answer within 1s"


def test_fetch_snapshot_holds_to_its_timeout_against_a_trickle(stub):
    from dashboard.cli import FetchError, fetch_snapshot

    stub.routes["GET", "/api/snapshot"] = trickle
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"no complete answer within 1s$"):
        fetch_snapshot(stub.url, timeout=1.0)
    assert time.monotonic() - start < 3


def test_keys_holds_to_its_timeout_against_a_trickle(capsys, stub, key_file):
    stub.routes["POST", "/api/keys"] = trickle
    code, line, took = run(capsys, "keys", "install", key_file[0], "--url", stub.url, "--timeout", "1")
    assert code == 2 and took < 3, took
    assert line == f"meshd keys install: cannot reach {stub.url}/api/keys: no complete answer within 1s"


# --- 4: --timeout a number of seconds


@pytest.mark.parametrize("value, why", [("nan", "is not a finite number"), ("inf", "is not a finite number"),
                                        ("-1", "must be greater than 0"), ("0", "must be greater than 0")])
def test_keys_timeout_must_be_a_positive_finite_number(capsys, key_file, value, why):
    code, line, _ = run(capsys, "keys", "install", key_file[0], "--url", "http://127.0.0.1:1",
                        f"--timeout={value}")
    assert code == 2 and line == f"meshd keys install: error: argument --timeout: {value!r} {why}"


# --- 5: a key file that is not there


def test_a_key_file_that_is_not_there_or_a_directory_says_so(capsys, tmp_path):
    missing = tmp_path / "nonexist.key"
    code, line, _ = run(capsys, "keys", "install", str(missing), "--url", "http://127.0.0.1:1")
    assert code == 2 and line.startswith(f"meshd keys install: {missing}: no such file"), line
    code, line, _ = run(capsys, "keys", "install", str(tmp_path), "--url", "http://127.0.0.1:1")
    assert code == 2 and line == f"meshd keys install: {tmp_path} is a directory, not a mesh key file"
    (tmp_path / "adir").mkdir()  # a name that is base64 too
    code, line, _ = run(capsys, "keys", "use", str(tmp_path / "adir"), "--url", "http://127.0.0.1:1")
    assert code == 2 and line.endswith("adir is a directory, not a mesh key file"), line


def test_a_key_given_itself_still_says_what_is_wrong_with_it(capsys):
    bad = keyring.encode_key(b"\0" * 31)  # as long as a key in base64: taken for one, not for a file
    code, line, _ = run(capsys, "keys", "install", bad, "--url", "http://127.0.0.1:1")
    assert code == 2 and line == "meshd keys install: a mesh key is 32 bytes, this one is 31", line


# --- 6: an HTTP error is one line


@pytest.mark.parametrize("command", ["doctor", "peers"])
def test_a_404_is_one_line_naming_the_url_and_status(capsys, stub, command):
    code, line, _ = run(capsys, command, stub.url + "/")
    assert code == 2
    assert line == f"meshd {command}: {stub.url}/api/snapshot answered 404 Not Found: not a meshd dashboard"


def test_a_404_under_a_path_says_to_give_the_dashboards_own_url(capsys, stub):
    code, line, _ = run(capsys, "doctor", stub.url + "/api/peers")
    assert code == 2
    assert line == (f"meshd doctor: {stub.url}/api/peers/api/snapshot answered 404 Not Found: not a meshd "
                    "dashboard (if it is one, give the dashboard's own URL, without /api/peers: the URL "
                    "printed as 'meshd dashboard url=')")


def test_keys_against_a_404_is_one_line_naming_the_url_and_status(capsys, stub, key_file):
    code, line, _ = run(capsys, "keys", "install", key_file[0], "--url", stub.url)
    assert code == 2
    assert line == f"meshd keys install: {stub.url}/api/keys answered 404 Not Found: not a meshd dashboard"


# --- 7: a timeout says after how long


def test_a_node_that_never_answers_is_named_with_the_seconds_waited(capsys, stub):
    stub.routes["GET", "/api/snapshot"] = silent
    code, line, took = run(capsys, "doctor", stub.url, "--timeout", "0.5")
    assert code == 2 and took < 2
    assert line == f"meshd doctor: cannot read {stub.url}/api/snapshot: no complete answer within 0.5s"


def test_fetch_snapshot_says_how_long_it_waited(stub):
    from dashboard.cli import FetchError, fetch_snapshot

    stub.routes["GET", "/api/snapshot"] = silent
    with pytest.raises(FetchError, match=r"within 0\.5s$"):
        fetch_snapshot(stub.url, timeout=0.5)


def test_keys_watch_that_times_out_says_after_how_long_and_why(capsys, stub, key_file):
    path, kid = key_file
    stub.routes["POST", "/api/keys"] = json_answer({"op": "install", "key_id": kid}, 202)
    stub.routes["GET", "/api/keys"] = silent
    code, line, took = run(capsys, "keys", "install", path, "--url", stub.url, "--timeout", "1")
    assert code == 1 and took < 3, took
    assert line.startswith("meshd keys install: timed out after 1s; no answer; the node stopped answering: "
                           f"cannot reach {stub.url}/api/keys: no complete answer within "), line
