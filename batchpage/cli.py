"""The `batchpage` console script: one command in front of the package's entry points.

    batchpage run dataset=evals ...        is  python -m batchpage.run dataset=evals ...
    batchpage lm-eval --tasks ...          is  python -m batchpage.lm_eval --tasks ...
    batchpage build-kernels                is  python -m batchpage.kernels.build_all
    batchpage export-hf smollm2 out/hf     is  python -m batchpage.model.hf_export smollm2 out/hf

Each subcommand gets the arguments after its name exactly as its module's own command line
would, so Hydra's flags (-m, --cfg job, --help) and lm-eval's pass through unchanged.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple

USAGE = "usage: batchpage <command> [arguments]   (batchpage <command> --help for its options)"


class Command(NamedTuple):
    module: str  # a module with a main() that reads sys.argv
    summary: str


COMMANDS = {
    "run": Command(
        "batchpage.run",
        "run a job: a dataset of prompts in, completions/embeddings/scores out as Parquet",
    ),
    "lm-eval": Command(
        "batchpage.lm_eval",
        "lm-evaluation-harness with --model batchpage (needs the batchpage[lm_eval] extra)",
    ),
    "build-kernels": Command(
        "batchpage.kernels.build_all",
        "build the C++ CPU kernels now (needs g++), so the first job does not wait for them",
    ),
    "export-hf": Command(
        "batchpage.model.hf_export",
        "write a GGUF model as a Hugging Face folder (to make a LoRA adapter for it with PEFT)",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        raise SystemExit(0 if args else 2)
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        known = ", ".join(COMMANDS)
        print(f"batchpage: no command {name!r} (commands: {known})\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    # The module reads its arguments from sys.argv, as under `python -m`.
    sys.argv = [f"batchpage {name}", *rest]
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as e:
        if (e.name or "batchpage").partition(".")[0] == "batchpage":
            raise  # a module of ours missing is a broken install: the traceback says where
        # An optional extra that is not installed: its message names the install command.
        print(f"batchpage {name}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    module.main()


if __name__ == "__main__":
    main()
