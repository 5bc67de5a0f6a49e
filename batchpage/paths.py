"""Where batchpage keeps files it derives once and reuses (converted tokenizers, extracted
bundled datasets)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$BATCHPAGE_CACHE, else $XDG_CACHE_HOME/batchpage, else ~/.cache/batchpage."""
    if env := os.environ.get("BATCHPAGE_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "batchpage"
