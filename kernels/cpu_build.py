"""Building the C++ CPU kernels (cpu_paged_decode.cpp, cpu_layer_ops.cpp) with torch's JIT
extension loader: once per source, torch build and CPU, into torch's extension folder
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), where later builds find them. The
build is keyed by content alone: any checkout (or installed copy) of the same sources reuses it.

The build needs a C++ compiler with OpenMP (g++) and ninja; `build_extension` raises
KernelBuildError, with the compiler's message, when that is impossible.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from types import ModuleType

import torch

from batchpage.user_log import heartbeat

HERE = Path(__file__).parent
# Included by the kernels (8- and 16-lane vectors, the vector exp); shipped in the wheel too.
HEADERS = (HERE / "cpu_vec.h",)

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


def extension_name(prefix: str, sources: list[bytes]) -> str:
    """The library's name in the extension folder. It changes with the sources (the kernel and
    the headers it includes), the torch build and the CPU, so that an edited kernel is rebuilt
    rather than an old library reloaded."""
    key = hashlib.sha256(b"\n".join([*sources, torch.__version__.encode(), _cpu_flags().encode()]))
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


def _is_built(folder: Path, name: str) -> bool:
    """Whether torch's extension folder already holds this build (then it is only loaded)."""
    return (folder / "build.ninja").is_file() and (folder / f"{name}.so").is_file()


def build_extension(
    source: Path, prefix: str, what: str, verbose: bool = False, cflags: tuple[str, ...] = ()
) -> ModuleType:
    """Compile (on first use) or load the extension built from `source`.
    `what` names it in messages ("the CPU paged-decode kernel"). `cflags` add to the compiler's
    flags (tests build a kernel's portable path with -mno-... on any CPU)."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        texts = [source.read_bytes(), *(h.read_bytes() for h in HEADERS)]
    except OSError as exc:
        raise KernelBuildError(
            f"the source of {what} is missing ({exc}): reinstall batchpage, whose wheel ships "
            "kernels/*.cpp and *.h; attention_backend='torch' runs without it"
        ) from exc
    name = extension_name(prefix, [*texts, " ".join(cflags).encode()] if cflags else texts)
    try:
        folder = _build_folder(name)
        names = [source.name, *(h.name for h in HEADERS)]
        staged = _stage_sources(folder, dict(zip(names, texts, strict=True)))
    except OSError as exc:
        raise KernelBuildError(
            f"cannot write {what}'s build folder under torch's extension folder ({exc}): set "
            "TORCH_EXTENSIONS_DIR to a writable folder; attention_backend='torch' runs without it"
        ) from exc
    building = not _is_built(folder, name)
    if building:  # `make setup` builds every kernel ahead (python -m batchpage.kernels.build_all)
        log.info("building %s, %s (about 45 s on 2 cores; once, then cached)", what, name)
    started = time.perf_counter()
    try:
        with heartbeat(log, f"building {what}") if building else contextlib.nullcontext():
            module = cpp_extension.load(
                name=name,
                sources=[str(staged / source.name)],
                extra_include_paths=[str(staged)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", *cflags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=verbose,
            )
    except (RuntimeError, OSError, ImportError) as exc:
        raise KernelBuildError(
            f"could not build {what} ({name}): {exc}. It needs g++ with OpenMP and ninja "
            "(pip install ninja); attention_backend='torch' runs without them"
        ) from exc
    if building:
        log.info("built %s in %.0f s", what, time.perf_counter() - started)
    return module
