"""``nemo-longctx`` console script: ``nemo-longctx train [overrides]`` (nemo_longctx.train) and
``nemo-longctx plan [args]`` (nemo_longctx.plan). Hydra parses ``sys.argv``, so the subcommand is removed from it
before the app runs."""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: nemo-longctx <command> [hydra overrides]

commands:
  train   NeMo 2 pre-training with context parallelism (default: tiny Llama, CP=2 ring, 2 CPU processes)
          e.g. nemo-longctx train model=llama3_8b cp=ring cp.size=8 trainer.devices=8 model.seq_length=131072
  plan    memory/parallelism planner
"""

COMMANDS = {"train": "nemo_longctx.train", "plan": "nemo_longctx.plan"}


def main(argv=None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if len(argv) >= 2 else 2)
    command = argv[1]
    if command not in COMMANDS:
        print(f"nemo-longctx: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    try:
        module = importlib.import_module(COMMANDS[command])
    except ModuleNotFoundError as e:
        if e.name == COMMANDS[command]:
            print(f"nemo-longctx: command {command!r} is not available in this installation ({e.name} is missing)",
                  file=sys.stderr)
            sys.exit(2)
        raise
    sys.argv = [f"{argv[0]} {command}"] + argv[2:]
    module.main()


if __name__ == "__main__":
    main()
