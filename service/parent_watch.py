"""A uvicorn worker ends when its master does: a kill -9 of the master must not leave
workers serving on the port with no one supervising them."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

PARENT_POLL_S = 0.5
SHUTDOWN_GRACE_S = 10.0
"""After SIGTERM a worker finishes its requests; past this it is ended hard."""


def exit_with_parent() -> None:
    """In a worker process (one multiprocessing started), watch the parent's pid from a
    daemon thread; once the parent is gone (the worker is re-parented), shut down as on
    SIGTERM. getppid works on every POSIX system and, unlike PR_SET_PDEATHSIG, does not
    fire when only the thread that started the worker ends. The parent's pid is the one
    multiprocessing recorded at the start, not getppid() now: a master killed while the worker
    was still starting up has already re-parented it. A no-op in a main process."""
    parent_process = multiprocessing.parent_process()
    if parent_process is None:
        return
    parent = parent_process.pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(SHUTDOWN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="cce-parent-watch", daemon=True).start()
