"""The package's layering, checked from the source with ``ast`` (nothing of the package is imported; < 1 s).

Layers, arrows only pointing down (an import may go to the same or a lower rank; anyone may import the leaves)::

    apps          nemo_longctx.apps.* (train, bridge, bridge_convert, plan, convert, help, cli, nemo_run_cli,
                  nemo_run_planned), nemo_longctx.selftest(.*), nemo_longctx.__main__
    front ends    nemo_longctx.integrations.nemo.*    (each module imports NeMo or Lightning, itself or through a
                                                       module of the NeMo wing that does; else it belongs in shared/.
                                                       One named exception: NEMO_WING_WITHOUT_NEMO)
                  nemo_longctx.integrations.bridge.*  (never reaches the NeMo wing; nor does the Bridge app)
    neutral       nemo_longctx.integrations.megatron.*   (megatron-core and torch; never nemo/lightning/hydra/bridge)
    memory        nemo_longctx.memory.*                  (plain torch; may use attention)
    attention     nemo_longctx.attention.*               (plain torch)
    planner       nemo_longctx.planner.*                 (plain Python: the standard library, nemo_longctx.options
                                                          and nemo_longctx.shared.signals, for DEFAULT_GRACE_S)
    shared        nemo_longctx.shared.*                  (what both front ends share: the standard library, torch
                                                          (lazily today), Hydra/OmegaConf (overrides), tqdm,
                                                          nemo_longctx.options and other shared modules; never NeMo,
                                                          Lightning, Megatron, Bridge, NeMo-Run or transformers)
    leaves        nemo_longctx (``__init__``), nemo_longctx.options (the option model, standard library only),
                  nemo_longctx.conf (the Hydra config package: data), nemo_longctx.integrations (the namespace
                  ``__init__``)

Where shared and the planner rank: below attention, just above the leaves. Neither imports anything of the package
but the leaves (the planner also ``shared.signals``), so every layer may import them; today only the front ends and
the apps do (integrations/megatron, memory and attention import neither). Ranking them above the torch layers would
allow the launcher or the planner to import attention, memory or Megatron code, which they must not.

Also checked: no import cycles; every internal import names an existing module; no module imports a private
(single-underscore) name of another module of the package, by ``from m import _x`` or as ``m._x`` on an imported
module, except the compat modules (``COMPAT``: they patch what they must); the package root holds only
``__init__.py``, ``__main__.py`` and ``options.py`` besides the subpackages; no class change (``x.__class__ = ``), no
per-instance method (``x.forward = ``) and no rebinding of a third-party name anywhere but in the modules that make
the patch ledgers' rows (``PATCHING``; the self-test's own instruments named in ``SELFTEST_INSTRUMENTS``); and only
the one reader of a composed config (``READER``: ``shared/run_spec.py``) reads its groups (``OPTION_GROUPS``) --
every other module takes the run spec (the composition, ``COMPOSER``, sets the demo's recipe before it).

Every import counts: module level and inside functions, ``import x``, ``from x import y``, relative imports resolved
to absolute names, and ``importlib.import_module("<literal>")``. ``from pkg import name`` is an import of the
submodule ``pkg.name`` when that is a module of this package and ``pkg``'s ``__init__`` does not bind ``name``
itself, otherwise of ``pkg`` (its ``__init__``). Imports under ``if TYPE_CHECKING:`` count as well.
Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``; those implicit parent-package edges are not
counted (a package's own modules importing each other through it would otherwise all be cycles).
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "nemo_longctx"
PKG_DIR = ROOT / PKG

APPS = ("apps", "selftest", "__main__")
FRONT_ENDS = ("integrations.nemo", "integrations.bridge")
LEAVES = {PKG, f"{PKG}.options", f"{PKG}.conf", f"{PKG}.integrations"}
ROOT_FILES = ("__init__.py", "__main__.py", "options.py")  # the package root's only .py files (rule 5)

# rank of each layer: an import may only go to the same or a lower rank (leaves: anyone may import them)
RANKS = {"apps": 6, "front end": 5, "integrations.megatron": 4, "memory": 3, "attention": 2, "planner": 1, "shared": 0}

NOT_IN_NEUTRAL = ("nemo", "lightning", "pytorch_lightning", "hydra", "omegaconf", "megatron.bridge", "nemo_run")
NOT_IN_PLAIN_TORCH = ("megatron", "nemo", "lightning", "pytorch_lightning", "hydra", "omegaconf", "nemo_run",
                      "transformer_engine", "flash_attn", "apex")
# Optional kernels that attention/ and memory/ may import lazily (inside a function, never at module level), each
# (module doing it, what it imports): flash-attn's interface, probed by the kernel dispatcher and reported as
# "absent"/"broken" when it does not import. Nothing imports TransformerEngine there today.
LAZY_OPTIONAL_KERNELS = {
    (f"{PKG}.attention.kernels", "flash_attn.flash_attn_interface"),
}
# third-party packages attention/ and memory/ may import at all ("torch only"; plus the optional kernels above)
PLAIN_TORCH_THIRD_PARTY = ("torch",)

# shared/ (rule 3): the third-party packages it may import, and the package's modules besides shared.*
SHARED_THIRD_PARTY = ("torch", "hydra", "omegaconf", "tqdm")  # tqdm: progress bars, imported lazily
SHARED_OWN = (f"{PKG}.options",)
# planner/ (plain Python): the package's modules it may import besides planner.*; no third-party package at all
PLANNER_OWN = (f"{PKG}.options", f"{PKG}.shared.signals")
# the NeMo wing's frameworks (rule 1): each of its modules imports one, itself or through a module of the wing
NEMO_FRAMEWORKS = ("nemo", "lightning", "pytorch_lightning")
NEMO_WING = f"{PKG}.integrations.nemo"
# integrations/nemo modules that import neither, and why they stay there
NEMO_WING_WITHOUT_NEMO = {
    NEMO_WING: "the wing's package __init__ (a docstring)",
    f"{NEMO_WING}.steps": "NeMo's data_step_fn / forward_step_fn (the contract of NeMo's GPTConfig) written with "
                          "torch and Megatron-core: not shared/ (Megatron), not integrations/megatron (neither "
                          "Megatron-core's loop nor Bridge calls it: theirs is forward_step(data_iterator, model))",
    f"{NEMO_WING}.patches": "NeMo's patch ledger: the rows only (target, devices, versions, why, the compat function "
                            "that patches), read without importing NeMo by --versions and the self-test",
}
# the Megatron-Bridge side (rule 2): none of these reaches the NeMo wing, directly or through other modules
BRIDGE_SIDE = (f"{PKG}.apps.bridge", f"{PKG}.apps.bridge_convert", f"{PKG}.integrations.bridge")
# the modules that patch libraries and may use private names of other modules (rule 4)
COMPAT = {f"{PKG}.integrations.megatron.cpu_compat", f"{PKG}.integrations.megatron.cpu_compat_fsdp",
          f"{PKG}.integrations.bridge.cpu_compat", f"{PKG}.integrations.nemo.compat"}
STDLIB = sys.stdlib_module_names | {"__future__"}


@dataclass(frozen=True)
class Import:
    src: str  # importing module
    target: str  # absolute name of the imported module
    file: str  # path relative to the repository
    line: int
    function_level: bool  # inside a def (lazy)

    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.src} imports {self.target})"


def _module_files() -> Dict[str, Path]:
    """Module name -> file for every .py under nemo_longctx/ (symlinks followed: ``conf`` links to ../conf)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(PKG_DIR, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = Path(dirpath) / fn
            parts = [PKG, *path.relative_to(PKG_DIR).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _module_files()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _bound_at_top(path: Path) -> Set[str]:
    """Names a module binds at its top level (what ``from pkg import name`` finds on the package first)."""
    names: Set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


INIT_NAMES = {name: _bound_at_top(MODULES[name]) for name in PACKAGES}


def _resolve_relative(src: str, level: int, module: Optional[str]) -> str:
    base = src.split(".") if src in PACKAGES else src.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _own(name: str) -> bool:
    return name == PKG or name.startswith(PKG + ".")


def _imports_of(src: str, path: Path) -> List[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(ROOT))
    out: List[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    out.append(Import(src, alias.name, rel, child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                base = _resolve_relative(src, child.level, child.module) if child.level else child.module
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    # ``from pkg import name``: pkg's __init__ when it binds the name (e.g. a re-export), else the
                    # submodule pkg.name when that is one of ours
                    binds = alias.name in INIT_NAMES.get(base, ())
                    target = sub if (_own(base) and sub in MODULES and not binds) else base
                    out.append(Import(src, target, rel, child.lineno, in_function))
            elif (isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str) and _is_import_module(child.func)):
                out.append(Import(src, child.args[0].value, rel, child.lineno, in_function))
            visit(child, lazy)

    visit(tree, False)
    return out


def _is_import_module(func: ast.AST) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" and isinstance(func.value, ast.Name) and func.value.id == "importlib"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


IMPORTS: List[Import] = sorted({imp for name, path in MODULES.items() for imp in _imports_of(name, path)},
                              key=lambda i: (i.file, i.line, i.target))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _matches(target: str, names: Tuple[str, ...]) -> Optional[str]:
    return next((n for n in names if _under(target, n)), None)


def _layer(module: str) -> Optional[str]:
    if module in LEAVES:
        return "leaf"
    rest = module[len(PKG) + 1:]
    if any(_under(rest, a) for a in APPS):
        return "apps"
    if any(_under(rest, f) for f in FRONT_ENDS):
        return "front end"
    for layer in ("integrations.megatron", "memory", "attention", "planner", "shared"):
        if _under(rest, layer):
            return layer
    return None


def _report(title: str, bad: List[Import]) -> str:
    return f"{title} ({len(bad)}):\n  " + "\n  ".join(i.where() for i in sorted(bad, key=lambda i: (i.file, i.line)))


def _from(*layers: str) -> List[Import]:
    return [i for i in IMPORTS if _layer(i.src) in layers]


def _third_party(i: Import) -> bool:
    return not _own(i.target)


def _top(name: str) -> str:
    return name.split(".")[0]


def _own_edges() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = defaultdict(set)
    for i in IMPORTS:
        if _own(i.target) and i.target in MODULES and i.target != i.src:
            edges[i.src].add(i.target)
    return edges


def _chain(start: str, goal, edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A shortest import chain start -> ... -> a module for which ``goal`` holds (breadth first), or None."""
    parent: Dict[str, Optional[str]] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v != start and goal(v):
            path = [v]
            while parent[path[-1]] is not None:
                path.append(parent[path[-1]])
            return path[::-1]
        for w in sorted(edges.get(v, ())):
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return None


@dataclass(frozen=True)
class PrivateUse:
    src: str
    owner: str  # the module whose private name is used
    name: str
    file: str
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.src} uses {self.owner}.{self.name})"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _private_uses(src: str, path: Path) -> List[PrivateUse]:
    """``from m import _x`` of another module ``m`` of the package, and ``m._x`` on a name bound to one (``import
    nemo_longctx.a.m as m``, ``from nemo_longctx.a import m``, ``import nemo_longctx.a.m``) -- anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(ROOT))
    out: List[PrivateUse] = []
    bound: Dict[str, str] = {}  # local name -> module of the package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _own(a.name):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else PKG
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(src, node.level, node.module) if node.level else node.module
            if not _own(base or ""):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES and a.name not in INIT_NAMES.get(base, ()):
                    bound[a.asname or a.name] = sub
                elif _private(a.name) and base != src:
                    out.append(PrivateUse(src, base, a.name, rel, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node.value)
            if dotted is None or dotted.split(".")[0] not in bound:
                continue
            head, *rest = dotted.split(".")
            owner = ".".join([bound[head], *rest])
            if owner in MODULES and owner != src:
                out.append(PrivateUse(src, owner, node.attr, rel, node.lineno))
    return out


PRIVATE_USES: List[PrivateUse] = sorted({u for name, path in MODULES.items() for u in _private_uses(name, path)},
                                        key=lambda u: (u.file, u.line, u.name))


# ---------------------------------------------------------------------------------------------------------------------
def test_the_walk_sees_the_package():
    for name in (f"{PKG}.apps.train", f"{PKG}.integrations.megatron.cpu_compat", f"{PKG}.attention.ring",
                 f"{PKG}.planner.search", f"{PKG}.shared.launch", f"{PKG}.integrations.nemo.strategy"):
        assert name in MODULES, name
    assert len(IMPORTS) > 200
    # relative imports resolved: attention/ring.py's ``from .input_checks import ...``
    assert any(i.src == f"{PKG}.attention.ring" and i.target == f"{PKG}.attention.input_checks" for i in IMPORTS)
    # ``from pkg import module`` seen as the module: apps/train.py's ``from nemo_longctx.shared import console``
    assert any(i.src == f"{PKG}.apps.train" and i.target == f"{PKG}.shared.console" for i in IMPORTS)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if _layer(m) is None)
    assert not unplaced, f"modules in no layer (give them one here, in the docstring's table): {unplaced}"


def test_package_root_holds_only_init_main_and_options():
    """Rule 5: modules live in the subpackage of their role (apps, shared, planner, integrations, memory, attention,
    selftest); the root keeps the package's ``__init__``, ``python -m nemo_longctx`` and the option model (a leaf
    every layer imports)."""
    found = sorted(p.name for p in PKG_DIR.glob("*.py"))
    extra = sorted(set(found) - set(ROOT_FILES))
    assert not extra, (f"nemo_longctx/ holds {extra} besides {list(ROOT_FILES)}: move each into the subpackage of "
                       "its role (apps/, shared/, planner/, integrations/...)")
    assert set(ROOT_FILES) <= set(found), found


def test_nemo_wing_modules_import_nemo_or_lightning():
    """Rule 1: integrations/nemo/ holds what needs NeMo: every module there imports nemo or lightning (module level or
    lazily), itself or through another module of the wing that does; one that does not belongs in shared/ (or is
    named, with its reason, in NEMO_WING_WITHOUT_NEMO)."""
    wing = sorted(m for m in MODULES if _under(m, NEMO_WING))
    direct = {i.src for i in IMPORTS if i.src in wing and _third_party(i) and _matches(i.target, NEMO_FRAMEWORKS)}
    edges = {m: {t for t in targets if t in wing} for m, targets in _own_edges().items() if m in wing}
    reaching = {m for m in wing if m in direct or _chain(m, lambda v: v in direct, edges)}
    bad = [m for m in wing if m not in reaching and m not in NEMO_WING_WITHOUT_NEMO]
    lines = []
    for m in bad:
        imps = sorted({i.target for i in IMPORTS if i.src == m and _top(i.target) not in STDLIB})
        lines.append(f"{MODULES[m].relative_to(ROOT)} ({m}) imports no NeMo/Lightning; its non-stdlib imports: {imps}")
    assert not bad, ("modules of integrations/nemo/ that import neither nemo nor lightning (itself or through the "
                     "wing) -- move them to shared/ or name them in NEMO_WING_WITHOUT_NEMO with the reason:\n  "
                     + "\n  ".join(lines))
    stale = sorted(m for m in NEMO_WING_WITHOUT_NEMO if m not in MODULES or m in reaching)
    assert not stale, f"NEMO_WING_WITHOUT_NEMO names modules that are gone or import NeMo/Lightning now: {stale}"


def test_bridge_side_never_reaches_the_nemo_wing():
    """Rule 2: the Bridge app (apps/bridge.py, apps/bridge_convert.py) and integrations/bridge/ import nothing of
    integrations.nemo -- directly or through any chain of the package's modules (module level or lazily)."""
    edges = _own_edges()
    direct = [i for i in IMPORTS if _matches(i.src, BRIDGE_SIDE) and _under(i.target, NEMO_WING)]
    assert not direct, _report("the Bridge side imports the NeMo wing (integrations.nemo)", direct)
    chains = []
    for m in sorted(m for m in MODULES if _matches(m, BRIDGE_SIDE)):
        chain = _chain(m, lambda v: _under(v, NEMO_WING), edges)
        if chain:
            chains.append(" -> ".join(chain))
    assert not chains, ("the Bridge side reaches the NeMo wing through other modules (import chains):\n  "
                        + "\n  ".join(chains))


def test_shared_imports_only_the_standard_library_torch_hydra_options_and_shared():
    """Rule 3: shared/ (imported by both front ends) imports the standard library, torch, Hydra/OmegaConf,
    nemo_longctx.options and other shared modules only -- never nemo, lightning, megatron(.bridge), nemo_run,
    transformers, nor another layer of the package."""
    bad = [i for i in _from("shared")
           if not (_under(i.target, f"{PKG}.shared") or _matches(i.target, SHARED_OWN)
                   if _own(i.target) else _top(i.target) in STDLIB or _matches(i.target, SHARED_THIRD_PARTY))]
    assert not bad, _report("nemo_longctx/shared/ imports beyond the standard library, torch, Hydra/OmegaConf, "
                            "nemo_longctx.options and shared/", bad)


def test_planner_is_plain_python():
    """planner/: the standard library, nemo_longctx.options and nemo_longctx.shared.signals (PLANNER_OWN) only -- no
    torch (``nemo-longctx plan`` and the NeMo-Run plugin plan without it)."""
    bad = [i for i in _from("planner")
           if not (_under(i.target, f"{PKG}.planner") or _matches(i.target, PLANNER_OWN)
                   if _own(i.target) else _top(i.target) in STDLIB)]
    assert not bad, _report("nemo_longctx/planner/ imports beyond the standard library and " + ", ".join(PLANNER_OWN),
                            bad)


def test_no_module_uses_a_private_name_of_another():
    """Rule 4: a helper one module takes from another is public (no leading underscore): ``from m import _x`` and
    ``m._x`` on an imported module of the package are refused, except in the compat modules (COMPAT). Names of
    third-party libraries are not checked here."""
    bad = [u for u in PRIVATE_USES if u.src not in COMPAT]
    assert not bad, (f"private names used across modules ({len(bad)}; make the helper public at its definition and "
                     "every use):\n  " + "\n  ".join(u.where() for u in bad))


def test_the_private_name_check_sees_both_forms(tmp_path):
    """The scan itself: ``from m import _x`` and ``m._x`` (through ``from pkg import m``) are both found."""
    global ROOT
    pkg_dir = tmp_path / PKG / "shared"
    pkg_dir.mkdir(parents=True)
    (pkg_dir / "probe.py").write_text("from nemo_longctx.shared.launch import _first_line\n"
                                      "from nemo_longctx.shared import console\n"
                                      "x = console._quiet\n")
    saved = ROOT
    ROOT = tmp_path
    try:
        uses = _private_uses(f"{PKG}.shared.probe", pkg_dir / "probe.py")
    finally:
        ROOT = saved
    assert {(u.owner, u.name) for u in uses} == {(f"{PKG}.shared.launch", "_first_line"),
                                                 (f"{PKG}.shared.console", "_quiet")}, uses


def test_megatron_integration_is_framework_neutral():
    bad = [i for i in _from("integrations.megatron") if _matches(i.target, NOT_IN_NEUTRAL)]
    assert not bad, _report("integrations/megatron imports " + "/".join(NOT_IN_NEUTRAL), bad)


def test_megatron_integration_imports_no_front_end_and_no_app():
    bad = [i for i in _from("integrations.megatron") if _own(i.target) and _layer(i.target) in ("front end", "apps")]
    assert not bad, _report("integrations/megatron imports a front end (integrations.nemo/bridge) or an app", bad)


def test_attention_and_memory_import_no_framework():
    bad = [i for i in _from("memory", "attention") if _matches(i.target, NOT_IN_PLAIN_TORCH)
           and not (i.function_level and (i.src, i.target) in LAZY_OPTIONAL_KERNELS)]
    assert not bad, _report("attention/memory import a framework (or an optional kernel not lazily / not listed in "
                            "LAZY_OPTIONAL_KERNELS)", bad)


def test_attention_and_memory_import_torch_only():
    bad = [i for i in _from("memory", "attention") if not _own(i.target)
           and _top(i.target) not in STDLIB and not _matches(i.target, PLAIN_TORCH_THIRD_PARTY)
           and not (i.function_level and (i.src, i.target) in LAZY_OPTIONAL_KERNELS)]
    assert not bad, _report("attention/memory import third-party packages other than torch", bad)


def test_overrides_module_imports_hydra_only():
    allowed = STDLIB | {"hydra", "omegaconf"}
    bad = [i for i in IMPORTS if i.src == f"{PKG}.shared.overrides" and _top(i.target) not in allowed]
    assert not bad, _report("nemo_longctx/shared/overrides.py imports beyond the standard library, Hydra and "
                            "OmegaConf", bad)


def test_attention_and_memory_import_no_integration_and_no_app():
    bad = [i for i in _from("memory", "attention") if _own(i.target)
           and (_under(i.target, f"{PKG}.integrations") or _layer(i.target) == "apps")]
    assert not bad, _report("attention/memory import nemo_longctx.integrations or an app", bad)


STDLIB_ONLY = ("options", "shared.console", "shared.signals", "shared.reaper", "shared.process_exit",
               "shared.path_checks", "shared.versions", "shared.converter_args")


@pytest.mark.parametrize("leaf", STDLIB_ONLY)
def test_options_module_is_standard_library_only(leaf):
    name = f"{PKG}.{leaf}"
    assert name in MODULES, f"nemo_longctx/{leaf.replace('.', '/')}.py does not exist"
    plain = {f"{PKG}.{m}" for m in STDLIB_ONLY}
    bad = [i for i in IMPORTS if i.src == name and _top(i.target) not in STDLIB and i.target not in plain]
    assert not bad, _report(f"nemo_longctx/{leaf.replace('.', '/')}.py imports beyond the standard library", bad)


def test_no_upward_imports():
    bad = []
    for i in IMPORTS:
        if not _own(i.target) or i.target in LEAVES:
            continue
        src, dst = _layer(i.src), _layer(i.target)
        if src in RANKS and dst in RANKS and RANKS[dst] > RANKS[src]:
            bad.append(i)
    assert not bad, _report("imports pointing up the layers (apps > integrations.nemo/bridge > integrations.megatron "
                            "> memory > attention > planner > shared)", bad)


def test_own_imports_name_existing_modules():
    """An internal import naming no module of the package (stale after a rename) would escape every check above."""
    bad = [i for i in IMPORTS if _own(i.target) and i.target not in MODULES]
    assert not bad, _report("imports of nemo_longctx modules that do not exist", bad)


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (or a module importing itself), Tarjan."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _one_cycle(start: str, edges: Dict[str, Set[str]], members: Set[str]) -> List[str]:
    """A shortest path start -> ... -> start inside one strongly connected component (breadth first)."""
    parent: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w not in members or w in parent:
                    continue
                parent[w] = v
                if w == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(parent[path[-1]])
                    return path[::-1]
                nxt.append(w)
        frontier = nxt
    return [start]


def test_no_import_cycles():
    edges: Dict[str, Set[str]] = defaultdict(set)
    where: Dict[Tuple[str, str], List[Import]] = defaultdict(list)
    for i in IMPORTS:
        if _own(i.target) and i.target in MODULES:
            edges[i.src].add(i.target)
            where[(i.src, i.target)].append(i)
    cycles = _cycles(edges)
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append(f"cycle among {comp}, e.g. {' -> '.join(_one_cycle(comp[0], edges, members))}:")
        for (a, b), imps in sorted(where.items()):
            if a in members and b in members:
                lines.extend(f"    {i.where()}" for i in imps)
    assert not cycles, f"import cycles between nemo_longctx modules ({len(cycles)}):\n  " + "\n  ".join(lines)


def test_checkpoint_integrity_imports_only_the_standard_library_and_torch_lazily():
    name = f"{PKG}.shared.checkpoint_integrity"
    bad = [i for i in IMPORTS if i.src == name and _top(i.target) not in STDLIB
           and not (i.target.startswith("torch.distributed.checkpoint") and i.function_level)]
    assert not bad, _report("nemo_longctx/shared/checkpoint_integrity.py imports beyond the standard library and "
                            "torch's distributed-checkpoint reader (inside a function)", bad)


# ---------------------------------------------------------------------------------------------- rebinding (rule 6)
# Models are built with our classes (layer/block/norm specs, our GPT model class), never re-classed or given
# per-instance methods; what must rebind a third-party name is a row of a patch ledger (integrations/*/patches.py),
# made by a function in one of these modules (tests/test_patch_ledgers.py checks each row names one of them).
PATCHING = COMPAT | {
    f"{PKG}.integrations.megatron.offload_block",  # ledger row R1: route_block_recompute (all devices)
}
# the self-test's own instruments, in its worker processes / for one measurement, never in a training run
SELFTEST_INSTRUMENTS = {
    f"{PKG}.selftest.cp_checks": "gloo on CUDA tensors in the CP check's worker processes: its collectives staged "
                                 "through host memory (install_cpu_staging)",
    f"{PKG}.selftest.offload_checks": "counts the CUDA synchronizations of one timed offload step, restored after it",
}
_METHOD_NAMES = ("forward", "__init__", "__new__", "__post_init__", "__call__", "__getattr__")


@dataclass(frozen=True)
class Rebinding:
    file: str
    line: int
    what: str

    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.what})"


def _third_party_names(tree: ast.AST, src: str) -> Set[str]:
    """Names bound anywhere in the module by importing a third-party module or name (the standard library's process
    state -- ``sys.argv``, ``sys.stdout`` -- is not a library's code)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not _own(a.name) and _top(a.name) not in STDLIB:
                    names.add((a.asname or a.name).split(".")[0])
        elif (isinstance(node, ast.ImportFrom) and not node.level and not _own(node.module or "")
              and _top(node.module or "") not in STDLIB):
            names.update(a.asname or a.name for a in node.names)
    return names


def _base_name(node: ast.AST) -> Optional[str]:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _rebindings(src: str, path: Path) -> List[Rebinding]:
    """``x.__class__ = ...``, ``x.forward = ...`` (and the other method names), and an attribute of an imported
    third-party module or class assigned (``mod.name = ...``, ``setattr(mod, ...)``, ``del mod.name``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(ROOT))
    imported = _third_party_names(tree, src)
    out: List[Rebinding] = []

    def check(target: ast.AST, line: int, how: str) -> None:
        if not isinstance(target, ast.Attribute):
            return
        if target.attr == "__class__" or target.attr in _METHOD_NAMES:
            out.append(Rebinding(rel, line, f"{how} .{target.attr}"))
        elif _base_name(target) in imported:
            out.append(Rebinding(rel, line, f"{how} {ast.unparse(target)}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                for sub in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    check(sub, node.lineno, "assigns")
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check(node.target, node.lineno, "assigns")
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                check(t, node.lineno, "deletes")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args):
            first = node.args[0]
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if _base_name(first) in imported and isinstance(first, (ast.Name, ast.Attribute)):
                out.append(Rebinding(rel, node.lineno, f"{node.func.id}({ast.unparse(first)}, ...)"))
            elif name == "__class__" or name in _METHOD_NAMES:
                out.append(Rebinding(rel, node.lineno, f"{node.func.id}(..., {name!r})"))
    return out


def test_only_the_ledger_modules_rebind_third_party_names_and_nothing_is_reclassed():
    bad = [r for name, path in MODULES.items() if name not in PATCHING | set(SELFTEST_INSTRUMENTS)
           for r in _rebindings(name, path)]
    assert not bad, ("a class change, a per-instance method or a third-party name rebound outside the patch ledgers' "
                     f"modules ({len(bad)}): build with a spec / our classes, or declare a ledger row:\n  "
                     + "\n  ".join(r.where() for r in bad))


def test_the_rebinding_check_sees_every_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from megatron.core.transformer import transformer_block\nimport torch\n"
                     "def f(m, block):\n"
                     "    block.__class__ = object\n"
                     "    m.forward = print\n"
                     "    transformer_block.checkpointed_forward = None\n"
                     "    torch.cuda.Stream = None\n"
                     "    setattr(torch.cuda, 'Event', None)\n"
                     "    del m.forward\n"
                     "    m.weight = None\n")  # (an attribute of our own object: allowed)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = _rebindings(f"{PKG}.shared.probe", probe)
    finally:
        ROOT = saved
    assert sorted(r.line for r in found) == [4, 5, 6, 7, 8, 9], found


# ---------------------------------------------------------------------------------------------- the one reader
# A composed Hydra config (a DictConfig) is read in one place: the run spec's reader. Below it every front end, the
# planner and the dry run take the spec (``RunSpec`` / ``PlanSpec``); only the model group's node travels on, unread,
# to Hydra's ``instantiate``.
READER = f"{PKG}.shared.run_spec"
COMPOSER = {f"{PKG}.shared.overrides": "composes the config (Hydra's compose API) and, from the model group's choice "
                                       "that only the composition knows, sets the demo's recipe"}
OPTION_GROUPS = ("trainer", "checkpoint", "launcher", "run", "log", "data", "init_from", "model", "cp", "recompute",
                 "offload", "tiling", "optim", "memory", "recipe", "output_dir", "seed", "plan")
_CONFIG_LIBRARIES = ("omegaconf", "hydra")


def _config_names(tree: ast.AST) -> Set[str]:
    """The names that hold a composed config: ``cfg`` and every name annotated ``DictConfig``."""
    names = {"cfg"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and "DictConfig" in ast.unparse(node.annotation):
            names.add(node.arg)
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and "DictConfig" in ast.unparse(node.annotation)):
            names.add(node.target.id)
    return names


def _group_of(node: ast.AST) -> Optional[str]:
    """The option group a string constant names (``"trainer.devices"`` -> ``trainer``), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        head = node.value.split(".", 1)[0]
        return head if head in OPTION_GROUPS else None
    return None


def _group_reads(src: str, path: Path) -> List[Rebinding]:
    """Reads of an option group of a composed config in a module that imports OmegaConf or Hydra: ``cfg.trainer``,
    ``cfg.get("data")``, ``cfg["optim"]``, ``OmegaConf.select(cfg, "run.x")`` (``cfg``: ``_config_names``)."""
    if not any(i.src == src and _top(i.target) in _CONFIG_LIBRARIES for i in IMPORTS):
        return []
    tree = ast.parse(path.read_text(), filename=str(path))
    rel, names = str(path.relative_to(ROOT)), _config_names(tree)
    out = []

    def is_config(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in names

    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and is_config(node.value) and node.attr in OPTION_GROUPS:
            what = ast.unparse(node)
        elif isinstance(node, ast.Subscript) and is_config(node.value) and _group_of(node.slice):
            what = ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if f.attr == "get" and is_config(f.value) and _group_of(node.args[0]):
                what = ast.unparse(node)
            elif (f.attr == "select" and isinstance(f.value, ast.Name) and f.value.id == "OmegaConf"
                  and len(node.args) > 1 and _group_of(node.args[1])):
                what = ast.unparse(node)
        if what is not None:
            out.append(Rebinding(rel, node.lineno, f"reads {what}"))
    return out


def test_only_the_reader_reads_the_option_groups_of_a_composed_config():
    assert READER in MODULES, "nemo_longctx/shared/run_spec.py (the reader) does not exist"
    bad = [r for name, path in MODULES.items() if name != READER and name not in COMPOSER
           for r in _group_reads(name, path)]
    assert not bad, ("option groups of a composed config read outside the run spec's reader "
                     f"(read_run_spec / read_plan_spec in {READER}) ({len(bad)}): take the spec instead:\n  "
                     + "\n  ".join(r.where() for r in bad))


def test_the_reader_check_sees_every_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from omegaconf import DictConfig, OmegaConf\n"
                     "def f(cfg, conf: DictConfig, spec):\n"
                     "    a = cfg.trainer.devices\n"
                     "    b = cfg.get('data')\n"
                     "    c = conf['optim']\n"
                     "    d = OmegaConf.select(cfg, 'run.dry_run')\n"
                     "    e = spec.trainer.devices\n"  # (the spec: allowed)
                     "    g = cfg.hydra\n")  # (not an option group)
    global ROOT, IMPORTS
    saved = ROOT, IMPORTS
    ROOT = tmp_path
    IMPORTS = IMPORTS + [Import(f"{PKG}.shared.probe", "omegaconf", "probe.py", 1, False)]
    try:
        found = _group_reads(f"{PKG}.shared.probe", probe)
    finally:
        ROOT, IMPORTS = saved
    assert sorted(r.line for r in found) == [3, 4, 5, 6], found
