"""The library's log reaches the user through the Python API (a program that configured no
logging), never twice once it did; long steps say they are still running; a kernel built at
first use says so before and after."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from batchpage.user_log import PackageHandler, heartbeat

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_package_messages_reach_stderr_only_while_no_logging_is_configured(tmp_path) -> None:
    done = run_python(
        """
        import logging, batchpage
        logging.getLogger("batchpage.model.loader").info("converting the tokenizer")
        logging.basicConfig(format="root: %(message)s")
        logging.getLogger("batchpage.model.loader").info("once more")
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["batchpage: converting the tokenizer", "root: once more"]


def test_heartbeat_says_a_long_step_is_still_running() -> None:
    log = logging.getLogger("batchpage.test_heartbeat")
    seen: list[str] = []
    beaten = threading.Event()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())
            if len(seen) == 2:
                beaten.set()

    handler = Collect()
    log.addHandler(handler)
    try:
        with heartbeat(log, "building a kernel", every=0.01):
            assert beaten.wait(60)  # the step "runs" until two beats were heard
    finally:
        log.removeHandler(handler)
    assert all(m.startswith("building a kernel: still running (") for m in seen)
    assert isinstance(logging.getLogger("batchpage").handlers[0], PackageHandler)


@pytest.mark.slow  # a compile: about a minute on 2 cores
@pytest.mark.skipif(sys.platform != "linux", reason="the C++ kernels build on Linux")
def test_a_kernel_built_at_first_use_says_so_before_and_after(tmp_path) -> None:
    source = tmp_path / "tiny_kernel.cpp"
    source.write_text(
        "#include <torch/extension.h>\n"
        "int64_t one() { return 1; }\n"
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("one", &one); }\n'
    )
    done = run_python(
        f"""
        from pathlib import Path
        from batchpage.kernels.cpu_build import build_extension
        assert build_extension(Path({str(source)!r}), "tiny", "a tiny test kernel").one() == 1
        """,
        tmp_path,
        TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("batchpage: ")]
    assert lines[0].startswith("batchpage: building a tiny test kernel, tiny_"), done.stderr
    assert lines[-1].startswith("batchpage: built a tiny test kernel in "), done.stderr
