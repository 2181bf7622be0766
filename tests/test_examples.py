"""The examples run as a user would run them, in child processes: the training script (a
patched tiny Llama under torch.compile, a few AdamW steps) and the two-node service setup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.process import REPO_ROOT, free_port

EXAMPLES = REPO_ROOT / "examples"


def user_environment(tmp_path: Path) -> dict[str, str]:
    """This environment as a user's shell would have it: no interpreter mode (the tests' own
    setting), `cce` on PATH running this checkout, a cache of its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cce").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cce_compile.cli.main "$@"\n')
    (bin_dir / "cce").chmod(0o755)
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("TRITON_", "CCE_"))}
    environment.update(PYTHONPATH=str(REPO_ROOT), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                       XDG_CACHE_HOME=str(tmp_path / "cache"))
    return environment


def test_the_training_example_lowers_the_loss_through_the_op(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_tiny_llama.py"), "--steps", "3", "--backend", "aot_eager",
         "--vocab", "1024", "--seq", "32"],
        capture_output=True, text=True, env=user_environment(tmp_path), cwd=tmp_path, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("step ") == 3
    assert "cce_compile's op computed the loss for 1 shape(s): V=1024 D=64 float32 on cpu" in done.stdout


@pytest.mark.parametrize("option, value", [("--steps", "0"), ("--vocab", "3"), ("--batch", "0"), ("--seq", "1")])
def test_the_training_example_refuses_sizes_it_cannot_train_at(tmp_path: Path, option: str, value: str) -> None:
    """--steps 0 once ended 'the loss did not go through cce_compile's op'; the others in a
    traceback from randint or dynamo."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "train_tiny_llama.py"), option, value],
                          capture_output=True, text=True, env=user_environment(tmp_path), cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument {option}: {value} is below the minimum" in done.stderr


def test_the_two_node_example_finds_the_published_config(tmp_path: Path) -> None:
    environment = {**user_environment(tmp_path), "PORT": str(free_port())}
    done = subprocess.run(["bash", str(EXAMPLES / "two_node_service.sh")], capture_output=True, text=True,
                          env=environment, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert '"source": "service", "match_level": "exact"' in done.stdout
    assert '"slab_v": 8192, "vocab_splits": 8' in done.stdout
    assert "exported 1 best entry(ies)" in done.stdout
