"""Building the C++ CPU kernels (cpu_paged_decode.cpp, cpu_layer_ops.cpp) with torch's JIT
extension loader: once per source and build environment, into torch's extension folder
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), where later builds find them.

The build folder is keyed by everything that changes the library or that torch's loader writes
into the folder's build.ninja: the sources' content, the torch build, the compiler, the compiler
and linker flags, the include and library paths (torch's and Python's) and the CPU. Any checkout
or environment with the same inputs reuses one build; an environment whose inputs differ (a
second venv, whose torch headers lie in another folder) gets its own folder. Without the paths in
the key, two venvs sharing the extension folder rewrote each other's build.ninja, and ninja, which
rebuilds when a command changes, recompiled the other's kernels at every start.

A build never runs unannounced: it logs "building ..." before and "built ... in N s" after,
whether the library is missing or ninja finds it out of date (a source or header newer than the
library: torch reinstalled in place).

The build needs a C++ compiler with OpenMP (g++) and ninja; `build_extension` raises
KernelBuildError, with the compiler's message, when that is impossible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from batchpage.user_log import heartbeat

HERE = Path(__file__).parent
# Included by the kernels (8- and 16-lane vectors, the vector exp); shipped in the wheel too.
HEADERS = (HERE / "cpu_vec.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
# `ninja -n` reads a few small files; far longer means something is wrong (then: announce).
DRY_RUN_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    pass


def _cpu_flags() -> str:
    """The instruction sets -march=native compiles for: a library built on another CPU (a
    shared cache folder) must not be loaded here."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@dataclasses.dataclass(frozen=True)
class BuildInputs:
    """Everything besides the sources that changes the library or that torch's loader names in
    build.ninja (there, any change of a command makes ninja rebuild). `cflags` and `ldflags` are
    exactly what the build passes to the loader; the paths are those the loader writes."""

    torch_build: str  # torch's version and commit: its headers, ABI and link libraries
    compiler: str  # as build.ninja names it ($CXX or c++)
    compiler_path: str  # what that name runs here: another venv may put another c++ on PATH
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    include_paths: tuple[str, ...]  # torch's include folders, then Python's
    library_paths: tuple[str, ...]  # torch's lib folder (-L)
    cpu: str  # the instruction sets -march=native targets

    @classmethod
    def here(cls, cflags: Sequence[str] = ()) -> BuildInputs:
        """This process's inputs, with `cflags` after the kernels' own flags."""
        from torch.utils import cpp_extension

        compiler = cpp_extension.get_cxx_compiler()
        found = shutil.which(compiler)
        # The same path that torch's loader writes for Python.h (posix_prefix: see its comment).
        python_include = sysconfig.get_path("include", scheme="posix_prefix")
        return cls(
            torch_build=f"{torch.__version__} {torch.version.git_version}",
            compiler=compiler,
            compiler_path=os.path.realpath(found) if found else "",
            cflags=(*CFLAGS, *cflags),
            ldflags=LDFLAGS,
            include_paths=(*cpp_extension.include_paths(), python_include),
            library_paths=tuple(cpp_extension.library_paths()),
            cpu=_cpu_flags(),
        )

    def key_parts(self) -> list[bytes]:
        """The fields as bytes, in a fixed order, for the build's key."""
        return [f"{f.name}={getattr(self, f.name)!r}".encode() for f in dataclasses.fields(self)]


def extension_name(prefix: str, sources: list[bytes], inputs: BuildInputs | None = None) -> str:
    """The library's name, and its build folder's, in the extension folder. It changes with the
    sources (the kernel and the headers it includes) and with every build input (default: this
    process's, BuildInputs.here()), so that an edited kernel is rebuilt rather than an old
    library reloaded, and an environment with other inputs builds beside, never over, another's
    library. Equal arguments give equal names in any process."""
    parts = [*sources, *(inputs or BuildInputs.here()).key_parts()]
    key = hashlib.sha256()
    for part in parts:  # length-prefixed: no two lists of parts hash the same bytes
        key.update(len(part).to_bytes(8, "little"))
        key.update(part)
    return f"{prefix}_{key.hexdigest()[:12]}"


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH. The PyPI package (a dependency) installs it next
    to the interpreter, which is not always on PATH (a venv used without activating it)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build then fails with torch's message, inside KernelBuildError
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _build_folder(name: str) -> Path:
    """torch's folder for extension `name` ($TORCH_EXTENSIONS_DIR/<python>_<device>/<name>),
    created if missing."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def _stage_sources(folder: Path, files: dict[str, bytes]) -> Path:
    """Copies the sources into `folder/src` and returns that folder. torch's loader writes the
    sources' paths into build.ninja, and ninja rebuilds whenever a path there changes: built from
    the checkout's own files, two checkouts sharing one extension folder would rebuild each
    other's library at every start. Staged under the folder that the content hash names, the
    paths are the same from any checkout. A file already staged with the same bytes is left as
    it is (ninja also rebuilds when a source is newer than the library)."""
    staged = folder / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for file_name, data in files.items():
        target = staged / file_name
        try:
            if target.read_bytes() == data:
                continue
        except OSError:
            pass
        # Renamed into place: a process building at the same time never reads half a file.
        temp = staged / f".{file_name}.{os.getpid()}.tmp"
        temp.write_bytes(data)
        os.replace(temp, target)
    return staged


def _ninja_has_work(folder: Path) -> bool:
    """Whether ninja, run on the folder's build.ninja, would compile or link: the staleness
    check that torch's loader leaves to ninja (an object missing, a source or an included header
    newer than the library, a command changed since the library was built). Asked with a dry run,
    which writes nothing. True when ninja cannot answer: better a needless announcement than a
    silent build."""
    ninja = shutil.which("ninja")
    if ninja is None:
        return False  # the load fails at once, with torch's message: nothing to announce
    try:
        done = subprocess.run(
            [ninja, "-n", "-C", str(folder)],
            capture_output=True,
            text=True,
            timeout=DRY_RUN_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return True
    return done.returncode != 0 or "ninja: no work to do." not in done.stdout


def _build_reason(folder: Path, name: str) -> str | None:
    """Why loading `name` from `folder` will compile, or None when it only loads the library.
    Since the folder's key covers every input that build.ninja names, the build file that the
    loader writes is the one already there; what is left to check is the library and ninja's own
    view of it."""
    if not (folder / f"{name}.so").is_file() or not (folder / "build.ninja").is_file():
        return "once, then cached"
    if _ninja_has_work(folder):
        return "again: a file it is built from is newer than the library"
    return None


def _identity(path: Path) -> tuple[int, int] | None:
    """The file's inode and modification time (None if missing): a rebuilt library differs."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def build_extension(
    source: Path, prefix: str, what: str, verbose: bool = False, cflags: tuple[str, ...] = ()
) -> ModuleType:
    """Compile (on first use, or when ninja finds the build out of date) or load the extension
    built from `source`. `what` names it in messages ("the CPU paged-decode kernel"). `cflags`
    add to the compiler's flags (tests build a kernel's portable path with -mno-... on any CPU).
    Every compile logs "building <what>, <name> (...)" before it and "built <what> in N s"
    after it on this module's logger."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        texts = [source.read_bytes(), *(h.read_bytes() for h in HEADERS)]
    except OSError as exc:
        raise KernelBuildError(
            f"the source of {what} is missing ({exc}): reinstall batchpage, whose wheel ships "
            "kernels/*.cpp and *.h; attention_backend='torch' runs without it"
        ) from exc
    inputs = BuildInputs.here(cflags)
    name = extension_name(prefix, texts, inputs)
    try:
        folder = _build_folder(name)
        names = [source.name, *(h.name for h in HEADERS)]
        staged = _stage_sources(folder, dict(zip(names, texts, strict=True)))
    except OSError as exc:
        raise KernelBuildError(
            f"cannot write {what}'s build folder under torch's extension folder ({exc}): set "
            "TORCH_EXTENSIONS_DIR to a writable folder; attention_backend='torch' runs without it"
        ) from exc
    library = folder / f"{name}.so"
    before = _identity(library)
    reason = _build_reason(folder, name)
    if reason:  # `make setup` builds every kernel ahead (python -m batchpage.kernels.build_all)
        log.info("building %s, %s (about 45 s on 2 cores; %s)", what, name, reason)
    started = time.perf_counter()
    try:
        with heartbeat(log, f"building {what}") if reason else contextlib.nullcontext():
            module = cpp_extension.load(
                name=name,
                sources=[str(staged / source.name)],
                extra_include_paths=[str(staged)],
                extra_cflags=list(inputs.cflags),
                extra_ldflags=list(inputs.ldflags),
                build_directory=str(folder),
                verbose=verbose,
            )
    except (RuntimeError, OSError, ImportError) as exc:
        raise KernelBuildError(
            f"could not build {what} ({name}): {exc}. It needs g++ with OpenMP and ninja "
            "(pip install ninja); attention_backend='torch' runs without them"
        ) from exc
    elapsed = time.perf_counter() - started
    if reason:
        log.info("built %s in %.0f s", what, elapsed)
    elif _identity(library) != before:
        # The checks above missed a rebuild (a build input outside the key): still say it.
        log.warning(
            "built %s in %.0f s: torch's loader rebuilt %s unannounced, although its build "
            "looked current",
            what,
            elapsed,
            name,
        )
    return module
