"""A worker whose master dies ends too, even when the master died while the worker was still
starting (before the worker began to watch)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_service_workers import WORKER_EXIT_TIMEOUT_S, _running

REPO_ROOT = Path(__file__).resolve().parents[1]

MASTER = """
import multiprocessing, os, sys
from tests.test_parent_watch import late_worker
worker = multiprocessing.get_context("spawn").Process(target=late_worker)
worker.start()
print(worker.pid, flush=True)
os._exit(0)  # as a kill -9 would: no join, no cleanup
"""


def late_worker() -> None:
    """Start watching only once the master is gone, then idle as a server would."""
    from service.parent_watch import exit_with_parent

    while _parent_alive():
        time.sleep(0.05)
    exit_with_parent()
    time.sleep(60)


def _parent_alive() -> bool:
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is not None and os.getppid() == parent.pid


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads process states from /proc (Linux)")
def test_a_worker_reparented_before_it_watches_still_exits() -> None:
    # The worker inherits the pipe, so read the one line rather than wait for its end.
    with subprocess.Popen([sys.executable, "-c", MASTER], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True) as master:
        assert master.stdout is not None
        worker = int(master.stdout.readline())
        assert master.wait(timeout=60) == 0
    deadline = time.monotonic() + WORKER_EXIT_TIMEOUT_S
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    running = _running(worker)
    if running:
        os.kill(worker, 9)
    assert not running, "the worker outlived its master"
