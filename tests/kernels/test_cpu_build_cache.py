"""The kernels' build folder is keyed by everything that changes the library or that torch's
loader names in its build.ninja: the sources' content, the torch build, the compiler and its
flags, the include and library paths. Two checkouts of the same sources in one environment build
once, and the second loads the first's library without compiling (ninja rebuilt it at every start
when build.ninja named each checkout's own source path); two environments whose torch headers lie
in different folders build apart, never over each other's library (they rebuilt each other's at
every start, in silence). Every compile says when it starts and when it ends, also one that ninja
decides on (a source newer than the library)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchpage.kernels.cpu_build import BuildInputs, extension_name

ROOT = Path(__file__).resolve().parents[2]
# A module of pybind11 alone: it builds in seconds (torch/extension.h takes most of a minute).
SOURCE = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""
# argv: the source, then optionally a link to torch's package folder: a second environment with
# the same torch, whose headers torch's loader (and the key) name by another path, as in a venv.
BUILD = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "if len(sys.argv) > 2:\n"
    "    import torch\n"
    "    from torch.utils import cpp_extension\n"
    "    real, link = os.path.dirname(torch.__file__), sys.argv[2]\n"
    "    paths = cpp_extension.include_paths\n"
    "    cpp_extension.include_paths = lambda *a, **k: [\n"
    "        p.replace(real, link, 1) for p in paths(*a, **k)\n"
    "    ]\n"
    "from batchpage.kernels.cpu_build import build_extension\n"
    "module = build_extension(Path(sys.argv[1]), 'batchpage_test_cache', 'the test module')\n"
    "print(module.answer())\n"
)
STARTED = "batchpage: building the test module, batchpage_test_cache_"
ENDED = "batchpage: built the test module in "


def start(source: Path, extensions: Path, torch_link: Path | None = None) -> list[str]:
    """One start of a program that builds or loads the test module; returns its log lines."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(extensions)}
    link = [str(torch_link)] if torch_link else []
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, str(source), *link],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["42"]
    return [line for line in proc.stderr.splitlines() if line.startswith("batchpage: ")]


def assert_announced(lines: list[str]) -> None:
    """The start line first, the end line last (heartbeats between, on a slow machine)."""
    assert lines and lines[0].startswith(STARTED), lines
    assert lines[-1].startswith(ENDED), lines


def checkout(root: Path) -> Path:
    """One checkout's copy of the kernel source."""
    root.mkdir(parents=True)
    (root / "kernel.cpp").write_text(SOURCE)
    return root / "kernel.cpp"


def libraries(extensions: Path) -> list[Path]:
    return sorted(extensions.rglob("batchpage_test_cache_*.so"))


def identity(path: Path) -> tuple[int, int]:
    """Inode and modification time: a rebuilt (relinked) library differs."""
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


def second_environment(tmp_path: Path) -> Path:
    """A folder that holds this torch under another path (a link), like a second venv's."""
    link = tmp_path / "env-b" / "torch"
    link.parent.mkdir()
    link.symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    return link


def test_the_name_changes_with_every_build_input_and_only_with_them() -> None:
    sources = [SOURCE.encode(), b"// a header\n"]
    here = BuildInputs.here()
    name = extension_name("k", sources, here)
    assert name == extension_name("k", sources, BuildInputs.here())
    assert name == extension_name("k", sources)  # this process's inputs by default
    other_includes = ("/venv-b/site-packages/torch/include", *here.include_paths[1:])
    other_python = (*here.include_paths[:-1], "/usr/include/python3.99")
    changed = [
        dataclasses.replace(here, include_paths=other_includes),
        dataclasses.replace(here, include_paths=other_python),
        dataclasses.replace(here, library_paths=("/venv-b/site-packages/torch/lib",)),
        dataclasses.replace(here, torch_build="2.99.0+cpu 0123abc"),
        dataclasses.replace(here, cflags=(*here.cflags, "-mno-avx512bf16")),
        dataclasses.replace(here, ldflags=()),
        dataclasses.replace(here, compiler="clang++"),
        dataclasses.replace(here, compiler_path="/opt/conda/bin/x86_64-conda-linux-gnu-c++"),
        dataclasses.replace(here, cpu="flags : fpu sse2"),
    ]
    names = {extension_name("k", sources, inputs) for inputs in changed}
    assert len(names) == len(changed) and name not in names
    assert name != extension_name("k", [sources[0] + b"\n// edited\n", sources[1]], here)


def test_cflags_are_part_of_the_build_inputs() -> None:
    portable = BuildInputs.here(("-mno-avx512bf16",))
    assert portable.cflags[-1] == "-mno-avx512bf16"
    assert portable.cflags[:-1] == BuildInputs.here().cflags


@pytest.mark.slow
def test_a_second_checkout_loads_the_first_ones_build_without_compiling(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    assert_announced(start(checkout(tmp_path / "checkout-a"), extensions))
    (library,) = libraries(extensions)
    objects = sorted(library.parent.glob("*.o"))
    assert objects, "the build left no object file to compare"
    built = {p: p.stat().st_mtime_ns for p in [library, *objects]}

    assert start(checkout(tmp_path / "checkout-b"), extensions) == []
    assert {p: p.stat().st_mtime_ns for p in built} == built, "the second checkout recompiled"
    assert list(extensions.rglob("*.so")) == [library]


@pytest.mark.slow
def test_the_build_file_names_nothing_outside_the_key(tmp_path: Path) -> None:
    # What build.ninja names beyond the key would differ between environments with one key, and
    # ninja would rebuild on it; so every path there is the build folder's own or a key input.
    extensions = tmp_path / "torch_extensions"
    start(checkout(tmp_path / "checkout"), extensions)
    (library,) = libraries(extensions)
    folder = library.parent
    inputs = BuildInputs.here()
    text = (folder / "build.ninja").read_text()
    variables = dict(
        line.split(" = ", 1) for line in text.splitlines() if " = " in line and line[0] != " "
    )
    assert variables["cxx"] == inputs.compiler
    assert variables["cflags"].endswith(" " + " ".join(inputs.cflags))
    assert f" {' '.join(inputs.ldflags)} " in f" {variables['ldflags']} "
    named = {
        token.removeprefix("-I").removeprefix("-L")
        for token in text.replace("-isystem ", "").split()
        if token.lstrip("-IL").startswith("/")
    }
    assert named, text
    outside = {p for p in named if not Path(p).is_relative_to(folder)}
    assert outside == {*inputs.include_paths, *inputs.library_paths}, text
    dry_run = subprocess.run(
        [shutil.which("ninja") or "ninja", "-n", "-C", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ninja: no work to do." in dry_run.stdout, dry_run.stdout + dry_run.stderr


@pytest.mark.slow
def test_environments_whose_includes_differ_build_apart_and_leave_each_other_alone(
    tmp_path: Path,
) -> None:
    extensions = tmp_path / "torch_extensions"
    source, env_b = checkout(tmp_path / "checkout"), second_environment(tmp_path)
    assert_announced(start(source, extensions))
    (library_a,) = libraries(extensions)
    built_a = identity(library_a)

    assert_announced(start(source, extensions, env_b))
    library_b = next(p for p in libraries(extensions) if p != library_a)
    assert library_b.parent != library_a.parent
    assert str(env_b) in (library_b.parent / "build.ninja").read_text()
    assert identity(library_a) == built_a, "the second environment rebuilt the first one's"
    built_b = identity(library_b)

    # Each later start loads its own library: no build, no message, in either environment.
    assert start(source, extensions) == []
    assert start(source, extensions, env_b) == []
    assert (identity(library_a), identity(library_b)) == (built_a, built_b)
    assert len(libraries(extensions)) == 2


@pytest.mark.slow
def test_a_rebuild_that_ninja_decides_on_is_announced(tmp_path: Path) -> None:
    # A file the library is built from, newer than the library (torch reinstalled in place
    # leaves its headers so): torch's loader runs ninja, which recompiles.
    extensions = tmp_path / "torch_extensions"
    source = checkout(tmp_path / "checkout")
    start(source, extensions)
    (library,) = libraries(extensions)
    built = identity(library)
    os.utime(library.parent / "src" / "kernel.cpp")  # now: newer than the object and library

    assert_announced(start(source, extensions))
    assert identity(library) != built
    assert start(source, extensions) == []


@pytest.mark.slow
def test_a_rebuild_that_no_check_foresaw_still_says_it_built(tmp_path: Path) -> None:
    # The folder's library built from another build.ninja, as a build input outside the key
    # would leave it: the loader writes its own, ninja sees a changed command and recompiles.
    extensions = tmp_path / "torch_extensions"
    source = checkout(tmp_path / "checkout")
    start(source, extensions)
    (library,) = libraries(extensions)
    build_file = library.parent / "build.ninja"
    build_file.write_text(build_file.read_text().replace("-fno-math-errno", "-DOTHER_BUILD"))
    ninja = shutil.which("ninja") or "ninja"
    subprocess.run([ninja, "-C", str(library.parent)], check=True, capture_output=True)
    built = identity(library)

    lines = start(source, extensions)
    assert identity(library) != built
    assert lines and lines[-1].startswith(ENDED), lines
