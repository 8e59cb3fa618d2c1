"""``nemo-longctx bridge``: Megatron-Bridge pre-training (Bridge's own ``pretrain`` and ``gpt_step.forward_step``)
with nemo_longctx's long-context options.

    nemo-longctx bridge [recipe=<Bridge recipe>] [cp=ring cp.size=2 recompute=full optim=distributed ...] \\
        [Bridge's KEY=VALUE overrides: train.train_iters=3 model.seq_length=4096 checkpoint.save=/ckpt ...]

Arguments whose key is one of ours (``conf/bridge.yaml``: the cp / optim / recompute / offload / tiling groups,
``recipe``, ``output_dir``, ``launcher.*``, ``run.*``) are composed with Hydra; every other ``KEY=VALUE`` goes to
Bridge's own override parser (``process_config_with_overrides``) on the recipe's ``ConfigContainer``, so Bridge's
keys keep their names. The option model is built once and checked before any rank starts
(``integrations.bridge.config``). Without torchrun/srun the app starts ``launcher.devices`` local ranks (default:
tp x pp x cp) with PyTorch's elastic agent, like ``nemo-longctx train``. With no ``recipe`` it runs the CPU demo: a
tiny Llama (``AutoBridge.from_hf_config``, no hub), mock data, ring CP=2 on 2 gloo ranks. Each rank writes nothing
but Bridge's own log; rank 0 appends one JSON line per step to ``<output_dir>/metrics.jsonl`` (step, loss, tokens/s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, List, Optional, Tuple

OUR_KEYS = ("cp", "optim", "recompute", "offload", "tiling", "recipe", "output_dir", "launcher", "run")
# the optim group's schedule keys: on this front end Bridge's own optimizer/scheduler keys rule
BRIDGE_OWNS = {"optim.lr": "optimizer.lr", "optim.min_lr": "optimizer.min_lr",
               "optim.warmup_steps": "scheduler.lr_warmup_iters", "optim.weight_decay": "optimizer.weight_decay",
               "optim.clip_grad": "optimizer.clip_grad", "optim.adam_beta2": "optimizer.adam_beta2"}


def split_args(argv: List[str]) -> Tuple[List[str], List[str]]:
    """(our Hydra overrides, Bridge's overrides): by the root of each KEY=VALUE's key."""
    ours, bridge = [], []
    for a in argv:
        key = a.lstrip("+~").split("=", 1)[0]
        (ours if key.split(".", 1)[0] in OUR_KEYS else bridge).append(a)
    return ours, bridge


def compose(overrides: List[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
        return hydra_compose("bridge", overrides=overrides)


def options_of(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    from nemo_longctx.options import LongContextOptions

    return LongContextOptions.from_dict({g: OmegaConf.to_container(cfg[g], resolve=True)
                                         for g in ("cp", "optim", "recompute", "offload", "tiling")
                                         if cfg.get(g) is not None})


def app_problems(ours: List[str], options: Any) -> List[str]:
    """What this front end does not take (yet), each named: no silent fallback."""
    p = [f"{a.split('=')[0]}: on the Bridge front end the learning-rate schedule is Bridge's ({BRIDGE_OWNS[k]}=...)"
         for a in ours for k in [a.lstrip("+~").split("=", 1)[0]] if k in BRIDGE_OWNS]
    m, t = options.memory, options.tiling
    if m.offload != "none" or m.recompute == "full_keep_attn" or "layernorm" in (m.recompute_modules or ()) and \
            m.recompute == "selective":
        p.append(f"{m.describe()}: activation offload, full_keep_attn and the layernorm recompute are not wired into "
                 "the Bridge front end yet (recompute=none|selective[core_attn,mlp]|full are)")
    if t.active:
        p.append("tiling.*: the tiled MLP and the chunked loss are not wired into the Bridge front end yet")
    return p


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
    from megatron.bridge import recipes

    fn = getattr(recipes, name, None)
    if fn is None or not callable(fn):
        from nemo_longctx.options import ConfigError

        raise ConfigError([f"recipe={name!r} is not a Megatron-Bridge recipe (megatron.bridge.recipes.<name>)"])
    return fn()


def build(cfg: Any, bridge_overrides: List[str], options: Any, output_dir: str) -> Any:
    """The run's ConfigContainer: recipe (or demo) -> Bridge's overrides -> CPU settings (no CUDA) -> our options."""
    import torch
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from nemo_longctx.integrations.bridge import cpu_compat
    from nemo_longctx.integrations.bridge.config import enable_long_context

    container = demo_config() if cfg.recipe is None else recipe_config(str(cfg.recipe))
    if not torch.cuda.is_available():
        cpu_compat.cpu_settings(container)  # fp32, local block spec, gloo, fusions off (config, not patches)
    container.logger.tensorboard_dir = os.path.join(output_dir, "tensorboard")
    container.checkpoint.save = container.checkpoint.save if cfg.recipe is not None else None
    if bridge_overrides:
        container = process_config_with_overrides(container, cli_overrides=bridge_overrides)
    if getattr(container.dataset, "seq_length", None) != container.model.seq_length:
        container.dataset.seq_length = container.model.seq_length
    return enable_long_context(container, options)


def world_of(container: Any) -> int:
    m = container.model
    return int(m.tensor_model_parallel_size) * int(m.pipeline_model_parallel_size) * int(m.context_parallel_size)


class StepMetrics:
    """A Bridge callback: at train start, every attention layer of the built model must run our core attention with
    the configured CP size and algorithm (else RuntimeError naming the layer; rank 0 prints the check); then rank 0
    appends {step, loss, tokens_per_s, step_time_s, cp_size, world_size} per step."""

    def __init__(self, path: str, tokens_per_step: int, options: Any) -> None:
        self.path, self.tokens_per_step, self.options, self.t0 = path, tokens_per_step, options, None

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
                layers = sum(1 for chunk in context.model for _ in _attention_layers(chunk))
                if dist.get_rank() == 0:
                    print(f"nemo-longctx bridge: core attention: {layers} layers run LongContextCoreAttention "
                          f"({cp.describe()})", flush=True)

            def on_train_step_start(self, context: Any) -> None:
                outer.t0 = time.perf_counter()

            def on_train_step_end(self, context: Any) -> None:
                import torch.distributed as dist

                if dist.get_rank() != 0:
                    return
                dt = time.perf_counter() - outer.t0
                loss = (context.loss_dict or {}).get("lm loss")
                rec = {"step": int(context.state.train_state.step) + 1,  # the step just finished (1-based)
                       "loss": float(loss) if loss is not None else None,
                       "tokens_per_s": outer.tokens_per_step / dt, "step_time_s": dt,
                       "cp_size": context.state.cfg.model.context_parallel_size, "world_size": dist.get_world_size()}
                with open(outer.path, "a") as f:
                    f.write(json.dumps(rec) + "\n")

        return _Metrics()


def _attention_layers(model: Any) -> List[Any]:
    from megatron.core.transformer.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def run_rank(cfg: Any, bridge_overrides: List[str], options: Any) -> int:
    from nemo_longctx.integrations.bridge import cpu_compat

    cpu_compat.apply()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    output_dir = os.path.abspath(str(cfg.output_dir))
    container = build(cfg, bridge_overrides, options, output_dir)
    metrics = StepMetrics(os.path.join(output_dir, "metrics.jsonl"),
                          container.train.global_batch_size * container.model.seq_length, options)
    pretrain(container, forward_step, callbacks=[metrics.callback()])
    return 0


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    from nemo_longctx.integrations.nemo.launch import detect_external_launch, launch_local
    from nemo_longctx.options import ConfigError, raise_problems

    ours, bridge = split_args(args)
    try:
        cfg = compose(ours)
        options = options_of(cfg)
        raise_problems(options.problems() + app_problems(ours, options))
    except ConfigError as e:
        print(f"nemo-longctx bridge: {e}", file=sys.stderr)
        sys.exit(2)
    if detect_external_launch() is not None or os.environ.get("NEMO_LONGCTX_BRIDGE_RANK"):
        sys.exit(run_rank(cfg, bridge, options))
    # the launching process: the container once (every problem before any rank starts), then the ranks
    from nemo_longctx.integrations.bridge import cpu_compat
    from nemo_longctx.integrations.bridge.config import model_problems_of

    cpu_compat.apply()
    output_dir = os.path.abspath(str(cfg.output_dir))
    try:
        container = build(cfg, bridge, options, output_dir)
        world = int(cfg.launcher.devices or world_of(container))
        raise_problems(model_problems_of(container, options, world))
    except ConfigError as e:
        print(f"nemo-longctx bridge: {e}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(output_dir, exist_ok=True)
    print(f"nemo-longctx bridge: {'recipe ' + str(cfg.recipe) if cfg.recipe else 'CPU demo'}, "
          f"cp={options.cp.describe()}, {options.memory.describe()}, world {world}", flush=True)
    t0 = time.perf_counter()
    code = launch_local(world, args, max(1, (os.cpu_count() or 1) // world), wall_timeout_s=cfg.run.timeout_s,
                        shutdown_timeout_s=int(cfg.launcher.shutdown_timeout_s),
                        log_dir=os.path.join(output_dir, "rank_logs"), module="nemo_longctx.bridge_app",
                        env={"NEMO_LONGCTX_BRIDGE_RANK": "1"})
    print(f"nemo-longctx bridge: {'finished' if code == 0 else f'FAILED (exit {code})'} in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
