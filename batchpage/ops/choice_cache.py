"""The measured linear choices of one setup, on disk (ops/measured_linear.py): shape -> the
chosen candidate, with the runner-up and how the measurement went, so that a later start can
spot-check the choice against the runner-up and report the load it was measured under.

Only reliable measurements are cached as choices. One taken on a busy machine, or too noisy to
tell the winner, is kept apart as provisional: the next start measures that shape again unless
the machine is still busy (then it uses the provisional choice rather than measure just as
unreliably again). An older batchpage reading this file sees the choices alone."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

from batchpage.fileio import atomic_write_text
from batchpage.paths import cache_dir

log = logging.getLogger(__name__)


class CachedChoice(NamedTuple):
    choice: str
    runner_up: str | None  # second at its measurement; None in a cache written before it was kept
    measured: dict[str, Any]  # how that measurement went (linear_timing.Trust.record()), or {}
    provisional: bool = False  # measured unreliably: not a win, measured again when it can be


class ChoiceCache:
    """Measured choices of one setup (`key`: what decides them), one JSON file each under
    `folder` (default: cache_dir()/linear_choices): {"key", "choices": shape -> candidate,
    "measured": shape -> {"runner_up", the measurement's figures}, "provisional": shape ->
    {"choice", "runner_up", the figures}}."""

    def __init__(self, key: dict[str, str], folder: Path | None = None) -> None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.key = key
        self.path = (folder or cache_dir() / "linear_choices") / f"{digest}.json"

    def get(self, shape: str) -> str | None:
        """The choice cached as a win for `shape` (a provisional one is not)."""
        choice = self._read()["choices"].get(shape)
        return choice if isinstance(choice, str) else None

    def entry(self, shape: str) -> CachedChoice | None:
        """The win cached for `shape`, else its provisional choice, else None."""
        data = self._read()
        choice = data["choices"].get(shape)
        about = data["measured"].get(shape)
        provisional = not isinstance(choice, str)
        if provisional:
            about = data["provisional"].get(shape)
            choice = about.get("choice") if isinstance(about, dict) else None
            if not isinstance(choice, str):
                return None
        about = dict(about) if isinstance(about, dict) else {}
        about.pop("choice", None)
        runner_up = about.pop("runner_up", None)
        runner_up = runner_up if isinstance(runner_up, str) else None
        return CachedChoice(choice, runner_up, about, provisional)

    def put(
        self,
        shape: str,
        choice: str,
        runner_up: str | None = None,
        measured: dict[str, Any] | None = None,
        provisional: bool = False,
    ) -> None:
        """Record a choice (and its runner-up and figures) as a win, or as `provisional` (where
        no win is cached for the shape: a win is never replaced by a provisional choice);
        another process's choices written meanwhile are kept."""
        data = self._read()
        about = {"runner_up": runner_up, **(measured or {})}
        if provisional:
            if shape in data["choices"]:
                return
            data["provisional"][shape] = {"choice": choice, **about}
        else:
            data["choices"][shape], data["measured"][shape] = choice, about
            data["provisional"].pop(shape, None)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"key": self.key, **data}, indent=1, sort_keys=True)
            atomic_write_text(self.path, text)
        except OSError as exc:  # a read-only cache folder: measured again next time
            log.warning("cannot save the measured linear choices to %s (%s)", self.path, exc)

    def _read(self) -> dict[str, dict[str, Any]]:
        """The file's choices, measured and provisional parts ({} each where absent)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        parts = ("choices", "measured", "provisional")
        return {p: dict(data[p]) if isinstance(data.get(p), dict) else {} for p in parts}
