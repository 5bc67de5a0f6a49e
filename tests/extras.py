"""The tests' one way to need an optional extra (batchpage[ray], batchpage[lm_eval], ...).

    ray = require("ray", "ray")          # in a test, a fixture, or at a module's top

Where the extra is missing a test that needs it skips, naming the install command; under CI=true
it fails instead, so a CI setup that forgot an extra fails rather than passing with tests gone.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    """CI=true (any non-empty value), as tests.model_factory reads it for the bundled model."""
    return bool(os.environ.get("CI"))


def missing(module: str) -> ModuleNotFoundError | None:
    """Why `module` cannot be imported because it (or its package) is not installed; None when
    it imports. An installed module that fails to import raises its own error here."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or module.split(".")[0] != e.name.split(".")[0]:
            raise  # the module is there and lacks one of its own dependencies
        return e
    return None


def require(module: str, extra: str) -> ModuleType:
    """`module`, imported; missing, the calling test skips, or fails under CI=true."""
    error = missing(module)
    if error is None:
        return importlib.import_module(module)
    why = f"needs {module}: pip install 'batchpage[{extra}]' ({error})"
    if in_ci():
        pytest.fail(f"CI=true and a test {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)
