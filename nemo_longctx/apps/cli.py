"""``nemo-longctx`` console script: ``nemo-longctx train [overrides]`` (nemo_longctx.apps.train) and
``nemo-longctx plan [args]`` (nemo_longctx.apps.plan). Hydra parses ``sys.argv``, so the subcommand is removed from it
before the app runs."""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: nemo-longctx <command> [hydra overrides]

commands:
  train   NeMo 2 pre-training with context parallelism (default: tiny Llama, CP=2 ring, 2 CPU processes)
          e.g. nemo-longctx train model=llama3_8b cp=ring cp.size=8 trainer.devices=8 \
model.seq_length=131072 run.dry_run=true
          (run.dry_run=true builds and validates the configuration without training; drop it to train)
  bridge  Megatron-Bridge pre-training with context parallelism (Python 3.12 stack; default: the CPU demo)
          e.g. nemo-longctx bridge recipe=llama3_8b_pretrain_config cp=ring cp.size=8 train.train_iters=100
  plan    memory/parallelism planner
          e.g. nemo-longctx plan model=llama3_8b plan.seq_length=1048576 plan.gpus=8 plan.gpu_memory_gb=80
  import  Hugging Face model dir -> NeMo checkpoint (Llama 3.x, Qwen2/2.5), for train init_from=<dir>
          e.g. nemo-longctx import source=/models/Llama-3.1-8B output=/ckpt/llama31-8b
  export  NeMo checkpoint (trained from an import) -> Hugging Face model dir
          e.g. nemo-longctx export checkpoint=outputs/train output=/models/llama31-8b-128k
  fuzz    trains drawn parallel compositions (TP, CP, PP, DP, EP, model states, memory options) of tiny models on CPU
          processes, each against one rank; exit 1 when one differs
          e.g. nemo-longctx fuzz --seed 1 --cases 40 --max-world 8
  bridge-export  Megatron-Bridge checkpoint (nemo-longctx bridge init_from=<HF dir> checkpoint.save=<dir>) -> Hugging
          Face model dir, through Bridge's AutoBridge (Python 3.12 stack)
          e.g. nemo-longctx bridge-export checkpoint=/ckpt/run1 output=/models/llama-128k

nemo-longctx train|plan|bridge --help: the command's config groups and keys; --hydra-help: Hydra's own help.
nemo-longctx --version: this package's version and the installed stack's.
nemo-longctx --versions: the same, then every third-party name this package patches (its patch ledgers).
"""

COMMANDS = {"train": "nemo_longctx.apps.train", "bridge": "nemo_longctx.apps.bridge", "plan": "nemo_longctx.apps.plan",
            "import": "nemo_longctx.apps.convert:import_main", "export": "nemo_longctx.apps.convert:export_main",
            "bridge-export": "nemo_longctx.apps.bridge_convert:export_main", "fuzz": "nemo_longctx.apps.fuzz"}


HELP_APPS = ("train", "plan")  # `nemo-longctx <app> --help` answered by nemo_longctx.apps.help (bridge: by its main)


def main(argv=None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if len(argv) >= 2 else 2)
    if argv[1] in ("-V", "--version", "--versions"):
        from nemo_longctx.shared.versions import version_lines

        lines = version_lines()
        if argv[1] == "--versions":
            from nemo_longctx.apps.ledgers import ledger_lines

            lines += ledger_lines()
        print("\n".join(lines))
        sys.exit(0)
    command = argv[1]
    if command not in COMMANDS:
        print(f"nemo-longctx: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    if command in HELP_APPS and any(a in ("-h", "--help") for a in argv[2:]):  # answered without the app's imports
        from nemo_longctx.apps.help import maybe_print_help

        maybe_print_help(command, argv[2:])
    module_name, _, function = COMMANDS[command].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"nemo-longctx: command {command!r} is not available in this installation ({e.name} is missing)",
                  file=sys.stderr)
            sys.exit(2)
        raise
    sys.argv = [f"{argv[0]} {command}"] + argv[2:]
    getattr(module, function or "main")()


if __name__ == "__main__":
    main()
