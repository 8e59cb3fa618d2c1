"""``nemo-longctx train`` / ``python -m nemo_longctx.apps.train``: the Hydra app for NeMo 2 pre-training with
nemo_longctx context parallelism.

Flow: compose the config (``conf/train.yaml`` + the command line) -> read it into the run spec once
(``shared/run_spec.read_run_spec``; the recipe's values in the keys left null: ``resolve_recipe``) -> validate every
config-level problem at once ->
[no torchrun/srun and world > 1: start the local ranks with PyTorch's elastic agent, each re-running this app with
the *same command line*] -> every rank: build the NeMo objects (``integrations/nemo/app.py``), check that all ranks
resolved the same config (a hash compared over the process group), ``llm.train`` (NeMoLogger, AutoResume,
checkpoints, fit). The exit code is non-zero whenever any rank failed; the failed rank and its error are printed.

``run.dry_run=true`` builds and validates the same objects in one process, proves that every layer's
``core_attention`` resolves to ``LongContextCoreAttention``, prints a summary, and exits.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from typing import List, Optional

import hydra
from omegaconf import DictConfig

from nemo_longctx.shared.run_spec import RunSpec, read_run_spec
from nemo_longctx.shared.signals import PREEMPTED_EXIT, signals_of

from nemo_longctx.integrations.nemo.app import (  # noqa: F401  (re-exported: the app's public helpers)
    Built,
    resolve_recipe,
    recipe_line,
    ConfigError,
    build,
    config_problems,
    dry_run,
    raise_problems,
    save_time_warning,
    te_available,
)
from nemo_longctx.shared.launch import (
    CONFIG_ERROR_EXIT,
    Launch,
    detect_external_launch,
    die_with_parent,
    launch_local,
    record_error,
)

CONFIG_PATH = "pkg://nemo_longctx.conf"
CONFIG_NAME = "train"
MULTIRUN_FLAGS = ("-m", "--multirun")

_ARGV: List[str] = []    # this process's command line after the program name: handed unchanged to every rank
_EXIT = {"code": 0}      # @hydra.main discards the task function's return value: the exit code travels here


def train_rank(spec: RunSpec, launch: Optional[Launch], checked: bool = False) -> int:
    """This process's part of the run (one rank, or the only process); ``checked``: the spec's config-level problems
    were already reported (``run``)."""
    import torch

    threads = spec.launcher.threads_per_process
    local = launch.local_world_size if launch is not None else 1
    torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // local))
    import lightning.pytorch as pl

    from nemo_longctx.integrations.nemo.app import fit
    from nemo_longctx.shared import collector, console

    rank = launch.rank if launch is not None else 0
    level = str(spec.log.level)
    console.setup(level, rank)  # again now that Lightning (and NeMo) are imported: they set their loggers' levels
    pl.seed_everything(int(spec.seed), verbose=False)
    built = build(spec, launch, checked=checked)
    spec = built.spec
    console.setup(level, rank)  # NeMo's console handlers exist once the model is built
    if spec.run.kernel_self_test:
        kernel_self_test(str(spec.trainer.precision), local_rank=launch.local_rank if launch is not None else 0)
    if built.trainer.global_rank == 0:
        warning = save_time_warning(spec)
        if warning:
            print(warning, flush=True)
        if torch.cuda.is_available() and not te_available():
            # (the libraries' own "Transformer Engine and Apex are not installed" is filtered: noise on a CPU build)
            print("nemo-longctx: TransformerEngine is not installed: the layers, the optimizer and gradient clipping "
                  "run without its fused kernels (slower on a GPU): install nemo-longctx[te] or use NVIDIA's NeMo "
                  "container", flush=True)
        line = recipe_line(spec, built.global_batch_size, built.model_config.seq_length)
        if line:
            print(line, flush=True)
        print(
            f"nemo-longctx train: {type(built.model_config).__name__} {built.model_config.num_layers} layers, "
            f"seq {built.model_config.seq_length}, config {spec.config_hash()[:12]}, "
            f"cp={built.options.cp.describe()}, world {built.world_size}, {spec.trainer.max_steps} steps, "
            f"metrics -> {os.path.join(str(spec.output_dir), 'metrics.jsonl')}",
            flush=True,
        )
    if not spec.checkpoint.save_on_signal:
        # nothing to save: an interrupt (a terminal's Ctrl-C, or the local launcher's agent passing it on) ends this
        # rank at once, by the signal's default action: no KeyboardInterrupt traceback, no peer's "connection closed"
        # from a rank still unwinding (the launcher reports the stop)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    collector.resume()  # paused since the entry (shared/collector.py)
    fit(built)
    saver = next((c for c in built.trainer.callbacks if type(c).__name__ == "SaveOnSignal"), None)
    code = PREEMPTED_EXIT if saver is not None and saver.preempted is not None else 0
    if code == PREEMPTED_EXIT:  # saved: exit 75 even when the launcher now stops the ranks (Lightning's fit teardown
        saver.latch.keep_ignoring()  # put its pre-fit handlers back; srun --kill-on-bad-exit sends SIGTERM)
    _finish_distributed()
    if rank == 0 and os.environ.get("NEMO_LONGCTX_SPAWNED") != "1":  # the only process, or rank 0 of torchrun/srun
        _print_summary(spec, code)  # (under the local launcher the launching process prints it)
    return code


def _print_summary(spec: RunSpec, code: int, since: Optional[float] = None, rank_logs: Optional[str] = None) -> None:
    """The run's final summary (``console.summary_lines``), read from its metrics file; ``since``: when the ranks
    started (a metrics file last written before then is a previous run's)."""
    from nemo_longctx.shared import console

    metrics = os.path.join(str(spec.output_dir), "metrics.jsonl")
    paths = [("metrics", metrics), ("checkpoints", spec.checkpoint_dir if spec.checkpoint.saves else None),
             ("rank logs", rank_logs)]
    lines = console.summary_lines(code, console.read_metrics(metrics, since=since), console.since_launch(),
                                  max_steps=int(spec.trainer.max_steps), paths=paths)
    print("\n".join(lines), flush=True)


def _finish_distributed() -> None:
    """After a successful fit: let collectives still in flight finish (Megatron-FSDP's next-step all-gathers), wait
    for every rank, and destroy the process groups before interpreter finalization -- gloo tearing a process group
    down with work in flight during finalization aborted runs after their last step (issue 13 notes)."""
    import sys

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    fsdp_compat = sys.modules.get("nemo_longctx.integrations.megatron.cpu_compat_fsdp")
    if fsdp_compat is not None:
        fsdp_compat.wait_for_param_gathers()
    dist.barrier()
    dist.destroy_process_group()


def kernel_self_test(precision: str, local_rank: int = 0) -> None:
    """``run.kernel_self_test=true``: check the attention kernel this rank will select against the float64 reference
    on a small GQA input (forward, backward, split-KV) before training; KernelSelfTestError names what disagreed."""
    import torch

    from nemo_longctx.attention.kernels import select_kernel, self_test_kernel

    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0], torch.float32)
    kernel = select_kernel(device, dtype)
    worst = self_test_kernel(kernel, device, dtype)
    print(f"run.kernel_self_test: kernel {kernel.name} on {device}/{dtype} matches float64 "
          f"(worst rel err {max(worst.values()):.2e})", flush=True)


def _refuse_multirun() -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ValueError("--multirun (hydra.mode=MULTIRUN) is not supported by nemo-longctx train: start one run "
                         "per configuration (e.g. one sbatch job each)")


def _apply_patch_ledgers() -> None:
    """The app's entry into NeMo: the NeMo 2 patch ledger (integrations/nemo/patches.py; the Megatron-core ledger
    first), once: its all-device rows everywhere, its CPU-only rows on a CPU-only torch."""
    from nemo_longctx.integrations.nemo import compat

    compat.apply()


def run(cfg: DictConfig) -> int:
    _refuse_multirun()
    return run_from_spec(read_run_spec(cfg))  # the composed config read once: nothing below sees it


def run_from_spec(spec: RunSpec) -> int:
    """The run of a spec: every config-level problem at once (before any process starts and before NeMo is imported:
    seconds), then the dry run, the local ranks, or this rank."""
    launch = detect_external_launch()
    spec = resolve_recipe(spec, world_size=spec.world_size(launch))  # the recipe's values in the keys left null
    raise_problems(config_problems(spec))
    from nemo_longctx.integrations.nemo import documents, pretrained

    world = spec.world_size(launch)
    rank = launch.rank if launch is not None else 0
    local_rank = launch.local_rank if launch is not None else None
    pretrained.prepare(spec, rank=rank, local_rank=local_rank)  # init_from=<HF dir>: imported once, in a subprocess
    spawns = launch is None and world > 1 and not spec.run.dry_run
    if not spawns or str(spec.data.kind) == "documents":
        _apply_patch_ledgers()  # what imports Megatron/NeMo below; a launching process otherwise imports neither
    documents.prepare(spec, rank=rank, local_rank=local_rank)  # data=documents: tokenize once
    if spec.run.dry_run:
        dry_run(spec, checked=True)
        return 0
    if spawns:
        # the ranks build the model config and check it against the options (``build``) before any collective: a
        # problem only it shows ends the run with one message (launch_local prints what the first refusing rank
        # recorded) and exit 2; the launching process stays free of NeMo's ~20 s of imports (the ranks pay them)
        if int(spec.trainer.num_nodes) != 1:
            raise ValueError("trainer.num_nodes > 1 needs torchrun or srun to start the processes")
        local = int(spec.trainer.devices)
        threads = spec.launcher.threads_per_process or max(1, (os.cpu_count() or 1) // local)
        print(f"nemo-longctx: spawning {local} local processes ({threads} thread(s) each) with torch's elastic agent",
              flush=True)
        spawned_at = time.time()
        code = launch_local(
            local, [*_ARGV, "hydra.output_subdir=null"], int(threads), wall_timeout_s=spec.run.timeout_s,
            shutdown_timeout_s=int(spec.launcher.shutdown_timeout_s),
            env={"NEMO_LONGCTX_CONFIG_HASH": spec.config_hash()},
            log_dir=os.path.join(str(spec.output_dir), "rank_logs"),
            forward_signals=signals_of(spec.run.signals) if spec.checkpoint.save_on_signal else (),
            signal_grace_s=float(spec.run.signal_grace_s), preload=RANK_PRELOAD,
            start_method=str(spec.launcher.start_method),
        )
        if code != CONFIG_ERROR_EXIT:  # (a refused configuration trained nothing: its message is the output)
            _print_summary(spec, code, since=spawned_at, rank_logs=os.path.join(str(spec.output_dir), "rank_logs"))
        return code
    return train_rank(spec, launch, checked=True)


# what every rank imports (~20 s on one core): a local launch without CUDA imports it once and forks the ranks
RANK_PRELOAD = ("nemo.collections.llm", "nemo.lightning", "megatron.core",
                "lightning.pytorch", "nemo_longctx.integrations.nemo.app")


@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    try:
        _EXIT["code"] = run(cfg)
    except ConfigError as e:  # a wrong config: one message, no traceback, exit 2
        record_error(e)  # under the elastic agent / torchrun: the launcher names this rank's error
        # our local launcher prints it once (launch.config_error_of); under torchrun/srun, rank 0 does
        if _rank0() and os.environ.get("NEMO_LONGCTX_SPAWNED") != "1":
            print(f"nemo-longctx train: {e}", file=sys.stderr, flush=True)
        _EXIT["code"] = CONFIG_ERROR_EXIT
    except BaseException as e:
        record_error(e)  # under the elastic agent / torchrun: the launcher prints this rank's error
        raise


def _rank0() -> bool:
    from nemo_longctx.shared import console

    return console.rank_from_env() == 0


def main(argv: Optional[List[str]] = None) -> None:
    from nemo_longctx.shared import collector

    collector.pause()  # until training starts (or the launcher starts the ranks): shared/collector.py
    from nemo_longctx.apps.help import maybe_print_help

    maybe_print_help("train", sys.argv[1:] if argv is None else argv)  # -h/--help: our groups and keys, exit 0
    die_with_parent()  # a rank of the local launcher never outlives it
    faulthandler.enable()  # a rank killed by SIGSEGV/SIGABRT/SIGBUS/SIGFPE leaves its Python stacks on stderr
    args = list(sys.argv[1:] if argv is None else argv)
    from nemo_longctx.shared import console

    # --verbose = log.level=debug: the override replaces the flag, so Hydra and every rank (handed _ARGV) get it; the
    # console is quieted now, before the libraries are imported (train_rank applies the spec's log.level)
    args, level = console.take_verbose(args)
    console.setup(level, console.rank_from_env())
    if argv is None:
        sys.argv = [sys.argv[0], *args]  # what Hydra parses
    if any(a in MULTIRUN_FLAGS for a in args):
        print("nemo-longctx train: --multirun/-m is not supported: start one run per configuration "
              "(e.g. one sbatch job each)", file=sys.stderr)
        sys.exit(2)
    from nemo_longctx.integrations.nemo.app import preflight
    from nemo_longctx.shared.overrides import quote_path_values

    args = quote_path_values(args)  # checkpoint.resume=/ckpt/step=3-...: a path, passed on quoted
    if os.environ.get("NEMO_LONGCTX_SPAWNED") != "1":  # the launching process (or a torchrun/srun rank)
        problems = preflight(args, CONFIG_NAME)  # cp=rign, cp.sise=4, every config-level rule: named, exit 2
        if problems:
            if _rank0():
                print(f"nemo-longctx train: {ConfigError(problems)}", file=sys.stderr, flush=True)
            sys.exit(CONFIG_ERROR_EXIT)
    _ARGV[:] = args
    sys.argv = [sys.argv[0], *args]
    _hydra_main()  # Hydra exits with 1 itself when the task raises (and prints the error)
    from nemo_longctx.shared.process_exit import exit_process

    exit_process(_EXIT["code"])  # without NeMo's ~4 s of interpreter teardown (process_exit.py)


if __name__ == "__main__":
    main()
