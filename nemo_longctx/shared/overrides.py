"""Command-line overrides checked before an app starts (Hydra only; no torch, no NeMo): Hydra's own override parser
and compose API, with messages that name the key and the fix instead of a parser trace.

``quote_path_values(args)``   ``checkpoint.resume=/ckpt/step=3-consumed_samples=6.0`` fails Hydra's grammar (a
                              second ``=``); such a value is a path, so it is passed on quoted (``key='...'``);
``compose(name, args)``       compose ``conf/<name>.yaml`` with the overrides the way the app will: a malformed
                              override, an unknown group choice (``cp=rign``) or a key that is not in the config
                              (``cp.sise=4``) becomes one problem naming it, with the nearest valid name.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from omegaconf import open_dict

CONFIG_MODULE = "nemo_longctx.conf"


def _parses(arg: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(arg)
        return True
    except HydraException:
        return False


# keys whose values are paths (a checkpoint's name holds '=': step=3-consumed_samples=6.0-last)
PATH_KEYS = ("checkpoint.resume", "checkpoint.dir", "checkpoint.load", "checkpoint.save", "checkpoint.pretrained",
             "output_dir", "init_from")
PATH_KEY_SUFFIXES = ("_dir", "_path", ".path", ".paths", ".dir", ".file", ".prefix", ".tokenizer")


def is_path_value(key: str, value: str) -> bool:
    """Whether ``key=value`` passes a path: a path key, or a value with a directory separator."""
    key = key.lstrip("+~")
    return "/" in value or key in PATH_KEYS or key.endswith(PATH_KEY_SUFFIXES)


def quote_path_values(args: Sequence[str]) -> List[str]:
    """``key=value`` overrides that pass a path (``is_path_value``) whose value holds another ``=`` (checkpoint
    names: ``step=3-...``) and does not parse as Hydra syntax are quoted; everything else is passed on unchanged (a
    typo such as ``model.seq_length==4096`` stays a syntax error, named by ``compose``)."""
    out = []
    for a in args:
        key, sep, value = a.partition("=")
        if (sep and "=" in value and not a.startswith("-") and not value.startswith(("'", '"'))
                and is_path_value(key, value) and not _parses(a)):
            quoted = key + "='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
            if _parses(quoted):
                a = quoted
        out.append(a)
    return out


def is_demo_model(model_choice: object) -> bool:
    """The CPU demo's tiny models (``conf/model/tiny_*.yaml``): what ``recipe=auto`` gives the demo's settings."""
    return isinstance(model_choice, str) and model_choice.startswith("tiny_")


def demo_recipe_of_choice(cfg: Any, choices: Any) -> None:
    """``recipe=auto`` with one of the CPU demo's tiny models (``model=tiny_*``) and no ``init_from`` is the demo's
    recipe: decided from the group choice, which only the composition knows (``cfg.recipe`` set in place)."""
    if cfg.get("recipe") == "auto" and is_demo_model(choices.get("model")) and cfg.get("init_from") is None:
        with open_dict(cfg):
            cfg.recipe = "demo"


def compose(config_name: str, args: Sequence[str], hydra_config: bool = False) -> Tuple[Any, List[str]]:
    """(config or None, problems) of ``config_name`` composed with ``args`` by Hydra's compose API;
    ``hydra_config``: keep Hydra's own node (``cfg.hydra.runtime.choices``: the group choices)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    flags = hydra_flags(args)
    if flags is None:  # a Hydra flag this check does not model (--cfg, --info, --package, ...): the app's run checks
        return None, []
    overrides, config_dir, config_name = flags[0], flags[1], flags[2] or config_name
    overrides = [a for a in overrides if not a.lstrip("+~").startswith("hydra.")]
    bad = [a for a in overrides if not _parses(a)]
    if bad:
        return None, [_parse_problem(a) for a in bad]
    GlobalHydra.instance().clear()
    try:
        if config_dir:  # the user's config directory first, our package's configs (train, groups) after it
            init = initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None)
            overrides = overrides + [f"hydra.searchpath=[pkg://{CONFIG_MODULE}]"]
        else:
            init = initialize_config_module(config_module=CONFIG_MODULE, version_base=None)
        with init:
            cfg = hydra_compose(config_name, overrides=overrides, return_hydra_config=True)
        demo_recipe_of_choice(cfg, cfg.hydra.runtime.choices)
        if not hydra_config:
            with open_dict(cfg):
                del cfg["hydra"]
        return cfg, []
    except (HydraException, OmegaConfBaseException) as e:
        return None, [_compose_problem(e, config_name, list(args))]
    finally:
        GlobalHydra.instance().clear()


_DIR_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp")
_NAME_FLAGS = ("--config-name", "-cn")


def hydra_flags(args: Sequence[str]) -> Optional[Tuple[List[str], Optional[str], Optional[str]]]:
    """(overrides, config dir, config name) of a Hydra command line (``--config-dir/-cd``, ``--config-path/-cp``,
    ``--config-name/-cn``, as ``--flag value`` or ``--flag=value``); None when it holds another flag."""
    overrides: List[str] = []
    config_dir = config_name = None
    it = iter(args)
    for a in it:
        if not a.startswith("-"):
            overrides.append(a)
            continue
        flag, eq, value = a.partition("=")
        if flag not in _DIR_FLAGS + _NAME_FLAGS:
            return None
        value = value if eq else next(it, "")
        if flag in _DIR_FLAGS:
            config_dir = value
        else:
            config_name = value
    return overrides, config_dir, config_name


def _parse_problem(arg: str) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(arg)
        why = ""
    except HydraException as e:
        why = str(e).strip().splitlines()[0]
    return (f"{arg!r} is not a valid override ({why}): overrides are key=value, +key=value (add), ~key (delete); "
            "quote a value holding spaces or Hydra's special characters (key='a value')")


def _compose_problem(error: Exception, config_name: str, overrides: Sequence[str]) -> str:
    text = str(error)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()] or [type(error).__name__]
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    if missing and "Available options" in text:  # an unknown choice of a config group
        group, given = missing.groups()
        at = next(i for i, ln in enumerate(lines) if ln.startswith("Available options"))
        choices = [ln for ln in lines[at + 1:] if re.fullmatch(r"[\w.-]+", ln)]
        near = difflib.get_close_matches(given, choices, 1)
        hint = f"; did you mean {group}={near[0]}?" if near else ""
        return f"{group}={given}: no such choice of the {group} group{hint} (choose one of: {', '.join(choices)})"
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        return _unknown_key_problem(config_name, unknown.group(1), overrides)
    return lines[0]


def _unknown_key_problem(config_name: str, key: str, overrides: Sequence[str]) -> str:
    """``key`` is not in the composed config: name the nearest key that is (the group of the key composed without
    the failing override)."""
    parent, _, leaf = key.rpartition(".")
    known: List[str] = []
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    cfg, _ = compose(config_name, rest) if rest != list(overrides) else (None, [])
    if cfg is not None:
        from omegaconf import OmegaConf

        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if OmegaConf.is_dict(node):
            known = [str(k) for k in node.keys()]
    near = difflib.get_close_matches(leaf, known, 1)
    where = f"{parent}." if parent else ""
    hint = f"did you mean {where}{near[0]}? " if near else ""
    listed = f"known: {sorted(known)}" if known else ""
    extra = (f"; a field of the model config that its YAML does not list is added with +{key}=..."
             if parent.split(".")[0] == "model" and not near else "")
    return f"{key}: no such key in the config ({hint}{listed}){extra}".replace(" ()", "").replace("? )", "?)")


def conf_dir() -> str:
    """The Hydra config tree: the installed `nemo_longctx.conf` package if present, else the repo's conf/."""
    import importlib.util

    spec = importlib.util.find_spec("nemo_longctx.conf")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / "plan.yaml").exists():
                return str(loc)
    return str(Path(__file__).resolve().parents[2] / "conf")
