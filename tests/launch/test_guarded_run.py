"""The runner the end-to-end tests start the product with: what outlives a command is seen, and then killed."""

import os
import subprocess

from guarded_run import run_guarded


def test_a_process_left_behind_is_reported_and_killed():
    leftovers: list[str] = []
    # its output elsewhere, as Ray's processes write to their log files (one holding the pipe would hold the runner);
    # a sleep does not shut down, so the 15 s a Ray cluster is given to exit would only be waited out
    rc, out = run_guarded(["bash", "-c", "sleep 91 > /dev/null 2>&1 & echo started"], dict(os.environ), timeout=60,
                          leftovers=leftovers, settle_s=2.0)
    assert rc == 0 and "started" in out
    assert len(leftovers) == 1 and "sleep 91" in leftovers[0], leftovers
    # the group was killed afterwards: nothing of it is left
    assert not subprocess.run(["pgrep", "-f", "sleep 91"], capture_output=True, text=True).stdout.split()


def test_a_clean_exit_leaves_nothing():
    leftovers: list[str] = []
    rc, _ = run_guarded(["bash", "-c", "sleep 0.2 & wait"], dict(os.environ), timeout=60, leftovers=leftovers)
    assert rc == 0 and leftovers == []
