"""The README's layout list names every module of the package: each .py file under batchpage/
and kernels/ (a subpackage's __init__.py aside) and each C++ source and header under kernels/,
in the folder the list puts it in, and names nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("batchpage", "kernels")


def layout_entries() -> set[str]:
    """The paths the README's Layout section lists: a folder line (`    batchpage/data/  ...`)
    sets the folder, an entry line below it (`      spec.py  ...`) names a file in it."""
    section = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    folder, found = None, set()
    for line in section.splitlines():
        if m := re.match(r"^ {4}(\S+/)(\s|$)", line):
            folder = m.group(1)
        elif (m := re.match(r"^ {6}(\S+)", line)) and folder is not None:
            found.add(folder + m.group(1))
    return found


def modules() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts or path.suffix not in (".py", ".cpp", ".h"):
                continue
            if path.name == "__init__.py" and rel.parent != Path("batchpage"):
                continue  # a subpackage's marker; batchpage/__init__.py holds the public names
            found.add(rel.as_posix())
    return found


def test_every_module_is_in_the_readme_layout() -> None:
    missing = modules() - layout_entries()
    assert not missing, f"README's Layout lacks {sorted(missing)}"


def test_the_readme_layout_names_only_modules_that_exist() -> None:
    listed = {p for p in layout_entries() if p.split("/", 1)[0] in PACKAGES}
    assert listed, "the Layout section was not found or parsed"
    assert not (listed - modules()), f"README's Layout names {sorted(listed - modules())}"
