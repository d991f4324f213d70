"""The layers of docs/architecture.md, enforced on the source with :mod:`ast` (no dependency).

Every module of ``kairos/`` and ``tools/`` is parsed; every ``import`` and ``from ... import`` in it —
at module level, in functions, under ``if TYPE_CHECKING:`` — is resolved to a dotted name and
checked against :data:`RULES`:

* ``kairos.contracts`` and ``kairos.core`` (pure: messages, policy, engine model) import nothing
  from ``kairos.runtime``/``services``/``engines``/``sim``/``cli``, nor ``tools``, ``nats``, ``aiohttp``;
* ``kairos.runtime`` (the I/O helpers every service shares) imports no service, engine, sim or CLI;
* ``kairos.services`` import no CLI, simulator or tooling;
* ``kairos.engines`` (the backends) import no service, simulator or CLI;
* ``kairos.sim`` imports only the pure layers (no runtime, services, engines, CLI, tools, network);
* ``kairos.plan`` (``kairos plan``) imports the simulator and the pure layers only (its ``--from-live``
  asks an ingress over HTTP with the standard library, never the bus);
* ``kairos.engines.vllm.plugin`` runs inside vLLM: it imports nothing of ``kairos`` outside itself
  and no ``nats``/``aiohttp``; the packages its import runs first (``kairos``, ``kairos.engines``,
  ``kairos.engines.vllm``) import nothing at module level but the plugin and the standard library;
* nothing in ``kairos`` imports ``tools`` (not installed);
* the services' pure state machines (the ingress's request lifecycle, the node agent's request)
  import no ``nats``/``aiohttp``/``kairos.runtime``.

Then the module import graph of ``kairos`` and ``tools`` (function-level imports included, a
``from pkg import name`` an edge to ``pkg``'s ``__init__`` unless ``name`` is a submodule) must have
no cycle (strongly connected components, Tarjan), and no Python file of :data:`SIZE_TREES` (the
product, its tests, benchmarks, tools and ops scripts; none inside a ``.venv``) may exceed
:data:`MAX_MODULE_LINES` lines nor a class :data:`MAX_CLASS_LINES` (``end_lineno - lineno + 1``):
issue 18's size targets. Each checker is proven to fail on a small synthetic tree.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the trees whose imports are checked against the layers and for cycles (relative to the root)
TREES = ("kairos", "tools")
#: the trees whose Python files the size targets cover (relative to the root)
SIZE_TREES = ("kairos", "tools", "tests", "bench", "ops")
#: a folder of this name is a virtualenv, not ours: the size walk skips it
VENV = ".venv"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300

NETWORK = ("nats", "aiohttp")
#: a ``forbidden`` entry matching every name
ANY = "*"
PLUGIN = "kairos.engines.vllm.plugin"
#: the packages Python executes before the plugin's own modules when vLLM imports it
PLUGIN_PARENTS = ("kairos", "kairos.engines", "kairos.engines.vllm")
#: modules outside the plugin that run in the vLLM virtualenv (tests/vllm/inproc, ``python -m
#: kairos.engines.vllm.tiny_model`` under the vLLM python), which has vLLM's dependencies and not ours
VLLM_VENV_MODULES = ("kairos.engines.vllm.subscriber", "kairos.engines.vllm.tiny_model")
VLLM_VENV_PACKAGES = ("msgspec", "zmq", "torch", "transformers", "tokenizers")
#: the services' pure state machines (the node agent's one once it exists)
STATE_MACHINES = ("kairos.services.ingress.lifecycle", "kairos.services.node_agent.request")


@dataclass(frozen=True)
class Rule:
    """Modules named by ``applies`` (a dotted prefix, or exact names with ``exact``) may not import a
    name under any of ``forbidden`` (dotted prefixes) unless it is under one of ``allowed``."""

    name: str
    applies: tuple[str, ...]
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    exact: bool = False
    #: only module-level imports count (imports inside functions run later, lazily)
    top_level_only: bool = False

    def covers(self, module: str) -> bool:
        return module in self.applies if self.exact else any(under(module, p) for p in self.applies)

    def forbids(self, target: str) -> bool:
        return (any(p == ANY or under(target, p) for p in self.forbidden)
                and not any(under(target, p) for p in self.allowed))


RULES = (
    Rule("pure core and contracts: no I/O layers, no network, no tools",
         ("kairos.contracts", "kairos.core"),
         ("kairos.runtime", "kairos.services", "kairos.engines", "kairos.sim", "kairos.cli", "tools", *NETWORK)),
    Rule("runtime: no services, engines, simulator or CLI",
         ("kairos.runtime",), ("kairos.services", "kairos.engines", "kairos.sim", "kairos.cli")),
    Rule("services: no CLI, simulator or tools", ("kairos.services",), ("kairos.cli", "kairos.sim", "tools")),
    Rule("engine backends: no services, simulator or CLI (the node agent drives a backend)",
         ("kairos.engines",), ("kairos.services", "kairos.sim", "kairos.cli")),
    Rule("simulator: pure layers only (no runtime, services, engines, CLI, tools, network)",
         ("kairos.sim",), ("kairos.runtime", "kairos.services", "kairos.engines", "kairos.cli", "tools", *NETWORK)),
    Rule("planner: the simulator and the pure layers (no runtime, services, engines, CLI, tools, NATS/aiohttp)",
         ("kairos.plan",), ("kairos.runtime", "kairos.services", "kairos.engines", "kairos.cli", "tools", *NETWORK)),
    Rule("vLLM plugin (runs inside vLLM): nothing of kairos outside itself, no network",
         (PLUGIN,), ("kairos", *NETWORK), allowed=(PLUGIN,)),
    Rule("packages above the vLLM plugin: only the plugin and the standard library at module level",
         PLUGIN_PARENTS, (ANY,), allowed=(PLUGIN, *sorted(sys.stdlib_module_names)), exact=True, top_level_only=True),
    Rule("modules the vLLM virtualenv imports: the plugin, vLLM's dependencies and the standard library only",
         VLLM_VENV_MODULES, (ANY,), allowed=(PLUGIN, *VLLM_VENV_PACKAGES, *sorted(sys.stdlib_module_names)), exact=True),
    Rule("kairos never imports tools (not installed)", ("kairos",), ("tools",)),
    Rule("pure state machines: no network, no runtime", STATE_MACHINES, (*NETWORK, "kairos.runtime"), exact=True),
)


def rule(prefix: str) -> Rule:
    """The rule whose name starts with ``prefix``."""
    return next(r for r in RULES if r.name.startswith(prefix))


def under(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` or inside it (``kairos.core.x`` is under ``kairos.core``, ``kairos.corex`` not)."""
    return name == prefix or name.startswith(prefix + ".")


# ---------------------------------------------------------------- reading the tree

@dataclass(frozen=True)
class Import:
    """One imported name: the module doing it (``source``, its file and line), the dotted ``target``,
    whether it sits at module level and whether only for type checking."""

    source: str
    path: Path
    line: int
    target: str
    top_level: bool
    type_only: bool


def modules(root: Path, trees: tuple[str, ...] = TREES) -> dict[str, Path]:
    """Dotted module name → file for every ``.py`` under ``root/<tree>`` (``pkg/__init__.py`` → ``pkg``)."""
    out = {}
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def python_files(root: Path, trees: tuple[str, ...] = SIZE_TREES) -> list[Path]:
    """Every ``.py`` file under ``root/<tree>`` for each tree, sorted, none under a :data:`VENV` folder."""
    return [path for tree in trees for path in sorted((root / tree).rglob("*.py"))
            if VENV not in path.relative_to(root).parts]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str] | dict[str, Path]) -> list[Import]:
    """Every import in module ``name`` (file ``path``), relative ones resolved; a ``from X import Y``
    yields ``X.Y`` when that is a module in ``known``, else ``X``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, top: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend(Import(name, path, child.lineno, a.name, top, type_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)] if child.level > 1 else base
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for a in child.names:
                    sub = f"{mod}.{a.name}"
                    out.append(Import(name, path, child.lineno, sub if sub in known else mod, top, type_only))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), top, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), top, type_only)
            else:
                visit(child, top, type_only)

    visit(tree, True, False)
    return out


def all_imports(root: Path, trees: tuple[str, ...] = TREES) -> list[Import]:
    mods = modules(root, trees)
    return [imp for name, path in mods.items() for imp in imports(name, path, mods)]


# ---------------------------------------------------------------- the checks

def layer_violations(root: Path = ROOT, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """``file:line: rule: source imports target`` for every import against a rule."""
    out = []
    for imp in all_imports(root):
        for rule in rules:
            if rule.covers(imp.source) and rule.forbids(imp.target) and (imp.top_level or not rule.top_level_only):
                out.append(f"{imp.path.relative_to(root)}:{imp.line}: {rule.name}: "
                           f"{imp.source} imports {imp.target}")
    return out


def import_graph(root: Path = ROOT) -> dict[str, dict[str, tuple[Path, int]]]:
    """Module → {imported module of the tree: (file, line) of the first such import}; imports under
    ``if TYPE_CHECKING:`` are left out (they never run)."""
    mods = modules(root)
    graph: dict[str, dict[str, tuple[Path, int]]] = {m: {} for m in mods}
    for imp in all_imports(root):
        if imp.target in mods and imp.target != imp.source and not imp.type_only:
            graph[imp.source].setdefault(imp.target, (imp.path, imp.line))
    return graph


def strongly_connected(graph: dict[str, dict[str, object]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (or a self-loop), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == node:
                            break
                    if len(comp) > 1 or node in graph[node]:
                        out.append(sorted(comp))
    return out


def import_cycles(root: Path = ROOT) -> list[str]:
    """One line per import cycle: its modules, and each edge inside it with its file and line."""
    graph = import_graph(root)
    out = []
    for comp in strongly_connected(graph):
        edges = [f"{path.relative_to(root)}:{line}: {a} -> {b}"
                 for a in comp for b, (path, line) in graph[a].items() if b in comp]
        out.append(f"import cycle between {', '.join(comp)}: " + "; ".join(edges))
    return out


def oversized(root: Path = ROOT, max_module: int = MAX_MODULE_LINES, max_class: int = MAX_CLASS_LINES,
              trees: tuple[str, ...] = SIZE_TREES) -> list[str]:
    """``file: N lines`` for every module of :func:`python_files` over ``max_module`` lines,
    ``file:line: class C: N lines`` for every class over ``max_class``."""
    out = []
    for path in python_files(root, trees):
        text = path.read_text()
        rel = path.relative_to(root)
        n = len(text.splitlines())
        if n > max_module:
            out.append(f"{rel}: module of {n} lines (limit {max_module})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > max_class:
                    out.append(f"{rel}:{node.lineno}: class {node.name} of {size} lines (limit {max_class})")
    return out


# ---------------------------------------------------------------- the real tree

def test_no_import_against_the_layers():
    violations = layer_violations()
    assert not violations, "imports against the layers (docs/architecture.md):\n" + "\n".join(violations)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "\n".join(cycles)


def test_no_module_over_500_lines_and_no_class_over_300():
    big = oversized()
    assert not big, "over issue 18's size targets:\n" + "\n".join(big)


def test_the_checker_sees_the_real_tree():
    """The walk finds the layers and their imports (a checker reading nothing would pass vacuously)."""
    mods = modules(ROOT)
    for layer in ("kairos.contracts.wire", "kairos.core.policy", "kairos.runtime.bus", "tools.docgen.docgen",
                  PLUGIN + ".scheduler"):
        assert layer in mods
    targets = {(i.source, i.target) for i in all_imports(ROOT)}
    assert ("kairos.runtime.bus", "nats") in targets
    assert any(s.startswith(PLUGIN) and t == "vllm" for s, t in targets)
    sized = {str(p.relative_to(ROOT)) for p in python_files(ROOT)}  # the size walk reads every tree, too
    for path in ("kairos/core/policy/kairos.py", "tools/docgen/docgen.py", "tests/unit/test_layering.py",
                 "bench/mutation.py", "ops/docker/healthcheck.py"):
        assert path in sized


# ---------------------------------------------------------------- every rule can fail

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for tree in TREES:  # every folder a package, as in the repo
        (tmp_path / tree).mkdir(exist_ok=True)
        for d in [tmp_path / tree, *(p for p in (tmp_path / tree).rglob("*") if p.is_dir())]:
            (d / "__init__.py").touch()
    return tmp_path


#: one breach per row: the rule's name (its start) | the module's file | its text (``;`` between
#: lines, ``>`` an indent) | the import the violation must name
BREACH_TABLE = """
pure core       | kairos/core/policy/bad.py              | import nats                                    | nats
pure core       | kairos/contracts/bad.py                | def f():;>from kairos.runtime import bus       | kairos.runtime.bus
pure core       | kairos/core/bad.py                     | from ..services.ingress import app             | kairos.services.ingress.app
pure core       | kairos/core/bad.py                     | from typing import TYPE_CHECKING;if TYPE_CHECKING:;>import aiohttp | aiohttp
runtime         | kairos/runtime/bad.py                  | from kairos.engines import vllm                | kairos.engines.vllm
services        | kairos/services/dispatcher/bad.py      | import kairos.cli.main                         | kairos.cli.main
services        | kairos/services/dispatcher/bad.py      | from kairos.sim.simulator import Sim           | kairos.sim.simulator
engine backends | kairos/engines/emulated.py             | from kairos.services.ingress import app        | kairos.services.ingress.app
simulator       | kairos/sim/bad.py                      | from kairos.runtime.bus import connect         | kairos.runtime.bus
simulator       | kairos/sim/bad.py                      | def f():;>from kairos.engines import emulated  | kairos.engines.emulated
planner         | kairos/plan/bad.py                     | from kairos.services.ingress import app        | kairos.services.ingress.app
planner         | kairos/plan/bad.py                     | def f():;>import nats                          | nats
vLLM plugin     | kairos/engines/vllm/plugin/bad.py      | from kairos.core.policy import x               | kairos.core.policy.x
vLLM plugin     | kairos/engines/vllm/plugin/bad.py      | def f():;>import aiohttp.web                   | aiohttp.web
packages above  | kairos/engines/__init__.py             | from kairos.engines.emulated import EmulatedBackend | kairos.engines.emulated
packages above  | kairos/__init__.py                     | import msgspec                                 | msgspec
modules the vLLM | kairos/engines/vllm/subscriber.py     | import structlog                               | structlog
kairos never    | kairos/cli/bad.py                      | def f():;>from tools.docgen import fmt         | tools.docgen.fmt
pure state      | kairos/services/ingress/lifecycle.py   | from kairos.runtime.bus import Bus             | kairos.runtime.bus
pure state      | kairos/services/node_agent/request.py  | import nats.js                                 | nats.js
"""
BREACHES = [(rule(name), rel, code.strip().replace(";", "\n").replace(">", "    ") + "\n", target)
            for name, rel, code, target in (tuple(c.strip() for c in row.split("|"))
                                            for row in BREACH_TABLE.strip().splitlines())]


@pytest.mark.parametrize("rule, rel, text, target", BREACHES, ids=[f"{b[1]}:{b[3]}" for b in BREACHES])
def test_each_rule_fails_on_a_breach_naming_file_line_and_rule(tmp_path, rule, rel, text, target):
    root = _tree(tmp_path, {"kairos/engines/emulated.py": "", "kairos/engines/vllm/plugin/ok.py": "",
                            "kairos/cli/main.py": "", "kairos/runtime/bus.py": "", "kairos/core/policy/x.py": "",
                            "tools/docgen/fmt.py": "", "kairos/services/ingress/app.py": "",
                            "kairos/sim/simulator.py": "", rel: text})
    line = text.splitlines().index(next(x for x in text.splitlines() if "import" in x and "TYPE_CHECKING" not in x)) + 1
    found = layer_violations(root)
    assert any(v.startswith(f"{rel}:{line}: {rule.name}: ") and v.endswith(f" imports {target}") for v in found), found


def test_every_rule_has_a_breach_above():
    assert {r.name for r, *_ in BREACHES} == {r.name for r in RULES}


def test_the_same_imports_where_the_layers_allow_them_pass(tmp_path):
    root = _tree(tmp_path, {
        "kairos/services/dispatcher/ok.py": "import nats\nfrom kairos.runtime import bus\nfrom kairos.core import x\n",
        "kairos/runtime/bus.py": "import nats\nfrom kairos.contracts import wire\n",
        "kairos/engines/vllm/plugin/ok.py": "import vllm, msgspec, zmq\nfrom . import protocol\n",
        "kairos/engines/vllm/plugin/protocol.py": "",
        "kairos/engines/__init__.py": "def backends():\n    from kairos.engines.emulated import EmulatedBackend\n",
        "kairos/engines/emulated.py": "from kairos.core import x\n",
        "kairos/cli/main.py": "from kairos.sim import simulator\nfrom kairos.services.ingress import app\n",
        "kairos/services/ingress/lifecycle.py": "from kairos.contracts import wire\n",
        "tools/docgen/blocks.py": "from kairos.cli import main\nimport kairos.sim.simulator\n",
        "kairos/core/x.py": "", "kairos/contracts/wire.py": "", "kairos/sim/simulator.py": "",
        "kairos/services/ingress/app.py": "",
    })
    assert layer_violations(root) == []
    assert import_cycles(root) == []


def test_a_cycle_through_a_function_level_import_and_a_package_reexport_is_named(tmp_path):
    root = _tree(tmp_path, {
        "kairos/cli/bench.py": "from kairos.cli import demo\n",
        "kairos/cli/demo.py": "def f():\n    from kairos.cli.main import run\n",
        "kairos/cli/main.py": "from kairos.cli.bench import x\n",
        "kairos/core/policy/__init__.py": "from .base import Policy\nfrom .kairos import K\n",
        "kairos/core/policy/base.py": "from kairos.core.policy import helper\n",  # a submodule: no cycle
        "kairos/core/policy/helper.py": "",
        "kairos/core/model.py": "from kairos.core.policy import Policy\n",  # through the re-export ...
        "kairos/core/policy/kairos.py": "import kairos.core.model\n",
        "tools/docgen/docgen.py": "def render():\n    from tools.docgen import blocks\n",
        "tools/docgen/blocks.py": "from tools.docgen.docgen import ROOT\n",
    })
    cycles = import_cycles(root)
    assert len(cycles) == 3, cycles
    cli = next(c for c in cycles if "kairos.cli.bench" in c)
    assert cli.startswith("import cycle between kairos.cli.bench, kairos.cli.demo, kairos.cli.main: ")
    assert "kairos/cli/demo.py:2: kairos.cli.demo -> kairos.cli.main" in cli
    core = next(c for c in cycles if "kairos.core.model" in c)
    assert "kairos.core.policy.base" not in core and "kairos/core/model.py:1: kairos.core.model -> kairos.core.policy" in core
    assert any("tools/docgen/docgen.py:2: tools.docgen.docgen -> tools.docgen.blocks" in c for c in cycles)


def test_type_checking_imports_make_no_cycle(tmp_path):
    root = _tree(tmp_path, {
        "kairos/engines/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kairos.engines.vllm import b\n",
        "kairos/engines/vllm/b.py": "from kairos.engines.base import Base\n",
    })
    assert import_cycles(root) == []


def test_sizes_over_the_targets_are_named(tmp_path):
    cls = "class Big:\n" + "    x = 1\n" * 300 + "\n"
    root = _tree(tmp_path, {"kairos/core/big.py": "\n" * 501, "kairos/core/cls.py": "# c\n" + cls,
                            "tools/ok.py": "class Small:\n" + "    x = 1\n" * 298,
                            "tests/unit/test_big.py": "\n" * 502, "bench/cls.py": cls, "ops/docker/ok.py": "\n" * 500,
                            "tests/.venv/lib/site.py": "\n" * 900, "bench/.venv/big.py": cls,  # virtualenvs: not ours
                            "docs/big.py": "\n" * 900})  # not a tree of SIZE_TREES
    assert sorted(oversized(root)) == ["bench/cls.py:1: class Big of 301 lines (limit 300)",
                                       "kairos/core/big.py: module of 501 lines (limit 500)",
                                       "kairos/core/cls.py:2: class Big of 301 lines (limit 300)",
                                       "tests/unit/test_big.py: module of 502 lines (limit 500)"]


if __name__ == "__main__":  # print every finding on the real tree
    for line in layer_violations() + import_cycles() + oversized():
        print(line)
    sys.exit(0)
