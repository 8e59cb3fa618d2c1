"""`nemo-longctx plan`'s printed report. The default view (``plan.show=0``) of the README's 1M-token Llama-3-8B plan
fits a terminal: at most 40 lines, none wider than 100 columns, no third-party warning; it names the chosen layout,
its memory, what limits it (`limited by:`), its caveats from the train app's own checks, and the command, wrapped for
a shell to paste, that joins back into the one-line command ``plan.write_command`` writes and ``plan.show=N`` prints.
``plan.show=N`` prints the full table of N rows and the legend of every abbreviation. Nothing fitting: what is over
budget. Bad `plan.*` values are refused all at once, each naming key and value (exit 2, no traceback). The plot's GPU
limit line lies inside the axes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app_runner import printed_command

ROOT = Path(__file__).resolve().parents[1]
README_PLAN = ("model=llama3_8b", "plan.seq_length=1048576", "plan.gpus=8")
SHOW = 5


def _plan(*overrides):
    return subprocess.run([sys.executable, "-m", "nemo_longctx.apps.plan", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)


def _block(lines, start):
    """The line starting with ``start`` and its indented continuation lines, as one line of text."""
    i = next(n for n, line in enumerate(lines) if line.startswith(start))
    j = i + 1
    while j < len(lines) and lines[j].startswith("  "):
        j += 1
    return " ".join(" ".join(lines[i:j]).split())


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    """(default view, its plan.write_command file's text, the plan.show=SHOW view) of README_PLAN: (exit status,
    stdout, stderr) each."""
    command = tmp_path_factory.mktemp("plan") / "command.txt"
    default, full = (_plan(*README_PLAN, extra) for extra in (f"plan.write_command={command}", f"plan.show={SHOW}"))
    return ((default.returncode, default.stdout, default.stderr), command.read_text(),
            (full.returncode, full.stdout, full.stderr))


def test_default_view_fits_a_terminal_and_names_the_chosen_layout(views):
    (code, out, err), _, _ = views
    assert code == 0, out + err
    lines = out.splitlines()
    assert len(lines) <= 40, (len(lines), out)
    assert max(len(line) for line in lines) <= 100, [line for line in lines if len(line) > 100]
    assert "Warning" not in out and "Warning" not in err, err  # no third-party warning before or in the report
    assert lines[0].startswith("llama3_8b: 32 layers")
    chosen = next(i for i, line in enumerate(lines) if line.startswith("chosen: cp="))
    # the chosen row's device and host memory against the limits (the full view's `  chosen row:` line)
    assert " of 80 GiB per GPU at the peak " in lines[chosen + 1] and "largest part" in lines[chosen + 1]
    assert " of 1024 GiB host per node; relative cost " in lines[chosen + 2]
    limited = _block(lines, "limited by: ")
    assert "device memory" in limited and "GiB per GPU" in limited and "cheapest: cp=" in limited
    caveats = _block(lines, "caveats:")
    if "state=fsdp" in lines[chosen]:  # Megatron-FSDP saves checkpoints in this app at bf16-mixed
        assert "saves no checkpoints" not in caveats and "Megatron-FSDP on GPUs is NeMo's own path" in caveats
    assert any(line.startswith("checkpoint: ") for line in lines)
    assert "plan.show=N" in lines[-1]


def test_the_wrapped_command_joins_into_the_one_line_command(views):
    (code, out, _), written, (_, full, _) = views
    assert code == 0
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("nemo-longctx train "))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith(" \\"))
    assert end - start >= 5 and all(line.startswith("  ") for line in lines[start + 1:end + 1])
    one_line = written.rstrip("\n")
    assert "\n" not in one_line and one_line.startswith("nemo-longctx train model=llama3_8b ")
    assert printed_command(out) == one_line  # what a shell makes of the pasted lines
    assert printed_command(full) == one_line  # plan.show=N prints it on one line
    assert subprocess.run(["bash", "-n", "-c", "\n".join(lines[start:end + 1])]).returncode == 0


def test_plan_show_prints_the_full_table_and_the_legend(views):
    from nemo_longctx.apps.plan import LEGEND

    _, _, (code, out, err) = views
    assert code == 0, out + err
    assert "Warning" not in out and "Warning" not in err, err
    lines = out.splitlines()
    top = next(i for i, l in enumerate(lines) if l.lstrip().startswith("cp ") and "fits" in l)
    header = lines[top].split()
    assert set(lines[top + 1]) == {"-", " "}
    rows = lines[top + 2:lines.index("", top)]
    assert len(rows) == SHOW and all(r.split()[-1] in ("yes", "host", "no") for r in rows), rows
    assert len(header) == 19  # every column
    chosen = next(i for i, l in enumerate(lines) if l.startswith("chosen: "))
    assert lines[chosen + 1].startswith("nemo-longctx train ")  # the command on one line after `chosen:`
    rest = "\n".join(lines[chosen:])
    legend = [l.split()[0] for l in rest.split("legend:\n", 1)[1].splitlines()[:len(LEGEND)]]
    assert legend == [k for k, _ in LEGEND]
    explained = {k for k, _ in LEGEND} | {p for k, _ in LEGEND if k != "host/node" for p in k.split("/")}
    assert set(header) <= explained, set(header) - explained  # every column is explained
    for token in ("+pa", "+optoffF", "optoff0.5 = half", "rc=", "off=", "fsdp"):
        assert token in rest, token
    limited = next(l for l in lines if l.startswith("limited by: "))
    assert "device memory" in limited and "GiB per GPU" in limited
    assert any(l.startswith("  chosen row: ") and "GiB host per node" in l for l in lines)
    assert "caveats:" in rest
    if "state=fsdp" in lines[chosen]:  # Megatron-FSDP saves checkpoints in this app at bf16-mixed
        assert "saves no checkpoints" not in rest


def test_nothing_fits_says_what_is_over_budget():
    r = _plan("model=llama3_70b", "plan.seq_length=1048576", "plan.gpus=8", "plan.host_memory_gb=64",
              "plan.search.sharding=[distributed]", "plan.search.precision_aware=[false]")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) <= 40 and max(len(line) for line in lines) <= 100, r.stdout
    limited = _block(lines, "limited by: ")
    assert limited.startswith("limited by: nothing fits; device memory: ") and "closest: " in limited
    assert "no fitting plan:" in r.stdout


def test_the_cpu_targets_model_state_checks_import_without_a_warning():
    """plan.target=cpu imports the train app's CPU-only checks (and with them torch): pynvml's deprecation warning,
    printed by torch.cuda's import, stays out of the report; other warnings are not silenced."""
    code = ("import sys, warnings; from nemo_longctx.apps.plan import _model_state_cpu_problems; "
            "_model_state_cpu_problems(); assert 'torch' in sys.modules; warnings.warn('ours', FutureWarning)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "pynvml" not in r.stderr and "FutureWarning: ours" in r.stderr, r.stderr


def test_the_plot_shows_the_gpu_limit_with_headroom(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps.plan import conf_dir, inputs_from_config, plot_memory
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.planner.search import plan

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose("plan", overrides=["model=llama3_8b", "plan.seq_length=131072", "plan.gpus=8"])
    GlobalHydra.instance().clear()
    shape, seq, hw, precision, coef, cost, search = inputs_from_config(read_plan_spec(cfg))
    p = plan(shape, seq, hw, precision, coef, cost, **search)
    png = tmp_path / "mem.png"
    low, high, tallest = plot_memory(str(png), p, p.chosen, "llama3_8b")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert low == 0 and high == pytest.approx(1.1 * max(hw.gpu_memory_gb, tallest))
    assert high > hw.gpu_memory_gb * 1.09  # the limit line is below the top of the axes


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


def test_output_files_that_cannot_be_written_are_named_before_planning(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = _plan(f"plan.write_command={blocker}/cmd.txt", f"plan.write_sbatch={tmp_path}", "plan.plot=/proc/no/mem.png")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout == "", r.stdout + r.stderr
    for want in (f"plan.write_command={blocker}/cmd.txt: its directory {blocker}: is a file, not a directory",
                 f"plan.write_sbatch={tmp_path}: is a directory, not a file",
                 "plan.plot=/proc/no/mem.png: its directory /proc/no: cannot be created in /proc"):
        assert want in r.stderr, (want, r.stderr)
    ok = tmp_path / "new" / "cmd.txt"  # a directory that does not exist yet is made
    r = _plan(f"plan.write_command={ok}")
    assert r.returncode == 0 and ok.read_text().startswith("nemo-longctx train "), r.stdout + r.stderr


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
