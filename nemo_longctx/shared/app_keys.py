"""The NeMo 2 app's own config keys (trainer, checkpoint, launcher, run), typed and checked by the option model's
one checker (``nemo_longctx.options.Option``), and the app's names for the values the option checks need."""

from __future__ import annotations

from typing import Tuple

from nemo_longctx.options import PRECISIONS, ConfigError, LongContextOptions, Option
from nemo_longctx.shared.launch import START_METHODS
from nemo_longctx.shared.signals import DEFAULT_GRACE_S, DEFAULT_SIGNALS, SIGNAL_NAMES

RESUME_MODES = ("auto", "never")
# the groups whose keys are all declared (here or in the option model): any other key in them is refused
APP_GROUPS = ("trainer", "trainer.strategy", "checkpoint", "launcher", "run")
# the app's names of the values the option checks need (messages name them)
NEMO_KEYS = {"seq_length": "model.seq_length", "tp": "trainer.strategy.tensor_model_parallel_size",
             "pp": "trainer.strategy.pipeline_model_parallel_size", "sequence_parallel":
             "trainer.strategy.sequence_parallel", "precision": "trainer.precision",
             "checkpointing": "checkpoint.every_n_steps", "world_size": "trainer.devices x trainer.num_nodes",
             "num_layers": "model.num_layers", "packed_data": "the data (data.packing / data.kind)"}
# the app's own keys (trainer, checkpoint, launcher, run): typed and checked like the option model's
APP_OPTIONS = (
    Option("trainer.accelerator", "choice", "auto", "auto (cuda if available, else cpu) | cpu | gpu",
           choices=("auto", "cpu", "gpu")),
    Option("trainer.devices", "int", 2, "processes per node", low=1),
    Option("trainer.num_nodes", "int", 1, "nodes", low=1),
    Option("trainer.max_steps", "int", None, "optimizer steps (null: the recipe's)", low=1, nullable=True),
    Option("trainer.precision", "choice", None, "32 | bf16-mixed | 16-mixed (null: the recipe's)", choices=PRECISIONS,
           nullable=True),
    Option("trainer.micro_batch_size", "int", 1, "sequences per micro batch", low=1),
    Option("trainer.global_batch_size", "int", None, "sequences per optimizer step (null: the recipe's tokens per "
           "step / model.seq_length; the demo: micro_batch_size x data-parallel size)", low=1, nullable=True),
    Option("trainer.strategy.tensor_model_parallel_size", "int", 1, "tensor-parallel size", low=1),
    Option("trainer.strategy.pipeline_model_parallel_size", "int", 1, "pipeline-parallel size", low=1),
    Option("trainer.strategy.sequence_parallel", "bool", False, "Megatron sequence parallelism (with TP)"),
    Option("trainer.val_check_interval", "int", None, "validate every N training steps (null: no validation)",
           low=1, nullable=True),
    Option("trainer.limit_val_batches", "int", 2, "validation batches per validation run", low=1),
    Option("checkpoint.every_n_steps", "int", None, "save every N steps and at the end (0 = not by steps; null: "
           "the recipe's)", low=0, nullable=True),
    Option("checkpoint.every_minutes", "number", None, "save every N minutes of training and at the end (0 = not by "
           "time; null: the recipe's)", low=0, nullable=True),
    Option("checkpoint.dir", "str", None, "null: <output_dir>/checkpoints", nullable=True),
    Option("checkpoint.resume", "str", "auto", "auto | never | a checkpoint directory"),
    Option("checkpoint.keep", "int", 2, "most recent checkpoints kept", low=1),
    Option("checkpoint.async_save", "bool", None, "NeMo's asynchronous save (GPU runs; null: the recipe's)",
           nullable=True),
    Option("checkpoint.on_signal", "bool", None, "on the first of run.signals: save this step's checkpoint and stop "
           "(exit 75); null: when the run saves checkpoints", nullable=True),
    Option("launcher.backend", "choice", "auto", "auto (nccl with CUDA, gloo without) | gloo | nccl",
           choices=("auto", "gloo", "nccl")),
    Option("launcher.threads_per_process", "int", None, "null: CPU cores / local processes", low=1, nullable=True),
    Option("launcher.timeout_s", "number", 1800, "collective timeout of every process group (null: Megatron's)",
           above=0, nullable=True),
    Option("launcher.shutdown_timeout_s", "number", 30, "local launch: seconds between SIGTERM and SIGKILL",
           above=0),
    Option("launcher.start_method", "choice", "auto", "local launch: how the ranks start: auto (forkserver without "
           "CUDA, spawn with) | forkserver (the frameworks imported once, each rank forked from there) | spawn (a "
           "fresh interpreter per rank)", choices=START_METHODS),
    Option("run.dry_run", "bool", False, "build and validate the real NeMo objects, print a summary, do not train"),
    Option("run.save_final_params", "bool", False, "write <output_dir>/final_params.pt after training"),
    Option("run.timeout_s", "number", None, "local launch only: stop all ranks after this many seconds (exit 124)",
           above=0, nullable=True),
    Option("run.kernel_self_test", "bool", False, "check the attention kernel against float64 before training"),
    Option("run.fault", "str", None, "failure drills for tests: KIND@STEP:RANK", nullable=True),
    Option("run.signals", "modules", DEFAULT_SIGNALS, "the signals that save and stop (checkpoint.on_signal)",
           choices=SIGNAL_NAMES),
    Option("run.signal_grace_s", "number", DEFAULT_GRACE_S, "seconds the ranks get to save and stop after a signal "
           "before the local launcher stops them", above=0),
    Option("recipe", "str", "auto", "where the keys left null take their values (precision, optimizer, schedule, "
           "steps, tokens per step, checkpoint interval): auto (the tiny demo models: demo; others: the NVIDIA NeMo "
           "recipe of the model's architecture) | demo | a NeMo recipe name (nemo.collections.llm.recipes.<name>)"),
    Option("output_dir", "str", "outputs/train", "run directory (metrics, logs, checkpoints)"),
    Option("init_from", "str", None, "a pretrained checkpoint (NeMo or Hugging Face directory) to start from",
           nullable=True),
    Option("seed", "int", 1234, "random seed", low=0),
)

# `nemo-longctx bridge`'s own keys (conf/bridge.yaml outside the option model's groups): the rows that mean the same
# thing as the NeMo app's are the same rows
_SHARED = {o.key: o for o in APP_OPTIONS}
BRIDGE_OPTIONS = (
    Option("recipe", "str", "auto", "where the run takes its training settings (optimizer, schedule, precision, "
           "steps, tokens per step, checkpoint interval): auto (without init_from: the CPU demo; with init_from: "
           "the HF model with the settings of the Megatron-Bridge recipe of its architecture) | demo (the CPU "
           "demo's settings) | a Bridge recipe function (megatron.bridge.recipes.<name>: its whole config)"),
    Option("init_from", "str", None, "a local Hugging Face model directory to start from (AutoBridge)",
           nullable=True),
    Option("output_dir", "str", "outputs/bridge", "run directory (metrics, rank logs, TensorBoard)"),
    Option("launcher.devices", "int", None, "local ranks when not under torchrun/srun (null: tp x pp x cp)",
           low=1, nullable=True),
    _SHARED["launcher.shutdown_timeout_s"],
    _SHARED["launcher.start_method"],
    _SHARED["run.timeout_s"],
    _SHARED["run.fault"],
    Option("checkpoint.on_signal", "bool", None, "on the first of run.signals: save this step's checkpoint "
           "(Bridge's train.exit_signal_handler) and stop (exit 75); null: when checkpoint.save is set",
           nullable=True),
    _SHARED["run.signals"],
    _SHARED["run.signal_grace_s"],
    Option("data.packing", "choice", "none", "none (Bridge's own data step: dense sequences) | documents (packed "
           "documents: attention within each document of Bridge's pretraining data, the documents ending at the EOD "
           "token, dataset.reset_position_ids; our data step lays them out for the CP group, "
           "cp.split_min_tokens)", choices=("none", "documents")),
)
# the Bridge app's groups whose keys are all declared in BRIDGE_OPTIONS
BRIDGE_GROUPS = ("launcher", "run", "checkpoint", "data")
# the Bridge app's names of the values the option checks need that are its own keys (messages name them)
BRIDGE_APP_KEYS = {"packed_data": "the data (data.packing)"}

# The training settings a recipe gives: the keys above left null (the YAML defaults) take the recipe's value
# (integrations/nemo/training_recipe.py). These are the CPU demo's (recipe=demo: the tiny models), chosen to learn
# the synthetic data in a few steps on a CPU; a real model takes NVIDIA's NeMo recipe for it instead.
DEMO_SETTINGS = {
    "trainer.precision": "32", "trainer.max_steps": 30, "trainer.global_batch_size": None,
    "optim.lr": 3.0e-3, "optim.min_lr": 3.0e-4, "optim.warmup_steps": 3, "optim.weight_decay": 0.0,
    "optim.clip_grad": 1.0, "optim.adam_beta1": 0.9, "optim.adam_beta2": 0.95, "optim.adam_eps": 1.0e-8,
    "checkpoint.every_n_steps": 0, "checkpoint.every_minutes": 0, "checkpoint.async_save": False,
}



def recipe_global_batch(tokens_per_step: int, seq_length: int, micro_batch: int, data_parallel: int) -> int:
    """A recipe's tokens per step as sequences of the run's ``seq_length`` (both front ends): a multiple of micro
    batch x data-parallel size, at least one."""
    unit = max(1, micro_batch * data_parallel)
    return max(unit, tokens_per_step // seq_length // unit * unit)


FAULT_KINDS = ("raise", "kill", "hang", "abort", "SIGTERM", "SIGUSR1", "SIGINT", "SIGTERM_TWICE")


def parse_fault(spec: str) -> Tuple[str, int, int]:
    """``run.fault=KIND@STEP:RANK`` -> (kind, step, rank); ``ConfigError`` naming the key otherwise."""
    try:
        kind, rest = spec.split("@")
        step, rank = (int(x) for x in rest.split(":"))
    except ValueError as e:
        raise ConfigError([f"run.fault={spec!r} must look like KIND@STEP:RANK, e.g. raise@2:1 ({e})"]) from None
    if kind not in FAULT_KINDS or step < 1 or rank < 0:
        raise ConfigError([f"run.fault={spec!r}: KIND must be one of {list(FAULT_KINDS)}, STEP >= 1, RANK >= 0"])
    return kind, step, rank


# ---------------------------------------------------------------------------------------- NeMo-Run recipes
# option keys that are group choices in the app (cp=ring, recompute=full, offload=layer_input)
GROUP_CHOICES = {"cp.algorithm": "cp", "recompute.name": "recompute", "offload.name": "offload"}
# keys the recipe itself owns (its schedule and logging) or that only the app has
APP_ONLY = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay", "optim.clip_grad",
            "optim.adam_beta1", "optim.adam_beta2", "optim.adam_eps", "log.", "run.")


def argument_name(key: str) -> str:
    """The recipe argument of an option key (``cp.size`` -> ``cp_size``; the group choices: ``cp``, ``recompute``,
    ``offload``)."""
    return GROUP_CHOICES.get(key, key.replace(".", "_"))


# The recipe's dialect (``Context.keys``): the names of the values the option checks need as a NeMo-Run override
# would name them, and every option key as its recipe argument; messages are written with these names where they
# are made (the NeMo-Run front end and the strategy it sets up)
RECIPE_KEYS = {"seq_length": "model.config.seq_length", "tp": "trainer.strategy.tensor_model_parallel_size",
               "pp": "trainer.strategy.pipeline_model_parallel_size",
               "sequence_parallel": "trainer.strategy.sequence_parallel", "precision": "trainer.plugins.precision",
               "checkpointing": "log.ckpt", "world_size": "trainer.devices x trainer.num_nodes",
               "num_layers": "model.config.num_layers",
               **{o.key: argument_name(o.key) for o in LongContextOptions.options()}}
# A Megatron-Bridge ``ConfigContainer``'s dialect (``Context.keys``): Bridge's own fields keep their names in messages
# (``model.tensor_model_parallel_size``, ...), the option keys theirs; the Bridge app's own keys as it spells them
BRIDGE_KEYS = {"seq_length": "model.seq_length", "tp": "model.tensor_model_parallel_size",
               "pp": "model.pipeline_model_parallel_size", "sequence_parallel": "model.sequence_parallel",
               "precision": "mixed_precision", "checkpointing": "checkpoint.save_interval",
               "world_size": "the world size (WORLD_SIZE)", "num_layers": "model.num_layers", **BRIDGE_APP_KEYS}
