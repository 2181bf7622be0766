"""Runs a benchmark script's child in a fresh process with empty compile caches.

First-call and first-step times are what a user's first run pays only when nothing is cached:
each child gets its own empty Triton and Inductor cache directories. Such times vary by
seconds from process to process, so the scripts repeat runs in alternating order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

Item = TypeVar("Item")

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_fresh(script: str, child_args: Sequence[str]) -> dict:
    """`python script *child_args` with empty caches; its last stdout line is the JSON result.

    A failing child is recorded as {"error": <its stderr's tail>}, not raised, so one failed
    run does not lose the others'.
    """
    with tempfile.TemporaryDirectory() as caches:
        env = {**os.environ, "TRITON_CACHE_DIR": f"{caches}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, script, *child_args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"no JSON result on the last line of stdout: {done.stdout[-500:]!r}"}


def alternating(items: Sequence[Item], rounds: int) -> Iterator[Item]:
    """`items` over `rounds` rounds, every other round in reverse order, so that neither the
    first nor the last place in a round (a cold or a warm machine) goes to one item."""
    for round_index in range(rounds):
        yield from items if round_index % 2 == 0 else reversed(items)
