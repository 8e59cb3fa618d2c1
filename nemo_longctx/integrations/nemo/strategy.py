"""``LongContextStrategy``: a ``nemo.lightning.MegatronStrategy`` that owns the long-context settings.

Extra arguments: ``cp_algorithm`` (name in ``cp_algorithms.CP_ALGORITHMS``, default "ring"),
``cp_algorithm_kwargs``, ``long_context_options`` (the option groups as a plain mapping, the input of
``LongContextOptions.from_dict``: the NeMo-Run front end passes them, and they are checked again against the final
layout in ``connect``),
``option_keys`` ("hydra": messages name the app's keys, ``cp.size``; "recipe": the recipe arguments, ``cp_size``) and
``collective_timeout_s`` (the timeout of every process group: the world group and all of
Megatron's and our sub-groups, so a hung peer ends the job with an error instead of waiting Megatron's default 30
minutes); the CP size is MegatronStrategy's own ``context_parallel_size``. When a model is connected
(``trainer.fit`` -> ``strategy.connect``, before the model is built and before any step), the strategy extends the
model config with our core attention (``enable_long_context``) and validates it against the parallel layout,
raising ValueError that names the config fields.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
from nemo import lightning as nl

from nemo_longctx.integrations.megatron.validation import long_context_problems
from nemo_longctx.options import Context, LongContextOptions, ModelStateOptions, raise_problems
from nemo_longctx.shared.app_keys import NEMO_KEYS
from nemo_longctx.shared.run_spec import Layout, ModelSpec, RunSpec, TrainerSpec

from .compat import megatron_groups_timeout
from .model import enable_long_context


def strategy_kwargs(state: ModelStateOptions) -> Dict[str, Any]:
    """``MegatronStrategy`` arguments for the model-state options: Megatron-FSDP the way NeMo's recipes enable it
    (``ddp=<Megatron-FSDP DDP config>, fsdp="megatron"``, fsdp_dtensor checkpoints), else NeMo's default DDP; the
    fully reshardable optimizer checkpoint format with optimizer CPU offload."""
    from nemo_longctx.integrations.megatron.model_state import checkpoint_settings, ddp_config

    ckpt = checkpoint_settings(state)
    out: Dict[str, Any] = {}
    if state.megatron_fsdp:
        out.update(ddp=ddp_config(state), fsdp="megatron", save_ckpt_format=ckpt["format"])
    if ckpt["optim_fully_reshardable"]:
        out["ckpt_optim_fully_reshardable"] = True
    return out


class LongContextStrategy(nl.MegatronStrategy):
    def __init__(self, *args: Any, cp_algorithm: str = "ring", cp_algorithm_kwargs: Optional[Dict[str, Any]] = None,
                 collective_timeout_s: Optional[float] = None, long_context_options: Optional[Dict[str, Any]] = None,
                 option_keys: str = "hydra", **kwargs: Any) -> None:
        from .compat import apply as apply_patch_ledgers

        # NeMo's patch ledger, once per process (a no-op after an app's entry applied it): a NeMo-Run rank runs no
        # entry of ours -- NeMo-Run builds the recipe, and this strategy first -- so its ledger is applied here
        apply_patch_ledgers()
        super().__init__(*args, **kwargs)
        if option_keys not in ("hydra", "recipe"):
            raise ValueError(f"LongContextStrategy(option_keys={option_keys!r}): 'hydra' or 'recipe'")
        self.long_context_options = dict(long_context_options) if long_context_options is not None else None
        self.option_keys = option_keys
        self.cp_algorithm = cp_algorithm
        self.validated_config = None  # a model config already checked (the app checks it when it builds the run)
        self.cp_algorithm_kwargs = dict(cp_algorithm_kwargs or {})
        self.collective_timeout_s = collective_timeout_s

    def apply_collective_timeout(self) -> None:
        """Set ``collective_timeout_s`` on every process group this rank belongs to (created so far)."""
        if self.collective_timeout_s is None or not torch.distributed.is_initialized():
            return
        from torch.distributed import distributed_c10d as c10d

        timeout = timedelta(seconds=float(self.collective_timeout_s))
        for group in list(c10d._world.pg_map):
            if not c10d._rank_not_in_group(group):
                c10d._set_pg_timeout(timeout, group)

    def setup_environment(self) -> None:
        with megatron_groups_timeout(self.collective_timeout_s):  # compat.py: NeMo passes no timeout
            super().setup_environment()  # the world group, then Megatron's groups (NeMo's init_model_parallel)
        self.apply_collective_timeout()  # the world group's collectives (created by NeMo without a timeout)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.apply_collective_timeout()  # groups created while the model was built (e.g. hybrid CP sub-groups)

    def expected_world_size(self) -> Optional[int]:
        devices = self.parallel_devices
        if not devices:
            return None
        return len(devices) * max(1, int(getattr(self, "num_nodes", 1) or 1))

    def validate_model(self, config: Any, world_size: Optional[int] = None) -> None:
        """Raise ``ConfigError`` naming every problem of the model config against this strategy's layout (and, with
        ``long_context_options``, of the options against the final layout and the model)."""
        world = world_size if world_size is not None else self.expected_world_size()
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.long_context_options is None:
            raise_problems(long_context_problems(config, self.context_parallel_size, self.cp_algorithm, world, tp, pp,
                                                 self.cp_algorithm_kwargs, Context(keys=NEMO_KEYS)))
        else:
            raise_problems(self.option_problems(config, world))
        self.validated_config = config

    def option_problems(self, config: Any, world_size: Optional[int]) -> List[str]:
        """``long_context_options`` against this strategy's final layout and ``config`` (the front end checked them
        against what it knew; a later ``trainer.devices=`` override is caught here with the same message)."""
        from nemo_longctx.integrations.megatron.validation import model_problems

        options = LongContextOptions.from_dict(self.long_context_options)
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        ctx = self.run_spec(config, options).context(world_size)
        p = options.problems(ctx)
        if not p:
            if (options.cp.size, options.cp.algorithm) != (self.context_parallel_size, self.cp_algorithm):
                p.append(f"{ctx.key('cp.size')}={options.cp.size}/{ctx.key('cp.algorithm')}={options.cp.algorithm} "
                         "of the options disagree "
                         f"with the strategy's context_parallel_size={self.context_parallel_size}/cp_algorithm="
                         f"{self.cp_algorithm}")
            p = p + model_problems(config, options, world_size, tp, pp, ctx)
        return list(dict.fromkeys(p))

    def run_spec(self, config: Any, options: Optional[Any] = None) -> RunSpec:
        """This strategy's final layout (tensor / pipeline parallel sizes, sequence parallelism, its precision
        plugin's precision) and ``config``'s sequence length as a run spec, in the dialect ``option_keys`` names
        (recipe: the NeMo-Run recipe's, hydra: the app's); no checkpointing and no data known here."""
        precision = str(getattr(getattr(self, "_precision_plugin", None), "precision", "32"))
        layout = Layout(tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
                        sequence_parallel=bool(self.sequence_parallel))
        return RunSpec(options=options if options is not None else LongContextOptions(),
                       trainer=TrainerSpec(devices=None, num_nodes=None, precision=precision, layout=layout),
                       model=ModelSpec(fields={"seq_length": int(config.seq_length)}), data=None,
                       dialect="recipe" if self.option_keys == "recipe" else "train")

    def connect(self, model: Any) -> None:
        super().connect(model)  # copies the parallel sizes onto model.config
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("LongContextStrategy needs a model with a Megatron config (llm.GPTModel and friends)")
        enable_long_context(config, self.cp_algorithm, **self.cp_algorithm_kwargs)  # a no-op on an extended config
        if config is not self.validated_config:  # used without the app (Python API): checked here, once
            self.validate_model(config)
