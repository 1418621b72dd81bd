"""``--compute-threads``: a node's BLAS keeps to the threads it is given."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshd.pipeline.threads import set_compute_threads


@pytest.mark.parametrize("threads", [1, 7])  # 7: no host default here, so the call set it
def test_the_limit_holds_in_the_process_that_sets_it(threads):
    # A process of its own: the limit stays for the rest of the process that sets it.
    code = ("from meshd.pipeline.threads import set_compute_threads, compute_threads\n"
            f"set_compute_threads({threads})\n"
            "print(compute_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(threads)


def test_zero_threads_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        set_compute_threads(0)


@pytest.mark.parametrize("value, words", [("0", "must be at least 1"), ("two", "is not a whole number")])
def test_run_refuses_a_bad_count_in_one_line(value, words):
    out = subprocess.run([sys.executable, "-m", "meshd", "run", "--compute-threads", value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert words in out.stderr and "Traceback" not in out.stderr
