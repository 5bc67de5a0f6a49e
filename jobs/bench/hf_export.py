"""A GGUF model as a Hugging Face safetensors folder, for peers that cannot read GGUF.

The weights are batchpage's own dequantization of the GGUF (the tensors its loader copies into
the model, already under HF names), written in float32, so every system loads identical numbers
and casts them to the run's dtype itself. config.json and the tokenizer files come from
transformers' GGUF reader, the format peers expect. The folder is cached and rebuilt when the
GGUF file changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from batchpage.model.gguf_config import gguf_config
from batchpage.model.gguf_file import read_gguf_header
from batchpage.model.gguf_loader import _iter_tensors
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
    export_gguf(source, folder)
    (folder / STAMP).write_text(json.dumps(stamp))
    return folder


def _stamp(source: ModelSource) -> dict[str, object]:
    stat = source.path.stat()
    return {"gguf": str(source.path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def export_gguf(source: ModelSource, folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    log(f"exporting {source.path.name} as a float32 HF folder in {folder}")
    header = read_gguf_header(source.path)
    cfg = gguf_config(source.path, header)
    tensors = {
        name: t.to(torch.float32).contiguous()
        for name, t in _iter_tensors(source.path, header, cfg, held={})
    }
    config = AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: the loader reads embed_tokens for both
    elif "lm_head.weight" not in tensors:
        raise ValueError(f"{source.path}: untied embeddings but no output.weight tensor")
    config.dtype = torch.float32
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # whole or absent: an interrupted export leaves only the .tmp folder
