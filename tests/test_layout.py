"""The package layout's rules, read from the source: no import circles, and what may import what.

Every ``import`` statement counts, wherever it is (module level, inside a function, under
``TYPE_CHECKING``): a circle hidden in a function is still a circle a reader must untangle.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every top-level folder pyproject.toml maps to kvpool.<name> (a new package is checked too).
PACKAGES = tuple(sorted(
    folder for name, folder in
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()
    if name.count(".") == 1 and "/" not in folder
))

# What the CLI may import from the manager besides kvpool.manager.core: its public entry points.
# (README "How it fits together" lists the same.)
CLI_ENTRY_POINTS = {
    "kvpool.manager.daemon": {"serve"},
    "kvpool.manager.config": {"ManagerConfig"},
    "kvpool.manager.snapshots": {"CorruptState", "StateIOError", "load_file", "load_namespace",
                                 "restore_namespace", "save_file", "summary"},
    "kvpool.manager.event_client": {"EventTail"},
}


def module_files() -> dict[str, Path]:
    """kvpool module name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["kvpool", *parts])] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(imported project module, imported name or None) for every import statement in ``path``."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, None) if sub in modules else (base, alias.name))
    return [(m, n) for m, n in found if m.startswith("kvpool.")]


def import_graph(parents: bool = True) -> dict[str, set[str]]:
    """module -> project modules it imports (a module also imports the packages above it,
    unless ``parents`` is False: then only the modules its import statements name)."""
    modules = module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _ in imports_of(name, path, modules):
            parts = target.split(".")
            for i in range(2 if parents else len(parts), len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != name and not name.startswith(dep + "."):
                    graph[name].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    color: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if color.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in color and (cycle := visit(dep)):
                return cycle
        color[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in color and (cycle := visit(m)):
            return cycle
    return None


def test_the_cycle_finder_sees_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_has_every_kind_of_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvpool.x import Y\n"
                   "def f():\n    import kvpool.z\n    from . import w\n")
    modules = {"kvpool.pkg.w": src}
    got = imports_of("kvpool.pkg.m", src, modules)
    assert got == [("kvpool.x", "Y"), ("kvpool.z", None), ("kvpool.pkg.w", None)]


def test_no_import_circles_between_project_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_worker_imports_only_the_pool_core_from_the_manager():
    modules = module_files()
    bad = [
        f"{name} imports {target}"
        for name, path in modules.items() if name.startswith("kvpool.worker")
        for target, _ in imports_of(name, path, modules)
        if target.startswith("kvpool.manager") and not target.startswith("kvpool.manager.core")
    ]
    assert bad == [], "the worker may import only kvpool.manager.core from the manager"


def inside_classmethods(tree: ast.AST) -> set[int]:
    """ids of every node inside a classmethod: it may fill the object it builds."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "classmethod" for d in node.decorator_list):
            allowed |= {id(sub) for sub in ast.walk(node)}
    return allowed


def private_writes(tree: ast.AST) -> list[str]:
    """Assignments to another object's ``_private`` attribute (``self``/``cls`` are the owner's
    own; a classmethod of the owning class may fill the object it builds)."""
    allowed = inside_classmethods(tree)
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for target in targets:
            for sub in ast.walk(target):
                if (isinstance(sub, ast.Attribute) and sub.attr.startswith("_") and not sub.attr.startswith("__")
                        and not (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"))
                        and id(sub) not in allowed):
                    found.append(f"line {node.lineno}: {ast.unparse(sub)}")
    return found


def test_the_private_write_finder_sees_a_write_from_outside():
    tree = ast.parse("pool.blocks._dups = {}\nself._x = 1\n"
                     "class A:\n    @classmethod\n    def make(cls):\n        a = cls()\n        a._y = 2\n")
    assert private_writes(tree) == ["line 1: pool.blocks._dups"]


def test_no_module_writes_private_fields_of_another_object():
    bad = [f"{name} {hit}" for name, path in module_files().items()
           for hit in private_writes(ast.parse(path.read_text()))]
    assert bad == [], "state has one owner: add a method to the owning class instead"


def own_fields(tree: ast.AST) -> set[str]:
    """The attribute names a module's own classes define: class-level annotations (dataclass
    fields), ``__slots__`` and what their methods assign on ``self``."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                      for t in node.targets):
                names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                          and isinstance(c.value, str)}
        for node in ast.walk(cls):
            for target in _assigned(node):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    names.add(target.attr)
    return names


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment statement binds (tuple targets unpacked; ``x.a[k] = v`` binds
    an item of ``x.a``, not a field, and is left out)."""
    targets = list(node.targets) if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
    out: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, ast.Tuple | ast.List):
            targets.extend(t.elts)
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
        else:
            out.append(t)
    return out


def public_writes(tree: ast.AST) -> list[str]:
    """Assignments to a public field of an object of another module: a field that no class of
    this module defines, written on anything but ``self``/``cls``. Allowed, narrowly: what a
    classmethod fills in the object it builds (as ``private_writes``), and a counter bump
    (``self.stats.x += n``: an augmented assignment on an object held in one of the writer's own
    fields, a counters record such as manager/stats.py's, whose one writer is its holder)."""
    own = own_fields(tree)
    allowed = inside_classmethods(tree)
    found = []
    for node in ast.walk(tree):
        for target in _assigned(node):
            if not isinstance(target, ast.Attribute) or target.attr.startswith("_") or target.attr in own \
                    or (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")) \
                    or id(target) in allowed:
                continue
            holder = target.value
            if isinstance(node, ast.AugAssign) and isinstance(holder, ast.Attribute) \
                    and isinstance(holder.value, ast.Name) and holder.value.id == "self":
                continue
            found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


def test_the_public_write_finder_sees_a_write_from_outside():
    tree = ast.parse("entry.epoch += 1\nreg.log, n = [], 1\nself.x = 1\nself.stats.hits += 1\n"
                     "self.stats.hits = 0\nd.items[k] = 2\nmine.y = 3\n"
                     "class A:\n    y: int\n    @classmethod\n    def make(cls):\n        a = cls()\n"
                     "        a.z = 2\n")
    assert public_writes(tree) == ["line 1: entry.epoch", "line 2: reg.log", "line 5: self.stats.hits"]


def test_the_daemon_writes_no_public_field_of_another_modules_object():
    """In the daemon and its store (kvpool.manager but its pool core): the registry's records
    change through their own methods, the registry through its commit protocol."""
    bad = [f"{name} {hit}" for name, path in module_files().items()
           if part_of(name) in ("manager", "manager.state", "manager.store")
           for hit in public_writes(ast.parse(path.read_text()))]
    assert bad == [], "state has one owner: add a method to the owning class instead"


def test_the_worker_and_the_front_door_write_no_public_field_of_another_modules_object():
    """In kvpool.worker and kvpool.frontend: a request's records (worker/request.py, kv_view.py,
    step_state.py) change through their own methods, the scheduler's pool size and EOS ids come
    in, a model shards itself (worker/model.py ``shard``), the front door's counters and its
    uvicorn server change through methods of their own classes."""
    bad = [f"{name} {hit}" for name, path in module_files().items()
           if part_of(name) in ("worker", "frontend")
           for hit in public_writes(ast.parse(path.read_text()))]
    assert bad == [], "state has one owner: add a method to the owning class instead"


def test_class_names_are_distinct_across_the_project():
    where: dict[str, list[str]] = {}
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    assert {c: ms for c, ms in where.items() if len(ms) > 1} == {}


def test_no_module_swaps_its_class():
    """A module stays a plain module (kernels/ included: its kernel modules are named *_triton)."""
    bad = [
        f"{name} line {node.lineno}"
        for name, path in module_files().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "__class__"
                                                for t in node.targets)
    ]
    assert bad == []


def test_the_cli_uses_only_the_managers_public_entry_points():
    modules = module_files()
    bad = []
    for name, path in modules.items():
        if not name.startswith("kvpool.cli"):
            continue
        for target, imported in imports_of(name, path, modules):
            if not target.startswith("kvpool.manager") or target.startswith("kvpool.manager.core"):
                continue
            if imported is None or imported not in CLI_ENTRY_POINTS.get(target, set()):
                bad.append(f"{name} imports {target}{'.' + imported if imported else ''}")
    assert bad == [], "the CLI may use kvpool.manager.core and the entry points in CLI_ENTRY_POINTS"


def part_of(module: str) -> str:
    """The README table's row of a module: shared, kernels, manager.core, manager.store, manager, ..."""
    parts = module.split(".")[1:]
    if parts[0] == "manager" and len(parts) > 1 and parts[1] in ("core", "state", "store"):
        return f"manager.{parts[1]}"
    return parts[0]


# README "How it fits together", last column: what each part may import from the others.
MAY_IMPORT = {
    "shared": set(),
    "kernels": set(),
    "manager.core": {"shared"},
    "manager.state": {"shared", "manager.core"},
    "manager.store": {"shared", "manager.core", "manager.state"},  # below the daemon: no edge back
    "manager": {"shared", "manager.core", "manager.state", "manager.store"},
    "client": {"shared"},
    "worker": {"shared", "kernels", "manager.core", "client"},
    "frontend": {"shared", "client"},
    "llm": {"shared", "worker", "frontend"},  # the worker's engine, the front door's text handling
    "bench": {"shared", "manager.core"},  # workloads and the in-process pool benchmark
    "devcluster": {"shared", "worker", "client", "frontend", "bench"},  # above the product: nothing in it imports this
    "cli": {"shared", "worker", "manager.core", "frontend", "client", "devcluster", "bench", *CLI_ENTRY_POINTS},
    # adapters to other engines (vLLM's KV connector): nothing of the manager daemon
    "integrations": {"shared", "client", "kvpool.worker.node_store", "kvpool.worker.node_layout",
                     "kvpool.worker.node_disk_io"},
}


def test_every_package_has_a_row_in_the_import_table():
    assert {"cli", "shared", "manager", "worker", "kernels"} <= set(PACKAGES)
    missing = sorted(set(PACKAGES) - set(MAY_IMPORT))
    assert missing == [], "add the new package to MAY_IMPORT and to the README's table"


def test_each_part_imports_only_what_the_readme_table_allows():
    """What each import statement names (a package's ``__init__``, run as the parent of the
    module imported, is no edge of the importer: it is checked as a module of its own)."""
    graph = import_graph(parents=False)
    bad = []
    for module, deps in graph.items():
        mine = part_of(module)
        for dep in deps:
            theirs = part_of(dep)
            if theirs != mine and theirs not in MAY_IMPORT[mine] and dep not in MAY_IMPORT[mine]:
                bad.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert bad == []


def test_the_store_sits_below_the_daemon():
    """Nothing in kvpool.manager.store or kvpool.manager.state imports the daemon's own modules
    (the registry, its config): the store sees the registry as manager/store/view.py's protocol."""
    bad = [f"{module} imports {dep}" for module, deps in import_graph(parents=False).items()
           if part_of(module) in ("manager.store", "manager.state")
           for dep in deps if part_of(dep) == "manager"]
    assert bad == []


# Who may build or read the manager's and the generate socket's messages: the clients, the
# records' codecs in shared/, and the sides that answer (the manager daemon, the worker's server).
PROTOCOL_SPEAKERS = ("kvpool.client", "kvpool.shared", "kvpool.manager", "kvpool.worker.server")
REQUEST_OPS = {"hello", "register", "step", "lookup", "locate", "workers", "heartbeat", "deregister",
               "generate", "abort", "ping"}


def hand_spoken(tree: ast.AST) -> list[str]:
    """Where a module speaks a protocol by hand: ``encode_request``, a request map literal
    (``{"op": "generate", "id": ...}``; other maps with an ``op``, such as the tensor-parallel
    ranks' broadcast, are not these protocols), or a DEALER socket in a module that packs msgpack itself."""
    found, dealer, packs = [], None, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = ast.unparse(node.func)
            if fn.endswith("encode_request"):
                found.append(f"line {node.lineno}: {fn}(...)")
            elif fn.endswith("msgpack.packb") or fn == "packb":
                packs = packs or node.lineno
            elif fn.endswith(".socket") and any(ast.unparse(a).endswith("DEALER") for a in node.args):
                dealer = dealer or node.lineno
        elif isinstance(node, ast.Dict):
            keys = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
            op = keys.get("op")
            if "id" in keys and isinstance(op, ast.Constant) and op.value in REQUEST_OPS:
                found.append(f"line {node.lineno}: a {op.value!r} message built by hand")
    if dealer and packs:
        found.append(f"line {dealer}: a DEALER socket fed with msgpack.packb (line {packs})")
    return found


def test_the_hand_speaking_finder_sees_each_kind():
    tree = ast.parse("import msgpack, zmq\nsock = ctx.socket(zmq.DEALER)\nsock.send(msgpack.packb({'op': 'ping', 'id': 1}))\n"
                     "encode_request(1, 'hello', None, {})\nplan = {'op': 'step', 'seqs': []}\n")
    assert hand_spoken(tree) == ["line 4: encode_request(...)", "line 3: a 'ping' message built by hand",
                                 "line 2: a DEALER socket fed with msgpack.packb (line 3)"]
    assert hand_spoken(ast.parse("sock = ctx.socket(zmq.DEALER)\nsock.send(b'raw')\n")) == []


def test_only_the_client_package_speaks_the_protocols():
    """Every manager and generate client is kvpool.client's (tests' hostile probes aside:
    tests/ is not scanned)."""
    bad = [f"{name} {hit}" for name, path in module_files().items()
           if not name.startswith(PROTOCOL_SPEAKERS)
           for hit in hand_spoken(ast.parse(path.read_text()))]
    assert bad == [], "use kvpool.client (ManagerClient, AsyncManagerClient, GenerateClient, WorkerLink)"
