"""A NeMo pretraining recipe shrunk to the app's tiny model and settings (tests of the NeMo-Run front end).

``tiny_llama3_recipe(dir)`` is NeMo's ``llm.llama3_8b.pretrain_recipe`` as shipped, with only what a CPU run and a
side-by-side comparison with ``nemo-longctx train`` need changed: the model fields of ``conf/model/tiny_llama.yaml``,
the app's synthetic data module (same tokens), fp32 on 2 CPU processes, the app's learning-rate schedule, no async
checkpoint save (GPU only). ``APP_ARGS`` are the app overrides that train the same run."""

from __future__ import annotations

import os
from typing import Any, List

STEPS = 3
SEQ = 1024
APP_ARGS: List[str] = [f"trainer.max_steps={STEPS}", f"model.seq_length={SEQ}", "optim=distributed",
                       "trainer.devices=2", "trainer.accelerator=cpu"]


def tiny_model_config() -> Any:
    import nemo_run as run
    from nemo.collections.llm.gpt.model.llama import Llama3Config
    from omegaconf import OmegaConf

    from nemo_longctx.apps.plan import conf_dir

    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(conf_dir(), "model", "tiny_llama.yaml")))
    fields.pop("_target_")
    fields["seq_length"] = SEQ
    return run.Config(Llama3Config, **fields)


def tiny_llama3_recipe(dir: str, name: str = "tiny", steps: int = STEPS) -> Any:
    from nemo.collections.llm.recipes import llama3_8b

    return shrink_recipe(llama3_8b.pretrain_recipe(dir=dir, name=name, num_nodes=1, num_gpus_per_node=2), steps)


def shrink_recipe(r: Any, steps: int = STEPS) -> Any:
    """A NeMo pretraining recipe as it comes (any GPU count), shrunk in place for a CPU run: the app's tiny model,
    synthetic data, fp32, ``steps`` steps, no checkpoints (the rest of ``tiny_llama3_recipe``'s list above)."""
    import nemo_run as run
    from nemo import lightning as nl

    from nemo_longctx.integrations.nemo.data import SyntheticDataModule

    r.model.config = tiny_model_config()
    r.trainer.accelerator = "cpu"
    r.trainer.max_steps = steps
    r.trainer.val_check_interval = None
    r.trainer.limit_val_batches = 0
    r.trainer.num_sanity_val_steps = 0
    r.trainer.plugins = run.Config(nl.MegatronMixedPrecision, precision="32")
    r.trainer.strategy.ckpt_async_save = False  # GPU only
    r.data = run.Config(SyntheticDataModule, seq_length=SEQ, vocab_size=1024, micro_batch_size=1, global_batch_size=1,
                        num_train_samples=100000, num_val_samples=64, period=256, skew=3.0, seed=1234)
    r.optim.config.lr = 3.0e-3
    r.optim.config.weight_decay = 0.0
    r.optim.config.adam_eps = 1e-8
    r.optim.config.bf16 = False
    r.optim.lr_scheduler.warmup_steps = 3
    r.optim.lr_scheduler.min_lr = 3.0e-4
    r.optim.lr_scheduler.max_steps = steps
    r.optim.lr_scheduler.constant_steps = 0
    r.log.ckpt = None  # the app run saves no checkpoint either
    r.trainer.enable_checkpointing = False
    r.log.tensorboard = None
    return r


class RecordAttention:
    """A Lightning callback (built in the ranks from the recipe) that writes, at fit start, the class of every
    attention layer's core attention: ``<path>.<rank>`` holds ``name<TAB>class`` lines."""

    def __new__(cls, path: str) -> Any:
        import lightning.pytorch as pl
        from megatron.core.transformer.attention import Attention

        class _Record(pl.Callback):
            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                rows = [f"{n}\t{type(m.core_attention).__name__}" for n, m in pl_module.named_modules()
                        if isinstance(m, Attention)]
                with open(f"{path}.{trainer.global_rank}", "w") as f:
                    f.write("\n".join(rows) + "\n")

        return _Record()


def write_slurm_sbatch(out: str, sbatch: str, partition: str = "local") -> None:
    """The tiny recipe with ``LongContextPlugin`` under NeMo-Run's ``SlurmExecutor`` (1 node, torchrun with 2
    processes, ``LocalTunnel`` into ``$NEMORUN_HOME/experiments``, no packaging): the experiment's dry run (which
    applies the plugin and writes the task's configs) and the sbatch script it would submit, written to ``sbatch``."""
    import nemo_run as run

    from nemo_longctx.integrations.nemo.recipes import LongContextPlugin

    home = os.environ["NEMORUN_HOME"]
    executor = run.SlurmExecutor(account="", partition=partition, nodes=1, ntasks_per_node=2, time="00:10:00",
                                 tunnel=run.LocalTunnel(job_dir=os.path.join(home, "experiments")),
                                 packager=run.Packager())
    executor.launcher = "torchrun"  # NeMo-Run turns it into 1 task per node running torchrun --nproc-per-node 2
    with run.Experiment("slurm_tiny", executor=executor) as exp:
        exp.add(tiny_llama3_recipe(out), name="tiny",
                plugins=[LongContextPlugin(cp="ring", cp_size=2, recompute="full", offload="layer_input")])
        exp.dryrun(log=False, delete_exp_dir=False)  # keep the configs the script points at
        script = exp.jobs[0]._dryrun_info.request.materialize()
    with open(sbatch, "w") as f:
        f.write(script)


def main(argv: List[str]) -> None:
    """``python tests/nemo_run_recipes.py OUT_DIR``: NeMo's recipe, shrunk, through ``run.Experiment`` with
    ``LocalExecutor`` (torchrun, 2 CPU processes) and ``LongContextPlugin(cp="ring", cp_size=2, recompute="full",
    offload="layer_input")``; exits 1 when the job does not succeed. (NeMo-Run loads this file again in every rank
    as its "external main": everything runs under the ``__main__`` guard.)"""
    import sys

    import nemo_run as run

    import nemo_run_recipes  # the callback by its module name (importable in the ranks through PYTHONPATH)
    from nemo_longctx.integrations.nemo.recipes import LongContextPlugin

    if argv[0] == "--slurm-sbatch":  # OUT_DIR SBATCH: write the SlurmExecutor's sbatch script, run nothing
        write_slurm_sbatch(argv[1], argv[2])
        return
    out = argv[0]
    recipe = tiny_llama3_recipe(out)
    recipe.trainer.callbacks.append(run.Config(nemo_run_recipes.RecordAttention, path=os.path.join(out, "attention")))
    tests = os.path.dirname(os.path.abspath(__file__))
    executor = run.LocalExecutor(ntasks_per_node=2, launcher="torchrun",
                                 env_vars={"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    plugin = LongContextPlugin(cp="ring", cp_size=2, recompute="full", offload="layer_input")
    with run.Experiment("tiny_long_context", executor=executor) as exp:
        exp.add(recipe, name="tiny", plugins=[plugin])
        exp.run(sequential=True, detach=False)
    states = [str(exp.status(return_dict=True)[name]["status"]) for name in ("tiny",)]  # after the wait on exit
    print("job states:", states, flush=True)
    sys.exit(0 if all("SUCCEEDED" in s for s in states) else 1)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
