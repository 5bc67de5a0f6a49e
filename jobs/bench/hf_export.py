"""A GGUF model as a Hugging Face safetensors folder, for peers that cannot read GGUF: the
package's export (batchpage/model/hf_export.py, `batchpage export-hf`) in float32, so every system
loads identical numbers and casts them to the run's dtype itself, cached and rebuilt when the GGUF
file changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from batchpage.model.hf_export import export_hf
from batchpage.model.loader import ModelSource, resolve_model_source
from batchpage.paths import cache_dir
from jobs.bench.report import log

STAMP = "batchpage_export.json"


def hf_folder_for(model: str, root: Path | None = None) -> Path:
    """The model as a HF folder: itself if it is one, else its cached float32 export."""
    source = resolve_model_source(model)
    if source.kind == "hf":
        return source.path
    folder = (root or cache_dir() / "hf_export") / f"{source.path.stem}-float32"
    stamp = _stamp(source)
    if (folder / STAMP).is_file() and json.loads((folder / STAMP).read_text()) == stamp:
        return folder
    log(f"exporting {source.path.name} as a float32 HF folder in {folder}")
    shutil.rmtree(folder, ignore_errors=True)
    export_hf(source.path, folder)
    (folder / STAMP).write_text(json.dumps(stamp))
    return folder


def _stamp(source: ModelSource) -> dict[str, object]:
    stat = source.path.stat()
    return {"gguf": str(source.path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
