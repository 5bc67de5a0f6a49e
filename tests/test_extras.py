"""tests/extras.py: a test that needs a missing extra skips, and fails under CI=true; an extra
that is installed but broken is its own error, not a skip; and no test skips on an import by
itself (pytest.importorskip would skip under CI=true too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.extras import require

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_extra_skips_here_and_fails_under_ci(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, installed or not
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"pip install 'batchpage\[ray\]'"):
        require("ray", "ray")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI=true .*pip install 'batchpage\[ray\]'"):
        require("ray", "ray")


def test_an_installed_module_is_returned_under_ci(monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require("json", "none") is json


def test_a_broken_install_is_its_own_error(tmp_path: Path, monkeypatch) -> None:
    """A module that is there but lacks one of its dependencies is not a missing extra."""
    (tmp_path / "half_installed.py").write_text("import a_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(ModuleNotFoundError, match="a_dependency_nobody_installed"):
        require("half_installed", "none")


def test_no_test_skips_on_an_import_by_itself() -> None:
    this = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "tests").rglob("*.py")
        if path.resolve() != this
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "importorskip(" in line
    ]
    assert not found, f"use tests.extras.require (fails under CI=true) instead: {found}"
