"""The run guards on the Megatron-Bridge front end (``integrations.megatron.run_guards``): every step, context
parallelism really active -- every nemo_longctx attention layer over the run's CP group, covering the whole sequence
(dense data: ``model.seq_length``; packed datasets are not judged on it), and bytes sent to the other CP ranks
(packed documents, ``data.packing=documents``: only in a step that split a document over the CP group).
Bridge's own ``check_for_nan_in_loss_and_grad`` stops a non-finite loss; the tokens and MFU guards are the NeMo 2
app's (Bridge's data step and throughput logging are Bridge's)."""

from __future__ import annotations

from typing import Any


def run_guards_callback(cfg: Any, packed_documents: bool = False) -> Any:
    """A Bridge ``Callback`` running the CP guard at every training step of the run ``cfg`` configures
    (``packed_documents``: with our forward step for packed documents)."""
    from megatron.bridge.training.callbacks import Callback

    from nemo_longctx.integrations.megatron.batch import STEP_COSTS, reset_step_costs
    from nemo_longctx.integrations.megatron.run_guards import StepBytes, core_attentions, cp_problems, raise_if

    m = cfg.model
    cp_size = int(m.context_parallel_size or 1)
    packed = packed_documents or getattr(getattr(cfg, "dataset", None), "packed_sequence_specs", None) is not None
    sequence_tokens = None if packed else int(m.seq_length)

    class LongContextRunGuards(Callback):
        def __init__(self) -> None:
            self.attentions: list = []
            self.bytes = StepBytes()

        def on_train_start(self, context: Any) -> None:
            self.attentions = core_attentions(list(context.model))

        def on_train_step_start(self, context: Any) -> None:
            if packed_documents:
                reset_step_costs()
            self.bytes.start()

        def on_train_step_end(self, context: Any) -> None:
            sent = self.bytes.stop()
            if sent is not None:
                # packed documents: CP traffic only when some micro-batch split a document over the CP group
                traffic = not packed_documents or STEP_COSTS["costs"] is None or bool(STEP_COSTS["split"])
                raise_if(cp_problems(self.attentions, cp_size, sequence_tokens, sent,
                                     int(context.state.train_state.step), traffic))

    return LongContextRunGuards()
