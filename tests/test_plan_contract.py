"""The planner is the train app's contract: it proposes only what the app accepts, and searches what it accepts.

Sweep: llama3_8b, qwen3_32b, llama3_70b x GPU presets h100, h200 x 1, 8, 32 GPUs x seq 128K, 1M (36 plans, the
plan app's own search space from conf/plan.yaml). For every fitting row the plan app prints with ``plan.show=8``,
its `nemo-longctx train` overrides are composed into the train config, checked with the app's one validation
pass (``config_problems``) and dry-run (``dry_run``: the NeMo objects built and validated against the parallel
layout, the strategy attached, every layer's core attention resolved to ours), all in one process. This machine has
no CUDA and no TransformerEngine, so the app refuses the precision-aware optimizer's TE FusedAdam here (Megatron-FSDP
trains on CPU: cpu_compat_fsdp.py); for those rows the
only problems allowed are exactly the ones the planner's target (CUDA + TransformerEngine, the NGC image) does not
have -- the same ``model_state_problems`` with its target arguments -- and the dry run uses the CPU-runnable
stand-in (``optim.use_distributed_optimizer=true``, same layout and memory options).

Converse: every option combination (cp algorithm x recompute x offload x model state, over the planner's
vocabulary: recompute none/selective[mlp]/full/full_keep_attn, offload none/layer_input; offload=modules and other
selective modules are not modelled) that the app accepts is in the planner's search, on CPU (the app's
config_problems here) and for the GPU target (the same checks with CUDA and TransformerEngine present).
"""

from __future__ import annotations

import itertools
import time

import pytest

from distributed import run_distributed

MODELS = ("llama3_8b", "qwen3_32b", "llama3_70b")
GPUS = ("h100", "h200")
COUNTS = (1, 8, 32)
SEQS = (131072, 1048576)
SHOW = 8  # plan.show: fitting rows printed per plan (all fitting candidates: ~10x the time)


class Composer:
    """Train run specs from override lists: Hydra composes once per group selection (model, cp, recompute, offload,
    optim, tiling); the value overrides are parsed by Hydra's override parser and set like Hydra sets them; the
    config is read by the app's one reader (``read_run_spec``)."""

    def __init__(self):
        from hydra import initialize_config_dir
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from nemo_longctx.apps.plan import conf_dir

        self._init = initialize_config_dir(config_dir=conf_dir(), version_base=None)
        self._init.__enter__()
        self._parser = OverridesParser.create()
        self._base = {}

    def __call__(self, overrides):
        from hydra import compose
        from omegaconf import OmegaConf

        overrides = list(overrides) + ([] if any(o.startswith("data=") for o in overrides) else ["data=synthetic"])
        groups = tuple(o for o in overrides if "." not in o.split("=", 1)[0])
        values = [o for o in overrides if "." in o.split("=", 1)[0]]
        if groups not in self._base:
            self._base[groups] = compose("train", overrides=list(groups))
        cfg = self._base[groups].copy()
        for ov in self._parser.parse_overrides(values):
            OmegaConf.update(cfg, ov.key_or_group, ov.value(), merge=True)  # struct: unknown keys raise
        from nemo_longctx.shared.run_spec import read_run_spec

        return read_run_spec(cfg)


def _plan_cfg(model, gpu):
    """conf/plan.yaml for a model and GPU preset (inside the Composer's Hydra initialisation)."""
    from hydra import compose

    return compose("plan", overrides=[f"model={model}", f"plan={gpu}"])


def _contract(rank, world):
    import torch

    from nemo_longctx.integrations.nemo import compat
    from nemo_longctx.shared import path_checks

    # a real model saves checkpoints by default: the room for them is the cluster's disk, not this machine's
    path_checks.free_bytes = lambda path: 1 << 50

    if not torch.cuda.is_available():
        compat.apply()
    from omegaconf import OmegaConf

    from nemo_longctx.apps.plan import inputs_from_config, optim_fields, train_overrides
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.integrations.megatron.model_state import model_state_options, model_state_problems
    from nemo_longctx.integrations.nemo.app import config_problems, dry_run
    from nemo_longctx.shared.app_keys import NEMO_KEYS
    from nemo_longctx.planner.search import plan

    t0 = time.time()
    compose = Composer()
    res = {"plans": 0, "fitting": 0, "checked": 0, "built": 0, "cpu_only_refused": 0, "bad": [], "fits": {}}
    for model, gpu in itertools.product(MODELS, GPUS):
        base = _plan_cfg(model, gpu)
        for n, seq in itertools.product(COUNTS, SEQS):
            cfg = base.copy()
            OmegaConf.update(cfg, "plan.gpus", n)
            OmegaConf.update(cfg, "plan.seq_length", seq)
            shape, s, hw, precision, coef, cost, search = inputs_from_config(read_plan_spec(cfg))
            p = plan(shape, s, hw, precision, coef, cost, float(cfg.plan.cost_tolerance), **search)
            res["plans"] += 1
            fitting = [e for e in p.evaluations if e.fits]
            res["fits"][(model, gpu, n, seq)] = len(fitting)
            res["fitting"] += len(fitting)
            for ev in fitting[:SHOW]:  # the rows `nemo-longctx plan plan.show=SHOW` prints
                ov = train_overrides(p, ev, model)
                tc = compose(ov)
                problems = config_problems(tc)
                res["checked"] += 1
                # what this CPU machine without TransformerEngine refuses and the planner's target does not: the
                # same checks with CUDA and TransformerEngine present (model_state_problems' target arguments)
                opts = model_state_options(optim_fields(ev.candidate.model_state))
                # (a real model saves checkpoints by default: the checks with saving on, named by the app's keys)
                kw = dict(precision="bf16-mixed", checkpointing=True, keys=NEMO_KEYS)
                target_ok = model_state_problems(opts, target_cuda=True, te_available=True, **kw)
                env_only = [x for x in model_state_problems(opts, **kw) if x not in target_ok]
                if sorted(problems) != sorted(env_only):
                    res["bad"].append((ov, problems))
                    continue
                res["cpu_only_refused"] += bool(env_only)
                if env_only:  # the CPU-runnable stand-in: same layout, recompute, offload, tiling
                    tc = compose([o for o in ov if not o.startswith("optim.")]  # (saving: refused with it on CPU)
                                 + ["optim.use_distributed_optimizer=true", "checkpoint.every_n_steps=0"])
                try:
                    summary = dry_run(tc)  # build + validate + every layer's core attention is ours
                    assert summary["world_size"] == n and summary["seq_length"] == seq, summary
                    res["built"] += 1
                except ValueError as e:
                    res["bad"].append((ov, str(e)))

    # converse: what the app accepts is searched
    from nemo_longctx.apps.plan import RECOMPUTE_GROUP, app_problems
    from nemo_longctx.planner.model_shapes import KNOWN_SHAPES
    from nemo_longctx.planner.search import RECOMPUTE, Hardware, candidate_configs

    plan_cfg = _plan_cfg("llama3_8b", "h100")
    OmegaConf.update(plan_cfg, "plan.checkpoints", False)  # the train config here saves none: every accepted row
    shape, _, _, precision, _, _, search = inputs_from_config(read_plan_spec(plan_cfg))
    hw = Hardware(gpus=8)
    searched = {(c.cp_algorithm, c.recompute, c.offload, c.model_state)
                for c in candidate_configs(KNOWN_SHAPES["llama3_8b"], 1 << 20, hw, **search)}
    missing_cpu, missing_gpu, accepted_cpu, accepted_gpu = [], [], 0, 0
    layouts = {"none": ["cp=none"], "ring": ["cp=ring", "cp.size=8"], "ulysses": ["cp=ulysses", "cp.size=8"],
               "hybrid": ["cp=hybrid", "cp.size=8", "cp.ulysses_size=2"]}
    for algo, rc, off, ms in itertools.product(layouts, RECOMPUTE, ("none", "layer_input"), search["model_states"]):
        ov = ["model=llama3_8b", *layouts[algo], "trainer.devices=8", "trainer.precision=bf16-mixed",
              "model.seq_length=1048576", f"recompute={RECOMPUTE_GROUP[rc][0]}", f"offload={off}",
              *([f"recompute.modules=[{','.join(RECOMPUTE_GROUP[rc][1])}]"] if RECOMPUTE_GROUP[rc][1] else []),
              *[f"optim.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in optim_fields(ms).items()]]
        key = (algo, rc, off, ms)
        if not config_problems(compose(ov)):
            accepted_cpu += 1
            if key not in searched:
                missing_cpu.append(key)
        if not app_problems(algo, rc, off, ms):
            accepted_gpu += 1
            if key not in searched:
                missing_gpu.append(key)
    res.update(missing_cpu=[str(k) for k in missing_cpu], missing_gpu=[str(k) for k in missing_gpu],
               accepted_cpu=accepted_cpu, accepted_gpu=accepted_gpu,
               keep_attn_non_ring=sorted({c[0] for c in searched if c[1] == "full_keep_attn"} - {"ring", "none"}),
               keep_attn_layer_input=any(c[1] == "full_keep_attn" and c[2] == "layer_input" for c in searched),
               seconds=time.time() - t0)
    res["fits"] = {str(k): v for k, v in res["fits"].items()}
    res["bad"] = [(" ".join(o), str(p)[:500]) for o, p in res["bad"][:10]]
    return res


@pytest.fixture(scope="module")
def contract():
    return run_distributed(_contract, 1, timeout=900)[0]


def test_every_fitting_row_passes_the_apps_validation(contract):
    c = contract
    print(f"contract sweep: {c['plans']} plans ({c['fitting']} fitting candidates), {c['checked']} printed rows "
          f"checked with config_problems and dry-run, {c['cpu_only_refused']} of them refused here only for CPU / "
          f"no TE, {c['seconds']:.0f} s")
    assert c["plans"] == len(MODELS) * len(GPUS) * len(COUNTS) * len(SEQS)
    assert c["bad"] == [], c["bad"]
    assert c["checked"] == c["built"] > 100
    assert c["cpu_only_refused"] > 0  # the sweep does propose precision-aware (TE FusedAdam) rows


def test_what_the_app_accepts_is_searched(contract):
    c = contract
    assert c["missing_cpu"] == [] and c["missing_gpu"] == [], (c["missing_cpu"], c["missing_gpu"])
    assert c["accepted_gpu"] > c["accepted_cpu"] > 0
    assert c["keep_attn_non_ring"] == [] and c["keep_attn_layer_input"]
