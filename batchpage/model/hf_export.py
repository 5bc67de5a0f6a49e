"""A GGUF model as a Hugging Face safetensors folder, for tools that read only such folders: PEFT,
to make or train a LoRA adapter for a GGUF model, and peers in benchmarks.

    batchpage export-hf smollm2 out/smollm2-hf [--dtype float32|bfloat16|float16]

The weights are batchpage's own dequantization of the GGUF (the tensors its loader copies into
the model, already under HF names, the Q/K rows in HF's order), so an adapter made on the folder
fits the GGUF model batchpage runs, and every system reading the folder loads the numbers
batchpage computes with. config.json and the tokenizer files come from transformers' GGUF
reader, the form those tools expect. The folder appears whole or not at all.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from batchpage.model.gguf_config import gguf_config
from batchpage.model.gguf_file import read_gguf_header
from batchpage.model.gguf_loader import _iter_tensors
from batchpage.model.loader import resolve_model_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """The model or the folder cannot be exported to: the message says why and what to do."""


def export_hf(model: str | Path, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Writes the GGUF model `model` (a bundled name or a .gguf path) as a HF folder at
    `folder`, which must not exist yet, and returns it. Raises ExportError for a model that is
    already a HF folder or a folder that exists."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_model_source(str(model))
    if source.kind == "hf":
        raise ExportError(f"{source.path} is already a Hugging Face folder: use it as it is")
    folder = Path(folder)
    if folder.exists():
        raise ExportError(f"{folder} exists: name a folder that does not exist yet")
    header = read_gguf_header(source.path)
    cfg = gguf_config(source.path, header)
    tensors = {
        name: t.to(dtype).contiguous()
        for name, t in _iter_tensors(source.path, header, cfg, held={})
    }
    config = AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: readers take embed_tokens for both
    elif "lm_head.weight" not in tensors:
        raise ExportError(f"{source.path}: untied embeddings but no output.weight tensor")
    config.dtype = dtype
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)  # whole or absent: an interrupted export leaves only the .tmp folder
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="batchpage export-hf",
        description="Write a GGUF model as a Hugging Face safetensors folder (e.g. for PEFT).",
    )
    parser.add_argument("model", help="a bundled model name (smollm2) or a .gguf file")
    parser.add_argument("folder", type=Path, help="the folder to create")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args = parser.parse_args(argv)
    try:
        folder = export_hf(args.model, args.folder, DTYPES[args.dtype])
    except ValueError as e:  # ExportError, or the model's own refusal (resolve_model_source)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
