"""`make setup` installs once per state of what it installs from: a second run with nothing
changed runs no pip (the kernel build still runs: it keeps its own cache), a changed pyproject.toml
or install line installs again, and a failed install is tried again. Make runs on copies of the
Makefile and pyproject.toml with a Python that logs its pip and kernel calls instead of making
them (its `-c` calls, the setup's checksum, go to this Python)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fake_python(folder: Path, log: Path) -> Path:
    script = folder / "python"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
        f'echo "$*" >> {log}\n'
        'if [ -n "$FAIL_PIP" ] && [ "$2" = pip ]; then exit 1; fi\n'
    )
    script.chmod(0o755)
    return script


def make_setup(folder: Path, python: Path, log: Path, fail: bool = False) -> tuple[int, int]:
    """Runs `make setup` in folder: the pip installs and kernel builds it ran."""
    log.write_text("")
    env = {"PATH": "/usr/bin:/bin", **({"FAIL_PIP": "1"} if fail else {})}
    done = subprocess.run(
        ["make", "setup", f"PYTHON={python}"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode != 0) == fail, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    pips = sum(c.startswith("-m pip install") for c in calls)
    return pips, sum(c.startswith("-m batchpage.kernels.build_all") for c in calls)


def stamps(folder: Path) -> set[Path]:
    return set((folder / "build").glob("setup-*.stamp"))


def test_an_unchanged_setup_installs_nothing(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    log = tmp_path / "calls.log"
    python = fake_python(tmp_path, log)
    assert make_setup(tmp_path, python, log) == (3, 1)
    assert len(stamps(tmp_path)) == 1
    assert make_setup(tmp_path, python, log) == (0, 1)

    with (tmp_path / "pyproject.toml").open("a") as f:
        f.write("# a change\n")
    assert make_setup(tmp_path, python, log) == (3, 1)
    assert make_setup(tmp_path, python, log) == (0, 1)

    makefile = tmp_path / "Makefile"
    text = makefile.read_text()
    assert "torch==2.13.0" in text
    makefile.write_text(text.replace("torch==2.13.0", "torch==2.13.1"))
    before = stamps(tmp_path)
    make_setup(tmp_path, python, log, fail=True)  # the install fails: no stamp for it
    assert stamps(tmp_path) == before
    assert make_setup(tmp_path, python, log) == (3, 1)
    after = stamps(tmp_path)
    assert len(after) == 1 and after != before
