"""``nemo-longctx bridge``: Megatron-Bridge pre-training (Bridge's own ``pretrain`` and ``gpt_step.forward_step``)
with nemo_longctx's long-context options.

    nemo-longctx bridge [recipe=auto|demo|<Bridge recipe>] [init_from=<HF dir>] [cp=ring cp.size=2 ...] \\
        [Bridge's KEY=VALUE overrides: train.train_iters=3 model.seq_length=4096 checkpoint.save=/ckpt ...]

Arguments whose key is one of ours (``conf/bridge.yaml``: the cp / optim / recompute / offload / tiling groups,
``recipe``, ``output_dir``, ``launcher.*``, ``run.*``) are composed with Hydra and read once into the run spec
(``shared/run_spec.read_run_spec``, this app's keys: ``app_keys.BRIDGE_OPTIONS``); every other ``KEY=VALUE`` goes to
Bridge's own override parser (``process_config_with_overrides``) on the recipe's ``ConfigContainer``, so Bridge's
keys keep their names. The spec is checked before any rank starts (``integrations.bridge.config``). Without
torchrun/srun the app starts ``launcher.devices`` local ranks (default: tp x pp x cp) with PyTorch's elastic agent,
like ``nemo-longctx train``. ``recipe=auto`` (the default) without
``init_from`` runs the CPU demo: a tiny Llama (``AutoBridge.from_hf_config``, no hub), mock data, ring CP=2 on 2 gloo
ranks; with ``init_from=<HF dir>`` it trains the HF model with the training settings of the Megatron-Bridge recipe of
its architecture (``integrations.bridge.training_recipe``; ``recipe=demo``: the CPU demo's). ``data.packing=documents``:
attention within each document of Bridge's pretraining data, with our forward step in place of Bridge's
(``integrations.bridge.documents``; ``cp.split_min_tokens`` places the documents). Each rank writes nothing but
Bridge's own log; rank 0 appends one JSON line per step to ``<output_dir>/metrics.jsonl`` (step, loss, tokens/s;
``balance`` with packed documents).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, List, Optional, Tuple

from nemo_longctx.shared.process_exit import exit_process

OUR_KEYS = ("cp", "optim", "recompute", "offload", "tiling", "memory", "recipe", "init_from", "output_dir", "launcher",
            "run", "data")
# our keys under a root that is Bridge's (checkpoint.on_signal is mapped onto Bridge's train.exit_signal_handler)
OUR_EXACT_KEYS = ("checkpoint.on_signal",)
# the optim group's schedule keys: on this front end Bridge's own optimizer/scheduler keys rule
BRIDGE_OWNS = {"optim.lr": "optimizer.lr", "optim.min_lr": "optimizer.min_lr",
               "optim.warmup_steps": "scheduler.lr_warmup_iters", "optim.weight_decay": "optimizer.weight_decay",
               "optim.clip_grad": "optimizer.clip_grad", "optim.adam_beta1": "optimizer.adam_beta1",
               "optim.adam_beta2": "optimizer.adam_beta2", "optim.adam_eps": "optimizer.adam_eps"}


def recipe_flag(argv: List[str]) -> List[str]:
    """``--recipe NAME`` / ``--recipe=NAME`` (the spelling of Bridge's own ``run_recipe.py``) as ``recipe=NAME``."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--recipe":
            if i + 1 >= len(argv) or "=" in argv[i + 1]:
                from nemo_longctx.options import ConfigError

                raise ConfigError(["--recipe needs a Bridge recipe name (e.g. --recipe llama3_8b_pretrain_config)"])
            out.append(f"recipe={argv[i + 1]}")
            i += 2
            continue
        out.append("recipe=" + a[len("--recipe="):] if a.startswith("--recipe=") else a)
        i += 1
    return out


def split_args(argv: List[str]) -> Tuple[List[str], List[str]]:
    """(our Hydra overrides, Bridge's overrides): by the root of each KEY=VALUE's key (or the whole key:
    ``OUR_EXACT_KEYS``)."""
    ours, bridge = [], []
    for a in argv:
        key = a.lstrip("+~").split("=", 1)[0]
        (ours if key.split(".", 1)[0] in OUR_KEYS or key in OUR_EXACT_KEYS else bridge).append(a)
    return ours, bridge


def compose(overrides: List[str]) -> Any:
    """The run spec of ``conf/bridge.yaml`` composed with our overrides (Hydra's compose API,
    ``nemo_longctx.shared.overrides``: the same messages as ``nemo-longctx train`` for a malformed override, an unknown
    group choice or key), read once by the one reader (``read_run_spec``: this app's keys, ``BRIDGE_OPTIONS``)."""
    from nemo_longctx.options import ConfigError
    from nemo_longctx.shared.overrides import compose as compose_config
    from nemo_longctx.shared.run_spec import read_run_spec

    cfg, problems = compose_config("bridge", overrides)
    if problems:
        raise ConfigError([f"{p} (our keys: {', '.join(OUR_KEYS)}; every other KEY=VALUE is Bridge's)"
                           for p in problems])
    return read_run_spec(cfg, app="bridge")


def app_problems(ours: List[str], spec: Any = None) -> List[str]:
    """What this front end does not take (the optim group's schedule keys: Bridge's), and with the run spec its own
    keys (typed, misspelt ones refused: ``RunSpec.key_problems``) and a writable ``output_dir``, each named."""
    p = [f"{a.split('=')[0]}: on the Bridge front end the learning-rate schedule is Bridge's ({BRIDGE_OWNS[k]}=...)"
         for a in ours for k in [a.lstrip("+~").split("=", 1)[0]] if k in BRIDGE_OWNS]
    if spec is None:
        return p
    p += spec.key_problems()
    if isinstance(spec.output_dir, str):  # a real write probe, before Hydra makes the run directory
        from nemo_longctx.shared.path_checks import writable_dir_problem

        p += [m for m in [writable_dir_problem("output_dir", spec.output_dir)] if m]
    return p


class FaultDrill:
    """``run.fault=KIND@STEP:RANK`` as a Bridge callback: at the start of training step STEP (1-based) global rank
    RANK runs the launcher's drill (``shared.launch.inject_fault``), as the NeMo app does."""

    def __init__(self, spec: str) -> None:
        from nemo_longctx.shared.app_keys import parse_fault

        self.kind, self.step, self.rank = parse_fault(spec)

    def callback(self) -> Any:
        from megatron.bridge.training.callbacks import Callback

        outer = self

        class _Drill(Callback):
            def on_train_step_start(self, context: Any) -> None:
                import torch.distributed as dist

                from nemo_longctx.shared.launch import inject_fault

                if int(context.state.train_state.step) + 1 == outer.step and dist.get_rank() == outer.rank:
                    inject_fault(outer.kind, outer.step, outer.rank)

        return _Drill()


def demo_config() -> Any:
    """The CPU demo: a tiny Llama through Bridge's own Llama mapping (``AutoBridge.from_hf_config``: no hub), Bridge's
    common pre-training defaults, mock data, 3 iterations."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.config import MockGPTDatasetConfig
    from transformers import LlamaConfig

    hf = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     architectures=["LlamaForCausalLM"])
    cfg = _pretrain_common()
    cfg.model = AutoBridge.from_hf_config(hf).to_megatron_provider(load_weights=False)
    cfg.model.seq_length = 256
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 3, 1, 1
    cfg.scheduler.lr_warmup_iters = 1
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.vocab_size, cfg.tokenizer.tokenizer_model = "NullTokenizer", 1024, None
    cfg.dataset = MockGPTDatasetConfig(random_seed=1234, reset_attention_mask=False, reset_position_ids=False,
                                       eod_mask_loss=False, seq_length=256, num_dataset_builder_threads=1,
                                       split="99,1,0", data_sharding=True, dataloader_type="single", num_workers=0)
    return cfg


def recipe_config(name: str) -> Any:
    """Bridge's recipe function ``name`` called (its ``ConfigContainer``); ``ConfigError`` naming ``recipe`` for a name
    that is not one."""
    from megatron.bridge import recipes

    fn = getattr(recipes, name, None)
    if fn is None or not callable(fn):
        from nemo_longctx.options import ConfigError

        raise ConfigError([f"recipe={name!r} is not a Megatron-Bridge recipe (megatron.bridge.recipes.<name>)"])
    return fn()


def override_value(bridge_overrides: List[str], key: str) -> Optional[str]:
    """The value the last of Bridge's overrides gives ``key`` (None: none does)."""
    values = [a.split("=", 1)[1] for a in bridge_overrides if "=" in a and a.lstrip("+~").split("=", 1)[0] == key]
    return values[-1] if values else None


def settings_recipe(spec: Any, bridge_overrides: List[str]) -> Optional[str]:
    """The Bridge recipe whose training settings the run takes: ``recipe=<name>``'s, or with ``recipe=auto`` and
    ``init_from`` the recipe of the HF model's architecture (``training_recipe.choose``: ``ConfigError`` when none
    has it); None for the CPU demo's settings."""
    from nemo_longctx.integrations.bridge import training_recipe

    name = str(spec.recipe)
    if name == training_recipe.DEMO or (name == training_recipe.AUTO and spec.init_from.path is None):
        return None
    if name != training_recipe.AUTO:
        return name
    seq = override_value(bridge_overrides, "model.seq_length")
    return training_recipe.choose(spec.init_from.path, int(seq) if seq is not None and seq.strip().isdigit() else None)


def build(spec: Any, bridge_overrides: List[str], output_dir: str, world_size: Optional[int] = None,
          report: Optional[dict] = None) -> Any:
    """The run's ConfigContainer: recipe (or demo) -> Bridge's overrides -> CPU settings (no CUDA) -> the spec's
    options.
    ``world_size``: the run's ranks (None: tp x pp x cp), for the global batch of an automatic recipe's tokens per
    step; ``report``: filled with what the start line says (``recipe``: the recipe whose settings apply or None,
    ``precision``: its mixed precision before the CPU settings)."""
    import torch
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from nemo_longctx.integrations.bridge import cpu_compat
    from nemo_longctx.integrations.bridge import hf as bridge_hf
    from nemo_longctx.integrations.bridge.checkpoint import override_keys
    from nemo_longctx.integrations.bridge.config import enable_long_context
    from nemo_longctx.integrations.bridge.preemption import apply_on_signal, on_signal_problems
    from nemo_longctx.integrations.megatron.cp_algorithms import align_cp_comm_type, get_cp_algorithm
    from nemo_longctx.options import raise_problems

    from nemo_longctx.integrations.bridge import training_recipe

    options, init_from = spec.options, spec.init_from.path
    explicit = str(spec.recipe) not in (training_recipe.AUTO, training_recipe.DEMO)  # a Bridge recipe by name
    settings_of = settings_recipe(spec, bridge_overrides)
    container = recipe_config(str(spec.recipe)) if explicit else demo_config()
    if init_from is not None:  # the HF model (unless a recipe by name) and Bridge's HF weight loading
        container = bridge_hf.init_from_hf(container, init_from, own_model=not explicit)
    recipe = None  # the automatic recipe's ConfigContainer: its training settings on the HF model
    if settings_of is not None and not explicit:
        recipe = training_recipe.recipe_container(settings_of)
        training_recipe.apply_settings(container, recipe)
    if report is not None:
        report.update(recipe=settings_of, precision=training_recipe.precision_name(container.mixed_precision))
    if not torch.cuda.is_available():
        cpu_compat.cpu_settings(container)  # fp32, local block spec, gloo, fusions off (config, not patches)
    container.logger.tensorboard_dir = os.path.join(output_dir, "tensorboard")
    if not explicit:  # the demo saves and resumes only when asked (checkpoint.save=/checkpoint.load= win below)
        container.checkpoint.save = container.checkpoint.load = None
    if bridge_overrides:
        container = process_config_with_overrides(container, cli_overrides=bridge_overrides)
    if getattr(container.dataset, "seq_length", None) != container.model.seq_length:
        container.dataset.seq_length = container.model.seq_length
    keys = override_keys(bridge_overrides)
    if recipe is not None and "train.global_batch_size" not in keys:  # the recipe's tokens per step
        from nemo_longctx.shared.app_keys import recipe_global_batch

        m = container.model
        parallel = int(m.tensor_model_parallel_size) * int(m.pipeline_model_parallel_size) * int(options.cp.size)
        container.train.global_batch_size = recipe_global_batch(
            training_recipe.tokens_per_step(recipe), int(m.seq_length), int(container.train.micro_batch_size),
            max(1, int(world_size or parallel) // parallel))
    if report is not None and "mixed_precision" in keys:
        report["precision"] = training_recipe.precision_name(container.mixed_precision)
    if init_from is not None:
        raise_problems(bridge_hf.model_problems(container, init_from, options))
    if spec.data.packed:
        from nemo_longctx.integrations.bridge.documents import packed_documents_problems

        raise_problems(packed_documents_problems(container, keys))
    on_signal = spec.checkpoint.on_signal
    raise_problems(on_signal_problems(container, on_signal, keys))
    apply_on_signal(container, on_signal, list(spec.run.signals), keys)
    # a recipe's cp_comm_type is its TransformerEngine hint (gpt_oss: "a2a"), the user's only as a Bridge override:
    # a hint that contradicts cp.algorithm is cleared (None, which each of our algorithms takes; Bridge's checks of
    # TE's schemes -- "a2a+p2p" needs hierarchical_context_parallel_sizes -- then do not apply); a contradicting
    # override is refused by name
    m, algorithm = container.model, options.cp.algorithm
    if "model.cp_comm_type" in keys:
        try:
            align_cp_comm_type(m, algorithm, explicit=True)
        except ValueError as e:
            raise_problems([str(e)])
    elif isinstance(m.cp_comm_type, list) or m.cp_comm_type not in get_cp_algorithm(algorithm).cp_comm_types:
        print(f"nemo-longctx bridge: model.cp_comm_type={m.cp_comm_type!r} of the recipe cleared (null) for "
              f"cp.algorithm={algorithm}: a TransformerEngine hint; nemo_longctx's {algorithm} attention runs the "
              "context parallelism", flush=True)
        m.cp_comm_type = None
    return enable_long_context(container, options, packed_documents=spec.data.packed)


def run_kind(spec: Any) -> str:
    """The start line's first words: what runs with whose settings."""
    from nemo_longctx.integrations.bridge.training_recipe import AUTO, DEMO

    name, init_from = str(spec.recipe), spec.init_from.path
    packed = ", packed documents (data.packing=documents)" if spec.data.packed else ""
    if name not in (AUTO, DEMO):
        return f"recipe {name}" + (f", init_from {init_from}" if init_from is not None else "") + packed
    if init_from is None:
        return "CPU demo" + packed
    return (f"init_from {init_from}" + (" with the CPU demo's settings (recipe=demo)" if name == DEMO else "")
            + packed)


def settings_line(container: Any, spec: Any, report: dict) -> str:
    """The start line of a run with a recipe's training settings (as ``nemo-longctx train``'s): the recipe and the
    values the run trains with."""
    import torch

    from nemo_longctx.integrations.bridge.training_recipe import AUTO

    o, s, t = container.optimizer, container.scheduler, container.train
    how = "by init_from's architecture, on init_from's model" if str(spec.recipe) == AUTO else "by name"
    precision = report.get("precision") or "fp32"
    if not torch.cuda.is_available() and container.mixed_precision is None and precision != "fp32":
        precision += " (fp32 on this CPU)"
    interval = container.checkpoint.save_interval
    saves = (f"every {interval} steps to {container.checkpoint.save}" if container.checkpoint.save and interval
             else f"none (checkpoint.save=<dir> saves every {interval} steps)" if interval else "none")
    decay = s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters
    tokens = t.global_batch_size * container.model.seq_length
    def g(v: Any) -> str:  # a number as %g, anything else (None) as it is
        return f"{v:g}" if isinstance(v, (int, float)) else str(v)

    return (f"nemo-longctx bridge: recipe {report['recipe']} (Megatron-Bridge, {how}): {precision}, "
            f"{o.optimizer} lr {g(o.lr)} -> {g(o.min_lr)} ({s.lr_decay_style} over {decay} steps) after "
            f"{s.lr_warmup_iters} warm-up steps, weight decay {g(o.weight_decay)}, clip {g(o.clip_grad)}, "
            f"{t.train_iters} steps of {t.global_batch_size} sequences ({tokens:,} tokens), checkpoints {saves}")


def chosen_env(spec: Any, report: dict) -> dict:
    """The local ranks' environment for ``recipe=auto`` with ``init_from``: the recipe this process chose (each rank
    then builds that one instead of searching again)."""
    from nemo_longctx.integrations.bridge.training_recipe import AUTO, CHOSEN_ENV

    if str(spec.recipe) == AUTO and report.get("recipe"):
        return {CHOSEN_ENV: str(report["recipe"])}
    return {}


def world_of(container: Any) -> int:
    m = container.model
    return int(m.tensor_model_parallel_size) * int(m.pipeline_model_parallel_size) * int(m.context_parallel_size)


class StepMetrics:
    """A Bridge callback: at train start, every attention layer of the built model must run our core attention with
    the configured CP size and algorithm (else RuntimeError naming the layer; rank 0 prints the check); then rank 0
    appends {step, loss, tokens_per_s, step_time_s, elapsed_s, cp_size, world_size, activation_bytes_device,
    activation_bytes_host, peak_bytes} per step -- with packed documents also ``balance`` (max / mean of the CP and
    data-parallel ranks' predicted attention cost of the step: ``batch.step_balance_over_ranks``, a collective every
    rank runs) -- and prints the NeMo app's step line. ``memory``: the run's
    ``integrations.bridge.memory.LongContextMemory`` (its callback runs before this one); ``packed_documents``: the
    run's data are packed documents (``balance`` written)."""

    def __init__(self, path: str, tokens_per_step: int, options: Any, memory: Any = None,
                 packed_documents: bool = False) -> None:
        self.path, self.tokens_per_step, self.options, self.t0 = path, tokens_per_step, options, None
        self.memory, self.start, self.packed_documents = memory, time.perf_counter(), packed_documents

    def callback(self) -> Any:
        from megatron.bridge.training.callbacks import Callback

        outer = self

        class _Metrics(Callback):
            def on_train_start(self, context: Any) -> None:
                import torch.distributed as dist

                from nemo_longctx.integrations.megatron.validation import built_attention_problems

                cp, pp = outer.options.cp, context.state.cfg.model.pipeline_model_parallel_size
                problems = [p for chunk in context.model for p in built_attention_problems(chunk, cp.size,
                                                                                            cp.algorithm, pp)]
                if problems:
                    raise RuntimeError("nemo-longctx bridge: " + "; ".join(problems))
                cores = [layer.core_attention for chunk in context.model for layer in _attention_layers(chunk)]
                layers = len(cores)
                from nemo_longctx.shared import console

                console.setup(console.level(), dist.get_rank())  # again: Bridge set its loggers' levels up
                if dist.get_rank() == 0:
                    print(f"nemo-longctx bridge: core attention: {layers} layers run LongContextCoreAttention "
                          f"({cp.describe()}){_attention_features(cores)}", flush=True)
                    if int(context.state.train_state.step) == 0:  # a fresh run: keep the previous run's metrics
                        moved = console.archive_metrics(os.path.dirname(outer.path))
                        if moved:
                            print(f"nemo-longctx bridge: the previous run's metrics.jsonl moved to {moved}", flush=True)

            def on_train_step_start(self, context: Any) -> None:
                from nemo_longctx.integrations.megatron.batch import reset_step_costs

                reset_step_costs()
                outer.t0 = time.perf_counter()

            def on_train_step_end(self, context: Any) -> None:
                import torch.distributed as dist

                from nemo_longctx.integrations.megatron.batch import step_balance_over_ranks

                # (a collective: every rank, before rank 0 alone goes on)
                balance = step_balance_over_ranks() if outer.packed_documents else None
                if dist.get_rank() != 0:
                    return
                now = time.perf_counter()
                dt = now - outer.t0
                loss = (context.loss_dict or {}).get("lm loss")
                rec = {"step": int(context.state.train_state.step) + 1,  # the step just finished (1-based)
                       "loss": float(loss) if loss is not None else None,
                       "tokens_per_s": outer.tokens_per_step / dt, "step_time_s": dt, "elapsed_s": now - outer.start,
                       "cp_size": context.state.cfg.model.context_parallel_size, "world_size": dist.get_world_size()}
                if balance is not None:
                    rec["balance"] = balance
                if outer.memory is not None:
                    rec.update(outer.memory.metrics())
                with open(outer.path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                every, last = int(outer.options.metrics.print_every), int(context.state.cfg.train.train_iters)
                if rec["step"] % every == 0 or rec["step"] == last:
                    lv = "-" if rec["loss"] is None else f"{rec['loss']:.5f}"
                    print(f"step {rec['step']}/{last} | loss {lv} | tokens/s {rec['tokens_per_s']:.0f} | "
                          f"step {dt:.2f} s | elapsed {rec['elapsed_s']:.1f} s"
                          + (f" | {outer.memory.meter.summary()}" if outer.memory is not None else ""), flush=True)

        return _Metrics()


def _attention_features(cores: List[Any]) -> str:
    """What the built core attentions hold beyond plain causal attention (nothing for plain ones): their attention
    sinks (``softmax_type``) and sliding windows, by layer number."""
    parts = []
    sinks = sorted({c.softmax_type for c in cores if getattr(c, "softmax_type", "vanilla") != "vanilla"})
    if sinks:
        held = sum(1 for c in cores if getattr(c, "softmax_type", "vanilla") != "vanilla")
        parts.append(f"attention sinks ({', '.join(sinks)}) in {held} layers")
    windows = {}
    for c in cores:
        if getattr(c, "window_size", None) is not None:
            windows.setdefault(tuple(c.window_size), []).append(c.layer_number)
    parts += [f"sliding window {w} in layers {layers}" for w, layers in windows.items()]
    return "; " + "; ".join(parts) if parts else ""


def _attention_layers(model: Any) -> List[Any]:
    from megatron.core.transformer.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def run_rank(spec: Any, bridge_overrides: List[str], container: Any = None) -> int:
    """Train this rank with Bridge's ``pretrain`` (``container``: the run's ConfigContainer when already built)."""
    from nemo_longctx.integrations.bridge import cpu_compat

    cpu_compat.apply()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from nemo_longctx.integrations.bridge.checkpoint import quiet_planned_exit
    from nemo_longctx.integrations.bridge.config import long_context_callbacks
    from nemo_longctx.integrations.bridge.documents import packed_documents_forward_step
    from nemo_longctx.integrations.bridge.memory import memory_of
    from nemo_longctx.integrations.bridge.preemption import SaveOnSignal, latched_signals

    from nemo_longctx.shared import collector, console

    console.setup(console.level(), console.rank_from_env())  # again: the libraries are imported now
    threads = os.environ.get("OMP_NUM_THREADS")  # the launcher's share of the cores (torchrun's default: 1)
    if threads and threads.isdigit():  # a rank forked from a fork server has OpenMP's setting of the server's start
        import torch

        torch.set_num_threads(int(threads))
    output_dir = os.path.abspath(str(spec.output_dir))
    world = os.environ.get("WORLD_SIZE")  # the local launcher's ranks (the agent sets it)
    container = container if container is not None else build(spec, bridge_overrides, output_dir,
                                                               int(world) if world else None)
    metrics = StepMetrics(os.path.join(output_dir, "metrics.jsonl"),
                          container.train.global_batch_size * container.model.seq_length, spec.options,
                          memory_of(container), spec.data.packed)
    quiet_planned_exit()  # train.exit_interval's sys.exit(0) is not a failure
    # ours first: the memory callback closes the step's tracker before the metrics line reads it
    drills = [FaultDrill(str(spec.run.fault)).callback()] if spec.run.fault else []
    signals = latched_signals(container, list(spec.run.signals))
    saver = (SaveOnSignal(signals, container.train.exit_signal, float(spec.run.signal_grace_s),
                          str(container.checkpoint.save)).install() if signals else None)
    if saver is None:  # nothing to save: an interrupt ends the rank by its default action, without a traceback
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    callbacks = long_context_callbacks(container, spec.data.packed) + [metrics.callback()] + drills
    # packed documents: our forward step (the full micro-batch, per-document layout for the CP group); else Bridge's
    step = packed_documents_forward_step if spec.data.packed else forward_step
    collector.resume()  # paused since the entry (shared/collector.py)
    try:
        pretrain(container, step, callbacks=callbacks + ([saver.callback()] if saver else []))
    except SystemExit as e:  # Bridge's own stop (a signal, train.exit_interval, ...): sys.exit(0)
        if saver is None or e.code not in (0, None):
            raise
        code = saver.outcome(int(container.train.train_iters), console.rank_from_env())
        if code == 0:
            raise
        return code
    return saver.outcome(int(container.train.train_iters), console.rank_from_env()) if saver else 0


def external_rank(spec: Any, bridge_overrides: List[str], launch: Any) -> int:
    """A rank torchrun or srun started. ``detect_external_launch`` (the NeMo app's helper) has set RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the SLURM_* variables: what Bridge's torch.distributed ``env://``
    set-up reads. No launching process checked the container, so every rank does (the same problems and messages,
    for the real world size, before any process group exists), then trains."""
    from nemo_longctx.integrations.bridge import cpu_compat
    from nemo_longctx.integrations.bridge.checkpoint import checkpoint_problems
    from nemo_longctx.integrations.bridge.config import cpu_problems, model_problems_of
    from nemo_longctx.options import ConfigError, raise_problems

    cpu_compat.apply()
    output_dir = os.path.abspath(str(spec.output_dir))
    options = spec.options
    try:
        container = build(spec, bridge_overrides, output_dir, launch.world_size)
        raise_problems(model_problems_of(container, options, launch.world_size)
                       + checkpoint_problems(container, bridge_overrides) + cpu_problems(container, options))
    except ConfigError as e:
        print(f"nemo-longctx bridge: rank {launch.rank}: {e}", file=sys.stderr)
        return 2
    os.makedirs(output_dir, exist_ok=True)
    print(f"nemo-longctx bridge: rank {launch.rank} of {launch.world_size} (local rank {launch.local_rank} of "
          f"{launch.local_world_size}) from {launch.kind}, rendezvous {os.environ.get('MASTER_ADDR')}:"
          f"{os.environ.get('MASTER_PORT')}", flush=True)
    return run_rank(spec, bridge_overrides, container)


# what every rank imports: a local launch without CUDA imports it once in its fork server and forks the ranks
RANK_PRELOAD = ("megatron.bridge", "megatron.core", "nemo_longctx.integrations.bridge.cpu_compat")


def main(argv: Optional[List[str]] = None) -> None:
    from nemo_longctx.shared import collector

    collector.pause()  # until training starts (or the launcher starts the ranks): shared/collector.py
    args = list(sys.argv[1:] if argv is None else argv)
    from nemo_longctx.shared import console

    verbose = console.VERBOSE_FLAG in args  # everything the libraries print (every rank gets the flag too)
    args = [a for a in args if a != console.VERBOSE_FLAG]
    console.setup("debug" if verbose else "info", console.rank_from_env())
    from nemo_longctx.apps.help import maybe_print_help

    from nemo_longctx.shared.app_keys import BRIDGE_APP_KEYS, BRIDGE_OPTIONS

    maybe_print_help("bridge", args, app_options=BRIDGE_OPTIONS)  # -h/--help: our groups and keys, exit 0
    from nemo_longctx.integrations.bridge.hf import init_from_problems
    from nemo_longctx.options import ConfigError, Context, raise_problems
    from nemo_longctx.shared.launch import detect_external_launch, die_with_parent, launch_local

    try:
        args = recipe_flag(args)
        ours, bridge = split_args(args)
        spec = compose(ours)  # the run spec: read once, nothing below sees the composed config
        options = spec.options
        raise_problems(options.problems(Context(packed_data=spec.data.packed, keys=BRIDGE_APP_KEYS))
                       + app_problems(ours, spec)
                       + init_from_problems(spec.init_from.path))
    except ConfigError as e:
        print(f"nemo-longctx bridge: {e}", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("NEMO_LONGCTX_BRIDGE_RANK"):  # a rank of our local launcher (it checked the container)
        die_with_parent()  # a rank of the local launcher never outlives it
        exit_process(run_rank(spec, bridge))  # without the interpreter's teardown (process_exit.py)
    launch = detect_external_launch()  # torchrun's or srun's ranks: SLURM_* -> RANK/WORLD_SIZE/MASTER_ADDR/...
    if launch is not None:
        exit_process(external_rank(spec, bridge, launch))
    # the launching process: the container once (every problem before any rank starts), then the ranks. It is built
    # where the ranks' imports are (a process forked from their fork server): this process imports no Megatron-Bridge
    from nemo_longctx.shared.launch import RankServerError, call_with_rank_imports

    output_dir = os.path.abspath(str(spec.output_dir))
    try:
        checked = call_with_rank_imports(launch_check, (spec, bridge, output_dir), preload=RANK_PRELOAD,
                                         start_method=str(spec.launcher.start_method), expected=(ConfigError,))
    except ConfigError as e:
        print(f"nemo-longctx bridge: {e}", file=sys.stderr)
        sys.exit(2)
    except RankServerError as e:
        print(f"nemo-longctx: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    os.makedirs(output_dir, exist_ok=True)
    print("\n".join(checked["lines"]), flush=True)
    world = checked["world"]
    spawned_at = time.time()
    code = launch_local(world, args + ([console.VERBOSE_FLAG] if verbose else []),
                        max(1, (os.cpu_count() or 1) // world), wall_timeout_s=spec.run.timeout_s,
                        shutdown_timeout_s=int(spec.launcher.shutdown_timeout_s),
                        log_dir=os.path.join(output_dir, "rank_logs"), module="nemo_longctx.apps.bridge",
                        env={"NEMO_LONGCTX_BRIDGE_RANK": "1", **checked["env"]},
                        forward_signals=checked["signals"],
                        signal_grace_s=float(spec.run.signal_grace_s),
                        preload=RANK_PRELOAD,
                        start_method=str(spec.launcher.start_method))
    metrics = os.path.join(output_dir, "metrics.jsonl")
    print("\n".join(console.summary_lines(
        code, console.read_metrics(metrics, since=spawned_at), console.since_launch(),
        max_steps=checked["train_iters"], prefix="nemo-longctx bridge",
        paths=[("metrics", metrics), ("checkpoints", checked["save"]),
               ("rank logs", os.path.join(output_dir, "rank_logs"))])),
        flush=True)
    exit_process(code)  # without the interpreter's teardown (process_exit.py)


def launch_check(spec: Any, bridge_overrides: List[str], output_dir: str) -> dict:
    """The launching process's check of the run (``main``, in a process forked from the ranks' fork server): the
    container built once, every problem before any rank starts (``ConfigError``), and what the launcher needs of it
    as plain values: ``world`` (its ranks), ``lines`` (the start lines), ``signals`` (forwarded to the ranks),
    ``env`` (the ranks' extra environment), ``save`` (the checkpoint folder or None), ``train_iters``."""
    from nemo_longctx.integrations.bridge import cpu_compat
    from nemo_longctx.integrations.bridge.checkpoint import checkpoint_problems
    from nemo_longctx.integrations.bridge.config import cpu_problems, model_problems_of
    from nemo_longctx.integrations.bridge.memory import memory_of
    from nemo_longctx.integrations.bridge.preemption import latched_signals, save_time_warning
    from nemo_longctx.options import raise_problems

    cpu_compat.apply()
    options = spec.options
    report: dict = {}
    container = build(spec, bridge_overrides, output_dir, spec.launcher.devices, report)
    world = int(spec.launcher.devices or world_of(container))
    raise_problems(model_problems_of(container, options, world) + checkpoint_problems(container, bridge_overrides)
                   + cpu_problems(container, options))
    lines = [f"nemo-longctx bridge: {run_kind(spec)}, cp={options.cp.describe()}, "
             f"{memory_of(container).describe(container)}, world {world}"]
    if report.get("recipe"):
        lines.append(settings_line(container, spec, report))
    signals = latched_signals(container, list(spec.run.signals))
    warning = save_time_warning(container, float(spec.run.signal_grace_s)) if signals else None
    if warning:
        lines.append(warning)
    save = getattr(getattr(container, "checkpoint", None), "save", None)
    return {"world": world, "lines": lines, "signals": [int(s) for s in signals], "env": chosen_env(spec, report),
            "save": str(save) if save is not None else None, "train_iters": int(container.train.train_iters)}


if __name__ == "__main__":
    main()
