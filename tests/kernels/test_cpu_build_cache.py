"""The kernels' build is keyed by content alone: two checkouts of the same sources sharing one
torch extension folder build once, and the second loads the first's library without compiling
(ninja rebuilt it at every start when build.ninja named each checkout's own source path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A module of pybind11 alone: it builds in seconds (torch/extension.h takes most of a minute).
SOURCE = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""
BUILD = (
    "import sys\n"
    "from pathlib import Path\n"
    "from batchpage.kernels.cpu_build import build_extension\n"
    "module = build_extension(Path(sys.argv[1]), 'batchpage_test_cache', 'the test module')\n"
    "print(module.answer())\n"
)


def build_from(source: Path, extensions: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(extensions)}
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, str(source)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["42"]


def checkout(root: Path) -> Path:
    """One checkout's copy of the kernel source."""
    root.mkdir(parents=True)
    (root / "kernel.cpp").write_text(SOURCE)
    return root / "kernel.cpp"


@pytest.mark.slow
def test_a_second_checkout_loads_the_first_ones_build_without_compiling(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    build_from(checkout(tmp_path / "checkout-a"), extensions)
    (library,) = extensions.rglob("batchpage_test_cache_*.so")
    objects = sorted(library.parent.glob("*.o"))
    assert objects, "the build left no object file to compare"
    built = {p: p.stat().st_mtime_ns for p in [library, *objects]}

    build_from(checkout(tmp_path / "checkout-b"), extensions)
    assert {p: p.stat().st_mtime_ns for p in built} == built, "the second checkout recompiled"
    assert list(extensions.rglob("*.so")) == [library]
