"""``LongContextStrategy``: a ``nemo.lightning.MegatronStrategy`` that owns the long-context settings.

Extra arguments: ``cp_algorithm`` (name in ``cp_algorithms.CP_ALGORITHMS``, default "ring"),
``cp_algorithm_kwargs`` and ``collective_timeout_s`` (the timeout of every process group: the world group and all of
Megatron's and our sub-groups, so a hung peer ends the job with an error instead of waiting Megatron's default 30
minutes); the CP size is MegatronStrategy's own ``context_parallel_size``. When a model is connected
(``trainer.fit`` -> ``strategy.connect``, before the model is built and before any step), the strategy extends the
model config with our core attention (``enable_long_context``) and validates it against the parallel layout,
raising ValueError that names the config fields.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from typing import Any, Dict, Optional

import torch
from nemo import lightning as nl

from nemo_longctx.integrations.megatron.validation import validate_long_context

from .model import enable_long_context


class LongContextStrategy(nl.MegatronStrategy):
    def __init__(self, *args: Any, cp_algorithm: str = "ring", cp_algorithm_kwargs: Optional[Dict[str, Any]] = None,
                 collective_timeout_s: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cp_algorithm = cp_algorithm
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
        with _megatron_groups_timeout(self.collective_timeout_s):
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
        validate_long_context(
            config,
            cp_size=self.context_parallel_size,
            cp_algorithm=self.cp_algorithm,
            world_size=world_size if world_size is not None else self.expected_world_size(),
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            cp_kwargs=self.cp_algorithm_kwargs,
        )

    def connect(self, model: Any) -> None:
        super().connect(model)  # copies the parallel sizes onto model.config
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("LongContextStrategy needs a model with a Megatron config (llm.GPTModel and friends)")
        enable_long_context(config, self.cp_algorithm, **self.cp_algorithm_kwargs)
        self.validate_model(config)


@contextlib.contextmanager
def _megatron_groups_timeout(timeout_s: Optional[float]):
    """Make NeMo's ``init_model_parallel`` create Megatron's groups with ``timeout_s``.

    NeMo 2.7 calls ``parallel_state.initialize_model_parallel`` without ``distributed_timeout_minutes`` (Megatron's
    default: 30 minutes). A group's timeout must be set when it is created: gloo's point-to-point receives (the ring's
    K/V exchange) keep the timeout of their creation, ``_set_pg_timeout`` later only reaches collectives. So for the
    duration of NeMo's set-up only, the function NeMo looks up gets that argument bound; it is restored afterwards.
    """
    if timeout_s is None:
        yield
        return
    from megatron.core import parallel_state

    original = parallel_state.initialize_model_parallel
    parallel_state.initialize_model_parallel = functools.partial(
        original, distributed_timeout_minutes=float(timeout_s) / 60.0
    )
    try:
        yield
    finally:
        parallel_state.initialize_model_parallel = original
