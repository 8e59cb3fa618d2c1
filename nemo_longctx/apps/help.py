"""``--help`` / ``-h`` of ``nemo-longctx train``, ``plan`` and ``bridge``: our own config groups and keys, generated
from the option model and the ``conf/`` tree (nothing here is written twice):

- each config group of the app's defaults list with its choices (the group directory's YAML files, each with the
  first comment line of its file; the default marked ``*``);
- each declared key (``nemo_longctx.options.Option``: the option model's groups, the NeMo app's ``APP_OPTIONS``,
  plan's ``PLAN_OPTIONS``, the Bridge app's own keys) with its type, its default in this app's config and its help
  line;
- worked examples, and where Hydra's own help is (``--hydra-help``, passed through to Hydra untouched).

Standard library, PyYAML and the option model only (no NeMo, torch or Hydra import): it answers in well under a
second. Entry points: ``maybe_print_help(app, args)`` at the top of each app's ``main`` and in ``nemo_longctx.apps.cli``
before the app is imported.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HELP_FLAGS = ("-h", "--help")
CONF = Path(__file__).resolve().parents[1] / "conf"  # nemo_longctx/conf
_MISSING = object()

EXAMPLES = {
    "train": (
        ("CPU demo: tiny GQA Llama, ring CP=2 on 2 gloo processes, 30 steps (the demo's settings)",
         "nemo-longctx train"),
        ("dry run: the Llama-3-8B configuration at 128K on 8 GPUs, with NeMo's llama3_8b recipe (bf16, its optimizer "
         "and schedule, a checkpoint every 15 minutes), built and validated without training",
         "nemo-longctx train model=llama3_8b cp=ring cp.size=8 trainer.devices=8 model.seq_length=131072 "
         "data=synthetic run.dry_run=true"),
        ("train it on your data: a Megatron indexed dataset and its tokenizer",
         "nemo-longctx train model=llama3_8b cp=ring cp.size=8 trainer.devices=8 model.seq_length=131072 "
         "data=indexed data.paths=[/data/corpus_text_document] data.tokenizer=/models/llama3_tokenizer"),
        ("memory options on the CPU demo",
         "nemo-longctx train recompute=full_keep_attn offload=layer_input tiling.mlp_tiles=auto "
         "tiling.loss_chunks=8"),
        ("Ulysses CP with chunked heads", "nemo-longctx train cp=ulysses cp.size=2 cp.head_chunks=2"),
    ),
    "plan": (
        ("plan a 1M-token Llama-3-8B run on 8 x 80 GB (H100 preset)",
         "nemo-longctx plan model=llama3_8b plan.seq_length=1048576 plan.gpus=8 plan.gpu_memory_gb=80"),
        ("Llama-3-70B on 64 H200s, as JSON",
         "nemo-longctx plan model=llama3_70b plan=h200 plan.seq_length=1048576 plan.gpus=64 plan.json=true"),
        ("write an sbatch script and a memory plot for the chosen row",
         "nemo-longctx plan model=llama3_8b plan.seq_length=524288 plan.write_sbatch=run.sbatch "
         "plan.plot=outputs/plan/mem.png"),
    ),
    "bridge": (
        ("CPU demo: tiny Llama through Bridge's Llama mapping, ring CP=2 on 2 gloo ranks", "nemo-longctx bridge"),
        ("a Bridge recipe with our CP and memory options and Bridge's own keys",
         "nemo-longctx bridge recipe=llama3_8b_pretrain_config cp=ring cp.size=8 recompute=full_keep_attn "
         "offload=layer_input train.train_iters=100"),
        ("packed documents (attention within each EOD-ended document), short ones kept whole on one CP rank",
         "nemo-longctx bridge data.packing=documents cp.split_min_tokens=auto"),
    ),
}
INTROS = {
    "train": "NeMo 2 pre-training with nemo_longctx context parallelism (conf/train.yaml; Hydra overrides).",
    "plan": "memory/parallelism planner: picks CP / TP / recompute / offload / tiling / model state for a target "
            "sequence length and cluster (conf/plan.yaml; Hydra overrides).",
    "bridge": "Megatron-Bridge pre-training with nemo_longctx's options (conf/bridge.yaml; our keys are Hydra "
              "overrides, every other KEY=VALUE goes to Bridge's own override parser).",
}
CONFIG_NAMES = {"train": "train", "plan": "plan", "bridge": "bridge"}


# ------------------------------------------------------------------------------------------------- conf/ reading
def _load(path: Path) -> Dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def defaults_of(config_name: str) -> List[Tuple[str, str, bool]]:
    """(group, default choice, optional) of a primary config's defaults list (``hydra/...`` entries left out)."""
    out = []
    for entry in _load(CONF / f"{config_name}.yaml").get("defaults", []) or []:
        if not isinstance(entry, dict):
            continue
        for k, v in entry.items():
            optional = k.startswith("optional ")
            group = k.split()[-1]
            if k.startswith("override ") or group.startswith("hydra"):
                continue
            out.append((group, str(v), optional))
    return out


def group_choices(group: str) -> List[Tuple[str, str]]:
    """(choice, first comment line of its file) for every YAML file of a config group directory."""
    out = []
    for path in sorted((CONF / group).glob("*.yaml")):
        first = ""
        for line in path.read_text().splitlines():
            s = line.strip()
            if s.startswith("#") and not s.startswith("# @package"):
                first = s.lstrip("#").strip()
                break
            if s and not s.startswith("#"):
                break
        out.append((path.stem, first))
    return out


def _group_file(group: str, choice: str, seen: Optional[set] = None) -> Dict[str, Any]:
    """A group option's values, with the same-group files its own defaults list names (e.g. optim/fsdp <- default)."""
    seen = seen or set()
    if choice in seen:
        return {}
    seen.add(choice)
    data = _load(CONF / group / f"{choice}.yaml")
    merged: Dict[str, Any] = {}
    for entry in data.pop("defaults", []) or []:
        if isinstance(entry, str) and entry != "_self_":
            merged.update(_group_file(group, entry, seen))
    merged.update(data)
    return merged


def config_values(config_name: str) -> Dict[str, Any]:
    """The app's composed defaults as a nested dict (groups at their defaults, then the primary file's own keys),
    close enough for showing defaults: no interpolation, no command line."""
    out: Dict[str, Any] = {}
    for group, choice, _ in defaults_of(config_name):
        out[group] = _group_file(group, choice)
    own = _load(CONF / f"{config_name}.yaml")
    own.pop("defaults", None)
    own.pop("hydra", None)
    for k, v in own.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


# ------------------------------------------------------------------------------------------------- declarations
def declared_options(app: str, app_options: Sequence[Any] = ()) -> Tuple[Any, ...]:
    """Every ``Option`` an app declares (what its help lists); ``app_options``: the Bridge app's own keys
    (``apps.bridge._app_options()``, handed in by its ``main``: this module does not import the apps)."""
    from nemo_longctx.options import LongContextOptions

    if app == "train":
        from nemo_longctx.shared.app_keys import APP_OPTIONS

        return tuple(LongContextOptions.options()) + tuple(APP_OPTIONS)
    if app == "plan":
        from nemo_longctx.shared.plan_keys import PLAN_OPTIONS

        return tuple(PLAN_OPTIONS)
    if app == "bridge":
        groups = ("cp.", "recompute.", "offload.", "tiling.", "memory.")
        ours = tuple(o for o in LongContextOptions.options()
                     if o.key.startswith(groups) or o.key.startswith("optim.") and _model_state_key(o.key))
        return ours + tuple(app_options)
    raise ValueError(f"no help for {app!r}")


def _model_state_key(key: str) -> bool:
    from nemo_longctx.options import ModelStateOptions

    return key in {o.key for o in ModelStateOptions.OPTIONS}


def _option_line(o: Any, values: Dict[str, Any], width: int) -> str:
    from nemo_longctx.shared.run_spec import select_path

    value = select_path(values, o.key, _MISSING)
    default = _show(o.default if value is _MISSING else value)
    requires = tuple(getattr(o, "requires", ()))
    when = f" (with {', '.join(requires)})" if requires and not o.help.startswith(requires[0]) else ""
    return f"  {o.key.ljust(width)}  {o.help}{when}  [{o.expectation()}; default {default}]"


# ------------------------------------------------------------------------------------------------- the text
def help_text(app: str, prog: Optional[str] = None, app_options: Sequence[Any] = ()) -> str:
    prog = prog or f"nemo-longctx {app}"
    config_name = CONFIG_NAMES[app]
    values = config_values(config_name)
    options = declared_options(app, app_options)
    hydra_flag = " [--hydra-help]" if app != "bridge" else ""
    lines = [f"usage: {prog} [GROUP=CHOICE ...] [KEY=VALUE ...]{hydra_flag}", "", INTROS[app], ""]

    groups = defaults_of(config_name)
    if groups:
        lines.append("config groups (GROUP=CHOICE; * = default; the files are in nemo_longctx/conf/GROUP/):")
        for group, default, optional in groups:
            choices = group_choices(group)
            note = " (optional group)" if optional else ""
            lines.append(f"  {group}{note}:")
            width = max((len(c) for c, _ in choices), default=0)
            for choice, desc in choices:
                mark = "*" if choice == default else " "
                text = desc if len(desc) <= 100 else desc[:97] + "..."
                lines.append(f"    {mark} {choice.ljust(width)}  {text}".rstrip())
        lines.append("")

    lines.append("keys (KEY=VALUE; [type; default in this app's config]):")
    width = max(len(o.key) for o in options)
    sections: Dict[str, List[Any]] = {}
    for o in options:
        head = o.key.split(".")[0] if "." in o.key else "(top level)"
        if app == "plan" and o.key.count(".") >= 2:
            head = ".".join(o.key.split(".")[:2])
        sections.setdefault(head, []).append(o)
    for head, opts in sections.items():
        lines.append(f" {head}:")
        lines += [_option_line(o, values, width) for o in opts]
    if app == "train":
        lines += [" model / data:",
                  "  model.<field>  any field of the model config (e.g. model.seq_length=131072, "
                  "model.rotary_base=8000000); see conf/model/<choice>.yaml",
                  "  data.<field>   the data group's fields (e.g. data.paths=[...], data.packing=documents); "
                  "see conf/data/<choice>.yaml"]
    if app == "bridge":
        lines += [" Bridge's own keys:",
                  "  every other KEY=VALUE goes to Bridge's override parser on the recipe's ConfigContainer "
                  "(train.train_iters=3, model.seq_length=4096, checkpoint.save=...)"]
    lines += ["", "examples:"]
    for what, command in EXAMPLES[app]:
        lines += [f"  # {what}", f"  {command}"]
    lines += [""] + ([f"Hydra's own full help (its flags, the composed config groups): {prog} --hydra-help"]
                     if app != "bridge" else [])
    lines += ["Add a key a config does not have with +KEY=VALUE; keys the app does not know are refused by name."]
    return "\n".join(lines) + "\n"


def wants_help(args: Sequence[str]) -> bool:
    return any(a in HELP_FLAGS for a in args)


def maybe_print_help(app: str, args: Optional[Sequence[str]] = None, prog: Optional[str] = None,
                     app_options: Sequence[Any] = ()) -> None:
    """``-h``/``--help`` among ``args`` (default: ``sys.argv[1:]``): print the app's help and exit 0.
    ``--hydra-help`` is not ours: it goes on to Hydra."""
    args = list(sys.argv[1:] if args is None else args)
    if wants_help(args):
        sys.stdout.write(help_text(app, prog, app_options))
        sys.stdout.flush()
        sys.exit(0)
