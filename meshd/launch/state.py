"""Run state on disk: one JSON file per run in the run dir, replaced atomically.

A reader in another process (`meshd ps`) sees the previous or the next version of a file,
never half of one: the writer writes a temp file in the same directory, fsyncs it and
renames it over the old one. A file that cannot be read is reported by its name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..identity import read_small_file
from .model import Run, run_from_dict, run_to_dict

FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class StateFileError(Exception):
    """A run file that cannot be read: `str()` is one line naming the file."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def default_run_dir() -> Path:
    """$XDG_STATE_HOME/meshd/runs, or ~/.local/state/meshd/runs."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "meshd" / "runs"


def run_path(run_dir: Path | str, name: str) -> Path:
    if not _NAME.match(name):
        raise ValueError(f"run name {name!r}: use letters, digits, '.', '_' and '-'")
    return Path(run_dir) / f"{name}.json"


def next_run_name(run_dir: Path | str, base: str = "smoke") -> str:
    """`base-1`, `base-2`, ...: the first whose file does not exist yet."""
    run_dir = Path(run_dir)
    n = 1
    while (run_dir / f"{base}-{n}.json").exists():
        n += 1
    return f"{base}-{n}"


def save_run(run: Run, run_dir: Path | str, *, owner_pid: int | None = None) -> Path:
    """Write the run's file atomically; returns its path. `owner_pid` is the driver's pid, so
    `meshd ps` can tell a run whose driver died from a live one."""
    data = run_to_dict(run)
    data["version"] = FORMAT_VERSION
    data["owner_pid"] = owner_pid if owner_pid is not None else os.getpid()
    return write_atomically(run_path(run_dir, run.name), json.dumps(data, indent=1) + "\n")


def logs_path(run_dir: Path | str, name: str) -> Path:
    """Where a failed run's job output is kept: ``<run_dir>/<run>.logs/``."""
    return run_path(run_dir, name).with_suffix(".logs")


def save_logs(run_dir: Path | str, name: str, lines: dict[str, list[str]]) -> Path:
    """Write each job's output (``lines``: job -> its lines) to ``<run>.logs/<job>.log``; returns the
    directory."""
    directory = logs_path(run_dir, name)
    for job, job_lines in lines.items():
        write_atomically(directory / f"{job}.log", "".join(f"{line}\n" for line in job_lines))
    return directory


def write_atomically(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a crash
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_run_dict(path: Path | str) -> dict[str, Any]:
    """The file's dict, checked to describe a run; raises StateFileError, one line."""
    path = Path(path)
    try:
        text = read_small_file(path, 64 << 20).decode("utf-8")  # not a pipe or a device: ps never waits
    except (OSError, UnicodeDecodeError) as exc:
        raise StateFileError(path, f"cannot read: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateFileError(path, f"not valid JSON (line {exc.lineno} column {exc.colno})") from exc
    try:
        run_from_dict(data)
    except (KeyError, ValueError, TypeError, AttributeError, ArithmeticError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StateFileError(path, f"not a meshd run file ({what})") from exc
    return data


def read_run(path: Path | str) -> Run:
    return run_from_dict(read_run_dict(path))


@dataclass(frozen=True, slots=True)
class RunDir:
    runs: list[dict[str, Any]]  # newest first
    errors: list[StateFileError]


def load_run_dir(run_dir: Path | str) -> RunDir:
    """Every run file in the directory (a missing directory has none), newest first, and the
    files that could not be read."""
    run_dir = Path(run_dir)
    runs: list[dict[str, Any]] = []
    errors: list[StateFileError] = []
    try:
        paths = sorted(p for p in run_dir.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except FileNotFoundError:
        paths = []
    except OSError as exc:
        errors.append(StateFileError(run_dir, f"cannot list: {exc.strerror or exc}"))
        paths = []
    for path in paths:
        try:
            runs.append(read_run_dict(path))
        except StateFileError as exc:
            errors.append(exc)
    runs.sort(key=lambda r: float(r.get("submitted_at") or 0.0), reverse=True)
    return RunDir(runs, errors)


def owner_alive(data: dict[str, Any]) -> bool:
    """Whether the process that wrote the run still exists (True when unknown)."""
    pid = data.get("owner_pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a pid no process can have
        return False
    except PermissionError:
        return True
    return True
