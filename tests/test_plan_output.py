"""`nemo-longctx plan`'s printed report after the table: the legend of every abbreviation, `limited by:` (what
limits the chosen row, or what is over budget when nothing fits), the chosen row's caveats from the train app's own
checks; and bad `plan.*` values refused all at once, each naming key and value (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plan(*overrides):
    return subprocess.run([sys.executable, "-m", "nemo_longctx.apps.plan", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)


def test_legend_limited_by_and_caveats_follow_the_chosen_line():
    from nemo_longctx.apps.plan import LEGEND

    r = _plan("model=llama3_8b", "plan.seq_length=1048576", "plan.gpus=8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    chosen = next(i for i, l in enumerate(lines) if l.startswith("chosen: "))
    assert lines[chosen + 1].startswith("nemo-longctx train ")  # the lines tests and users parse stay put
    rest = "\n".join(lines[chosen:])
    legend = [l.split()[0] for l in rest.split("legend:\n", 1)[1].splitlines()[:len(LEGEND)]]
    assert legend == [k for k, _ in LEGEND]
    header = next(l for l in lines if l.lstrip().startswith("cp ") and "fits" in l).split()
    explained = {k for k, _ in LEGEND} | {p for k, _ in LEGEND if k != "host/node" for p in k.split("/")}
    assert set(header) <= explained, set(header) - explained  # every column is explained
    for token in ("+pa", "+optoffF", "optoff0.5 = half", "rc=", "off=", "fsdp"):
        assert token in rest, token
    limited = next(l for l in lines if l.startswith("limited by: "))
    assert "device memory" in limited and "GiB per GPU" in limited
    assert any(l.startswith("  chosen row: ") and "GiB host per node" in l for l in lines)
    assert "caveats:" in rest
    if "state=fsdp" in lines[chosen]:  # Megatron-FSDP: no checkpoint saving in this app
        assert "checkpoint saving (checkpoint.every_n_steps > 0): optim.megatron_fsdp=true" in rest


def test_nothing_fits_says_what_is_over_budget():
    r = _plan("model=llama3_70b", "plan.seq_length=1048576", "plan.gpus=8", "plan.host_memory_gb=64",
              "plan.search.sharding=[distributed]", "plan.search.precision_aware=[false]")
    assert r.returncode == 2, r.stdout + r.stderr
    limited = next(l for l in r.stdout.splitlines() if l.startswith("limited by: "))
    assert limited.startswith("limited by: nothing fits; device memory: ") and "closest: " in limited
    assert "no fitting plan:" in r.stdout


def test_bad_plan_values_are_named_all_at_once():
    r = _plan("plan.gpu_memory_gb=abc", "plan.gpus=0", "plan.search.optimizer_offload=[2]", "plan.target=tpu",
              "+plan.serch.max_tp=2")
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    assert "Traceback" not in err and "could not convert" not in err, err
    for want in ("plan.gpu_memory_gb='abc' must be a number > 0", "plan.gpus=0 must be a positive int",
                 "plan.search.optimizer_offload=[2] must be", "plan.target='tpu' must be one of gpu, cpu",
                 "plan.serch"):
        assert want in err, (want, err)


def test_plan_key_problems_accept_the_shipped_configs():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from nemo_longctx.apps.plan import conf_dir
    from nemo_longctx.shared.plan_keys import plan_key_problems

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        for preset in ("h100", "h200"):
            cfg = compose("plan", overrides=[f"plan={preset}"])
            assert plan_key_problems(OmegaConf.to_container(cfg.plan, resolve=True)) == []
    GlobalHydra.instance().clear()
