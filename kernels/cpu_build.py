"""Building the C++ CPU kernels (cpu_paged_decode.cpp, cpu_layer_ops.cpp, ...) with torch's JIT
extension loader, once per content: every environment on a machine shares one build.

A library is named by a hash of what it is made of and nothing else (extension_name): its
sources and the headers they include, the compiler flags, the instruction-set level it is
compiled for (batchpage.cpu_info.isa_level: CPUs of one level share a build, and
BATCHPAGE_CPU_ISA builds for a lower one), the torch build (version, commit, C++ ABI), the
Python ABI, and the compiler's version. Paths are not in it: a second venv with the same torch,
Python and compiler loads the first one's library. It lies in
<torch's extension folder>/batchpage/<name>.so ($TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions, where torch keeps the extensions it builds).

A library that is there is loaded directly, as a Python extension module: nothing is checked
against a build file, so nothing rebuilds it unasked (torch's loader, which lets ninja decide,
rebuilt the kernels whenever another environment had written its own paths into the build file).
A missing one is built into a fresh folder beside the cache and renamed into place, under a
lock: processes that start together build it once, and none loads half a file. A build never
runs unannounced: it logs "building ..." before and "built ... in N s" after.

The build needs a C++ compiler with OpenMP (g++) and ninja; `build_extension` raises
KernelBuildError, with the compiler's message, when that is impossible.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from batchpage.cpu_info import isa_level
from batchpage.user_log import heartbeat

HERE = Path(__file__).parent
# Included by the kernels (8- and 16-lane vectors, the vector exp); shipped in the wheel too.
HEADERS = (HERE / "cpu_vec.h",)
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
# Each level's instructions (batchpage.cpu_info.ISA_LEVELS), on x86-64's baseline: the kernels'
# vector paths are chosen by these macros, so one build serves every CPU of the level.
_X86_AVX2 = ("-march=x86-64", "-mavx2", "-mfma", "-mf16c")
_X86_AVX512 = (*_X86_AVX2, "-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl")
ISA_CFLAGS = {
    "portable": ("-march=x86-64",),
    "avx2": _X86_AVX2,
    "avx512": _X86_AVX512,
    "avx512_vnni": (*_X86_AVX512, "-mavx512vnni"),
    "avx512_bf16": (*_X86_AVX512, "-mavx512vnni", "-mavx512bf16"),
}
COMPILER_QUERY_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    pass


def level_cflags(level: str) -> tuple[str, ...]:
    """The compiler flags of an instruction-set level; none off x86-64, where only the portable
    level exists and the compiler's default target is it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    return ISA_CFLAGS[level]


def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version` ("c++ (GCC) 14.2.1 ..."), "" when it does not
    run (the build then fails with torch's message)."""
    try:
        done = subprocess.run(
            [compiler, "--version"],
            capture_output=True,
            text=True,
            timeout=COMPILER_QUERY_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.partition("\n")[0].strip()


@dataclasses.dataclass(frozen=True)
class BuildInputs:
    """Everything besides the sources that makes the library what it is, and nothing that
    differs between two environments whose libraries would be the same (paths)."""

    torch_build: str  # version, commit and C++ ABI: the headers, ABI and libraries linked
    python_abi: str  # the extension module's (SOABI: version, build, platform)
    compiler: str  # as torch's loader runs it ($CXX or c++)
    compiler_version: str  # `compiler --version`'s first line
    isa: str  # the instruction-set level (batchpage.cpu_info.ISA_LEVELS)
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]

    @classmethod
    def here(cls, cflags: Sequence[str] = (), isa: str | None = None) -> BuildInputs:
        """This process's inputs, with `cflags` after the kernels' own flags; `isa`: for that
        level rather than this process's (ValueError if the CPU lacks it)."""
        from torch.utils import cpp_extension

        compiler = cpp_extension.get_cxx_compiler()
        level = isa_level(isa).name
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        return cls(
            torch_build=f"{torch.__version__} {torch.version.git_version} cxx11abi={abi}",
            # The interpreter's extension suffix (".cpython-311-x86_64-linux-gnu.so"), fixed at
            # its start: sysconfig's SOABI is filled lazily and reads None in a second thread
            # asking at the same moment (build_all builds on threads), which renamed builds.
            python_abi=importlib.machinery.EXTENSION_SUFFIXES[0],
            compiler=compiler,
            compiler_version=compiler_version(compiler),
            isa=level,
            cflags=(*CFLAGS, *level_cflags(level), *cflags),
            ldflags=LDFLAGS,
        )

    def key_parts(self) -> list[bytes]:
        """The fields as bytes, in a fixed order, for the build's key."""
        return [f"{f.name}={getattr(self, f.name)!r}".encode() for f in dataclasses.fields(self)]


def extension_name(prefix: str, sources: list[bytes], inputs: BuildInputs | None = None) -> str:
    """The library's name in the cache. It changes with the sources (the kernel and the headers
    it includes) and with every build input (default: this process's, BuildInputs.here()), so
    that an edited kernel is rebuilt rather than an old library loaded; equal contents and
    inputs give equal names in any process and any environment."""
    parts = [*sources, *(inputs or BuildInputs.here()).key_parts()]
    key = hashlib.sha256()
    for part in parts:  # length-prefixed: no two lists of parts hash the same bytes
        key.update(len(part).to_bytes(8, "little"))
        key.update(part)
    return f"{prefix}_{key.hexdigest()[:12]}"


def cache_folder() -> Path:
    """Where the libraries lie: batchpage/ in torch's extension folder ($TORCH_EXTENSIONS_DIR,
    else torch's default, ~/.cache/torch_extensions)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / "batchpage"


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


def _import(name: str, library: Path) -> ModuleType:
    """The extension module in `library`, whose init function is named for `name`."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """Held by one process at a time (an advisory lock on `path`): the others wait for it,
    saying so."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building %s", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _supported(compiler: str, flags: tuple[str, ...]) -> tuple[str, ...]:
    """`flags` less the ones the compiler does not know (an older g++ has no -mavx512bf16):
    the kernel then builds its path without those instructions, as the bf16 linear reports."""

    def known(some: Sequence[str]) -> bool:
        try:
            done = subprocess.run(
                [compiler, "-Werror", *some, "-E", "-x", "c++", "-"],
                input="",
                capture_output=True,
                text=True,
                timeout=COMPILER_QUERY_TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError):
            return True  # then the build says what is wrong
        return done.returncode == 0

    if known(flags):
        return flags
    kept = tuple(f for f in flags if known([f]))
    log.warning("%s does not know %s: built without them", compiler, set(flags) - set(kept))
    return kept


def _build(
    source: Path, files: dict[str, bytes], name: str, inputs: BuildInputs, verbose: bool
) -> ModuleType:
    """Compile into a fresh folder beside the cache, move the library into the cache and load
    it. Another process may have put it there meanwhile: the newer file replaces it (the same
    content), and a process that loaded the older one keeps its copy."""
    from torch.utils import cpp_extension

    cache = cache_folder()
    with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=cache) as scratch:
        staged = Path(scratch) / "src"
        staged.mkdir()
        for file_name, data in files.items():
            (staged / file_name).write_bytes(data)
        module = cpp_extension.load(
            name=name,
            sources=[str(staged / source.name)],
            extra_include_paths=[str(staged)],
            extra_cflags=list(_supported(inputs.compiler, inputs.cflags)),
            extra_ldflags=list(inputs.ldflags),
            build_directory=scratch,
            verbose=verbose,
        )
        built = Path(module.__file__ or "")
        # torch's loader renames a second build of one name in a process (name_v1): that one
        # stays out of the cache, whose file must hold `name`'s init function.
        if built.name == f"{name}.so":
            os.replace(built, cache / built.name)
    return module


def build_extension(
    source: Path,
    prefix: str,
    what: str,
    verbose: bool = False,
    cflags: tuple[str, ...] = (),
    isa: str | None = None,
) -> ModuleType:
    """Load the library built from `source` from the cache, or compile it there first. `what`
    names it in messages ("the CPU paged-decode kernel"). `cflags` add to the compiler's flags;
    `isa` builds for that level instead of this process's (tests run a kernel's AVX2 or
    portable path on any CPU that has it, in the very build such a CPU loads). Every compile
    logs "building <what>, <name> (...)" before it and "built <what> in N s" after it on this
    module's logger."""
    try:
        files = {f.name: f.read_bytes() for f in (source, *HEADERS)}
    except OSError as exc:
        raise KernelBuildError(
            f"the source of {what} is missing ({exc}): reinstall batchpage, whose wheel ships "
            "kernels/*.cpp and *.h; attention_backend='torch' runs without it"
        ) from exc
    try:
        inputs = BuildInputs.here(cflags, isa)
    except ValueError as exc:  # BATCHPAGE_CPU_ISA names no level this CPU has
        raise KernelBuildError(f"cannot build {what}: {exc}") from exc
    name = extension_name(prefix, list(files.values()), inputs)
    library = cache_folder() / f"{name}.so"
    if library.is_file():
        try:
            return _import(name, library)
        except ImportError as exc:
            log.warning("%s does not load (%s): building it again", library, exc)
    _put_ninja_on_path()
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with _locked(library.with_suffix(".lock"), what):
            if library.is_file():  # built by the process that held the lock
                try:
                    return _import(name, library)
                except ImportError:
                    pass  # the same broken file: build it again
            log.info("building %s, %s for %s (about 45 s on 2 cores; once, then cached)",
                     what, name, inputs.isa)  # fmt: skip
            started = time.perf_counter()
            with heartbeat(log, f"building {what}"):
                module = _build(source, files, name, inputs, verbose)
    except OSError as exc:
        raise KernelBuildError(
            f"cannot build {what} in {library.parent} ({exc}): set TORCH_EXTENSIONS_DIR to "
            "a writable folder; attention_backend='torch' runs without it"
        ) from exc
    except (RuntimeError, ImportError) as exc:
        raise KernelBuildError(
            f"could not build {what} ({name}): {exc}. It needs g++ with OpenMP and ninja "
            "(pip install ninja); attention_backend='torch' runs without them"
        ) from exc
    log.info("built %s in %.0f s", what, time.perf_counter() - started)
    return module
