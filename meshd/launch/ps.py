"""``meshd ps``: runs and their jobs from the run dir, in a table like `dstack ps`.

Reads only the files; works from any process while a run is live (the files are replaced
atomically). A file that cannot be read costs one line on stderr and exit status 1; the
other runs are still shown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .model import JobStatus
from .state import default_run_dir, load_run_dir, owner_alive

if TYPE_CHECKING:
    from rich.text import Text

_FINISHED_RUN = {"done", "failed", "terminated"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    ps = sub.add_parser(
        "ps", help="runs and their jobs, with statuses a person can read",
        description="Show the runs in the run dir and their jobs: role/stage, peer prefix, address, "
                    "status (exited (0), stopped, lost: stage-2 (...), ...), reason and age.")
    ps.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                    help=f"where runs keep their state (default {default_run_dir()})")
    ps.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ps.set_defaults(func=_cmd_ps)


def _cmd_ps(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    run_dir = args.run_dir or default_run_dir()
    found = load_run_dir(run_dir)
    now = time.time()
    for run in found.runs:
        run["owner_alive"] = owner_alive(run)
    if args.json:
        print(json.dumps({
            "run_dir": str(run_dir),
            "runs": found.runs,
            "errors": [{"file": str(e.path), "error": e.problem} for e in found.errors],
        }))
    elif found.runs:
        _print_table(found.runs, now)
    elif not found.errors:
        print(f"No runs in {run_dir}")
    for err in found.errors:
        print(f"meshd ps: {err}", file=sys.stderr)
    return 1 if found.errors else 0


def run_status_text(run: dict[str, Any]) -> str:
    status = str(run.get("status"))
    if status not in _FINISHED_RUN and not run.get("owner_alive", True):
        return f"{status} (driver pid {run.get('owner_pid')} gone)"
    return status


def job_status_text(run: dict[str, Any], job: dict[str, Any]) -> str:
    """A job's status; a job still going when its run's driver died died with it (the driver's
    processes get SIGKILL when it ends, PR_SET_PDEATHSIG), and says so."""
    text = str(job.get("status_message") or job.get("status") or "")
    if (str(run.get("status")) not in _FINISHED_RUN and not run.get("owner_alive", True)
            and not _finished(job)):
        return f"killed with its driver (was {text})"
    return text


def _finished(job: dict[str, Any]) -> bool:
    try:
        return JobStatus(str(job.get("status"))).finished
    except ValueError:
        return False


def _print_table(runs: list[dict[str, Any]], now: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in ("NAME", "ROLE/STAGE", "PEER", "ADDRESS", "STATUS", "REASON", "SUBMITTED"):
        table.add_column(column, no_wrap=True)
    for run in runs:
        table.add_row(
            _cell(run["name"], "bold"), "", "", "",
            _cell(run_status_text(run)),
            _cell(run.get("message") or run.get("reason") or ""),
            age(now, run.get("submitted_at")),
        )
        for job in run.get("jobs", []):
            stage = job.get("stage")
            table.add_row(
                _cell(f"  {job['name']}"),
                _cell(job["role"] if stage is None else f"{job['role']} {stage}"),
                _cell(job.get("peer") or ""),
                _cell(job.get("address") or ""),
                _cell(job_status_text(run, job)),
                _cell(job.get("reason") or ""),
                age(now, job.get("submitted_at")),
            )
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    console.print(table)


def _cell(value: Any, style: str = "") -> Text:
    """Text from a run file as it is written: rich markup in it (``[/bold]``) is shown, not
    parsed (a stray closing tag would raise), and a control character (an escape sequence
    for the terminal) shows as U+FFFD."""
    from rich.text import Text

    text = "".join(c if c.isprintable() else "\ufffd" for c in str(value))
    return Text(text, style=style)


def age(now: float, then: float | None) -> str:
    """`now`, `12 sec ago`, `3 min ago`, `2 hours ago`, `yesterday`, `5 days ago`."""
    if not then:
        return ""
    seconds = max(0.0, now - float(then))
    if seconds < 5:
        return "now"
    if seconds < 60:
        return f"{int(seconds)} sec ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        hours = int(seconds // 3600)
        return "1 hour ago" if hours == 1 else f"{hours} hours ago"
    days = int(seconds // 86400)
    return "yesterday" if days == 1 else f"{days} days ago"
