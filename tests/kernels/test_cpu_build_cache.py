"""The kernels' libraries are cached by content: their name is a hash of the sources and headers,
the flags, the instruction-set level, the torch build, the Python ABI and the compiler's version,
and never of a path. So a second environment (another venv, whose torch headers lie in another
folder) loads the first one's library without compiling, where torch's loader, keyed by paths,
rebuilt every kernel; a library that is there is loaded with no build step at all; processes
that start together build a kernel once; a broken library is built again, saying so."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchpage.cpu_info import ISA_LEVELS, native_isa_level
from batchpage.kernels.cpu_build import ISA_CFLAGS, BuildInputs, extension_name

ROOT = Path(__file__).resolve().parents[2]
# A module of pybind11 alone: it builds in seconds (torch/extension.h takes most of a minute). It
# says which instruction-set macros its build had.
SOURCE = """#include <pybind11/pybind11.h>
#include <string>
static std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("answer", [] { return 42; });
  m.def("isa", &isa);
}
"""
# argv: the source, then optionally a link to torch's package folder: a second environment with
# the same torch, whose headers torch's loader names by another path, as in a venv.
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
    "print(module.answer(), module.isa())\n"
)
STARTED = "batchpage: building the test module, batchpage_test_cache_"
ENDED = "batchpage: built the test module in "


def command(source: Path, torch_link: Path | None = None) -> list[str]:
    return [sys.executable, "-c", BUILD, str(source), *([str(torch_link)] if torch_link else [])]


def environment(extensions: Path, isa: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(extensions)}
    env.pop("BATCHPAGE_CPU_ISA", None)
    return {**env, "BATCHPAGE_CPU_ISA": isa} if isa else env


def messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("batchpage: ")]


def start(
    source: Path, extensions: Path, torch_link: Path | None = None, isa: str | None = None
) -> tuple[list[str], str]:
    """One start of a program that builds or loads the test module: its log lines and the
    instruction-set level its library was compiled for."""
    proc = subprocess.run(
        command(source, torch_link),
        env=environment(extensions, isa),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    answer, compiled_for = proc.stdout.split()
    assert answer == "42"
    return messages(proc.stderr), compiled_for


def assert_announced(lines: list[str]) -> None:
    """The start line first, the end line last (heartbeats between, on a slow machine)."""
    assert lines and lines[0].startswith(STARTED), lines
    assert lines[-1].startswith(ENDED), lines


def checkout(root: Path, text: str = SOURCE) -> Path:
    """One checkout's copy of the kernel source."""
    root.mkdir(parents=True)
    (root / "kernel.cpp").write_text(text)
    return root / "kernel.cpp"


def libraries(extensions: Path) -> list[Path]:
    return sorted(extensions.rglob("batchpage_test_cache_*.so"))


def identity(path: Path) -> tuple[int, int]:
    """Inode and modification time: a rebuilt library differs."""
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
    changed = [
        dataclasses.replace(here, torch_build="2.99.0+cpu 0123abc cxx11abi=1"),
        dataclasses.replace(here, python_abi="cpython-399-x86_64-linux-gnu"),
        dataclasses.replace(here, compiler="clang++"),
        dataclasses.replace(here, compiler_version="c++ (GCC) 9.5.0"),
        dataclasses.replace(here, isa="portable" if here.isa != "portable" else "avx2"),
        dataclasses.replace(here, cflags=(*here.cflags, "-mno-avx512bf16")),
        dataclasses.replace(here, ldflags=()),
    ]
    names = {extension_name("k", sources, inputs) for inputs in changed}
    assert len(names) == len(changed) and name not in names
    assert name != extension_name("k", [sources[0] + b"\n// edited\n", sources[1]], here)
    assert name != extension_name("k", [sources[0], sources[1] + b"\n// edited\n"], here)


def test_a_second_environment_has_the_same_inputs(monkeypatch, tmp_path: Path) -> None:
    """What differs between two venvs with one torch, Python and compiler: where torch's and
    Python's headers and libraries lie, and which folder `c++` is found in."""
    from torch.utils import cpp_extension

    here = BuildInputs.here()
    real = os.path.dirname(torch.__file__)
    include_paths, library_paths = cpp_extension.include_paths, cpp_extension.library_paths
    monkeypatch.setattr(
        cpp_extension, "include_paths",
        lambda *a, **k: [p.replace(real, "/venv-b/torch") for p in include_paths(*a, **k)],
    )  # fmt: skip
    monkeypatch.setattr(
        cpp_extension, "library_paths",
        lambda *a, **k: [p.replace(real, "/venv-b/torch") for p in library_paths(*a, **k)],
    )  # fmt: skip
    bin_b = tmp_path / "venv-b" / "bin"
    bin_b.mkdir(parents=True)
    for tool in ("c++", "ninja"):
        if found := next(
            (Path(d) / tool for d in os.environ["PATH"].split(":") if (Path(d) / tool).is_file()),
            None,
        ):
            (bin_b / tool).symlink_to(found)
    monkeypatch.setenv("PATH", f"{bin_b}:{os.environ['PATH']}")
    assert cpp_extension.include_paths()[0].startswith("/venv-b/torch")
    assert BuildInputs.here() == here


def test_threads_that_ask_at_once_in_a_new_process_get_the_same_inputs() -> None:
    """build_all builds on threads, and each asks for its inputs as it starts: in a fresh
    interpreter two threads asking at the same moment must agree (sysconfig's lazily filled
    SOABI read None in one of them, which named and built a second copy of a kernel)."""
    code = (
        "import threading\n"
        "from batchpage.kernels.cpu_build import BuildInputs\n"
        "got = []\n"
        "ts = [threading.Thread(target=lambda: got.append(BuildInputs.here())) for _ in range(4)]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
        "print(len(set(got)))\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "1"


def test_cflags_are_part_of_the_build_inputs() -> None:
    portable = BuildInputs.here(("-mno-avx512bf16",))
    assert portable.cflags[-1] == "-mno-avx512bf16"
    assert portable.cflags[:-1] == BuildInputs.here().cflags


def test_the_flags_follow_the_isa_level_not_the_cpu(monkeypatch) -> None:
    """-march=native would make every CPU model a build of its own: the flags name the level's
    instructions, and BATCHPAGE_CPU_ISA lowers it."""
    assert "-march=native" not in BuildInputs.here().cflags
    assert set(ISA_CFLAGS) == {level.name for level in ISA_LEVELS}
    monkeypatch.delenv("BATCHPAGE_CPU_ISA", raising=False)
    assert BuildInputs.here().isa == native_isa_level().name
    monkeypatch.setenv("BATCHPAGE_CPU_ISA", "portable")
    portable = BuildInputs.here()
    assert portable.isa == "portable" and not any("avx" in f for f in portable.cflags)
    if native_isa_level().name == "portable":
        return
    monkeypatch.setenv("BATCHPAGE_CPU_ISA", "avx2")
    avx2 = BuildInputs.here()
    assert avx2.isa == "avx2" and {"-mavx2", "-mfma", "-mf16c"} <= set(avx2.cflags)
    assert not any(f.startswith("-mavx512") for f in avx2.cflags)
    assert extension_name("k", [b"x"], avx2) != extension_name("k", [b"x"], portable)


@pytest.mark.slow
def test_a_second_environment_loads_the_first_ones_build_without_compiling(
    tmp_path: Path,
) -> None:
    extensions = tmp_path / "torch_extensions"
    source, env_b = checkout(tmp_path / "checkout-a"), second_environment(tmp_path)
    lines, compiled_for = start(source, extensions)
    assert_announced(lines)
    assert compiled_for == native_isa_level().name
    (library,) = libraries(extensions)
    built = identity(library)

    # Another checkout in another environment: loaded, not built, and the library untouched.
    assert start(checkout(tmp_path / "checkout-b"), extensions, env_b) == ([], compiled_for)
    assert start(source, extensions) == ([], compiled_for)
    assert libraries(extensions) == [library] and identity(library) == built
    # Only the library (and its lock) stays: the build folder went.
    assert {p.suffix for p in library.parent.iterdir()} == {".so", ".lock"}


@pytest.mark.slow
def test_an_edited_source_or_another_level_builds_beside_the_first(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    source = checkout(tmp_path / "checkout")
    assert_announced(start(source, extensions, isa="portable")[0])
    (first,) = libraries(extensions)
    built = identity(first)

    edited = checkout(tmp_path / "edited", SOURCE + "// edited\n")
    lines, compiled_for = start(edited, extensions, isa="portable")
    assert_announced(lines)
    assert compiled_for == "portable" and len(libraries(extensions)) == 2
    if native_isa_level().name != "portable":
        lines, compiled_for = start(source, extensions, isa="avx2")
        assert_announced(lines)
        assert compiled_for == "avx2" and len(libraries(extensions)) == 3
    assert identity(first) == built


@pytest.mark.slow
def test_processes_that_start_together_build_once(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    source = checkout(tmp_path / "checkout")
    env = environment(extensions, "portable")
    procs = [
        subprocess.Popen(
            command(source), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.split() for out, _ in outs] == [["42", "portable"]] * 2
    builds = [m for _, err in outs for m in messages(err) if m.startswith(STARTED)]
    assert len(builds) == 1, outs
    assert len(libraries(extensions)) == 1


@pytest.mark.slow
def test_a_library_that_does_not_load_is_built_again(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    source = checkout(tmp_path / "checkout")
    start(source, extensions, isa="portable")
    (library,) = libraries(extensions)
    library.write_bytes(b"not a library")

    lines, compiled_for = start(source, extensions, isa="portable")
    assert "does not load" in lines[0], lines
    assert_announced(lines[1:])
    assert compiled_for == "portable" and libraries(extensions) == [library]
    assert start(source, extensions, isa="portable") == ([], "portable")
