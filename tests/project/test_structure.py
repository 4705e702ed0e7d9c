"""The tree's structure, read from the source (no import runs): the installed import names, the
import graph's direction, and the size of files and functions (issue 51)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAPPED = ("models", "scheduler", "pallas_kernels")  # pagedjax/<folder> links to them
SOURCE = ("pagedjax", *MAPPED)


def python_files(*folders: str):
    """The folders' Python files, each once: a path through pagedjax/'s links to the top-level
    folders is skipped (they are read as models/..., scheduler/..., pallas_kernels/...)."""
    for folder in folders:
        yield from sorted(p for p in (ROOT / folder).rglob("*.py")
                          if not any(parent.is_symlink() for parent in p.parents))


def imported_names(path: pathlib.Path):
    """(line, dotted name) of every absolute import in the file, in functions too."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_nothing_imports_the_folders_by_their_top_level_names():
    """`models`, `scheduler` and `pallas_kernels` are pagedjax.models, ... everywhere: a top-level
    import would load a second copy of a module (its classes unequal to the first's) from a
    checkout and fail in an install."""
    found = [f"{path.relative_to(ROOT)}:{line}: {name}"
             for path in python_files(*SOURCE, "tests", "benchmarks", "notebooks")
             for line, name in imported_names(path) if name.split(".")[0] in MAPPED]
    assert not found, "\n".join(found)


def test_the_top_level_folders_are_linked_into_pagedjax():
    """pagedjax/models -> ../models (and scheduler, pallas_kernels): the one layout Python, the
    wheel, type checkers and IDEs all resolve pagedjax.models in, with no import hook."""
    for folder in MAPPED:
        link = ROOT / "pagedjax" / folder
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), folder
        assert str(link.readlink()) == f"../{folder}"  # relative: a clone anywhere resolves it


def module_name(path: pathlib.Path) -> str:
    """The installed name of a source file (models/x.py -> pagedjax.models.x)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "pagedjax" else ["pagedjax", *parts])


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (at any depth of the file)."""
    modules = {module_name(p): p for p in python_files(*SOURCE)}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        targets = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # a type's name only, never imported at run time
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            targets.update(t for t in map(resolve, names)
                           if t and t != module and not module.startswith(t + "."))
        graph[module] = targets
    return graph


def _is_type_checking(node) -> bool:
    """An `if TYPE_CHECKING:` block (a part's annotation naming the engine that holds it)."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def room(module: str) -> str:
    """A module's room: pagedjax.<room>, and pagedjax.models.<room> inside models/."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1:2] == ["models"] else parts[:2])


def test_no_import_circle_between_files():
    assert not cycles(import_graph())


def test_no_import_circle_between_rooms():
    """Rooms import one way: engine -> parallel, frontend -> engine, models' families ->
    layers, loading -> registry -> families, ..."""
    graph = import_graph()
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(
            room(t) for t in targets if room(t) != room(module))
    assert not cycles(rooms)


def test_the_scheduler_imports_nothing_above_it():
    """pagedjax.scheduler is NumPy only: no jax, and none of the project's other rooms."""
    found = [f"{path.relative_to(ROOT)}: {name}" for path in python_files("scheduler")
             for _, name in imported_names(path)
             if name.split(".")[0] in ("jax", "jaxlib", "flax")
             or (name.startswith("pagedjax.") and not name.startswith("pagedjax.scheduler"))]
    assert not found, "\n".join(found)


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def test_files_and_functions_stay_small():
    """No file over 400 lines and no function over 60 in pagedjax/, models/, scheduler/ (the
    kernels in pallas_kernels/ are written as one body each and are not held to it)."""
    found = []
    for path in python_files("pagedjax", "models", "scheduler"):
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            found.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                 f"{length} lines")
    assert not found, "\n".join(found)


def test_the_public_names_are_typed_as_they_load():
    """pagedjax's lazy names (_EXPORTS, loaded by __getattr__) are __all__, and each is imported
    under `if TYPE_CHECKING:` from the module __getattr__ loads it from: a type checker and an
    IDE see the class itself, not Any."""
    import pagedjax

    tree = ast.parse((ROOT / "pagedjax" / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    typed = {(alias.asname or alias.name): (node.module, alias.name)
             for node in block.body for alias in node.names}
    assert typed == pagedjax._EXPORTS
    assert sorted(pagedjax.__all__) == sorted([*pagedjax._EXPORTS, "__version__"])


def assigned_attributes(path: pathlib.Path):
    """(line, target) of every assignment to an attribute of something other than self."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for one in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(one, ast.Attribute) and ast.unparse(one.value) != "self":
                    yield node.lineno, ast.unparse(one)


def test_the_model_runner_owns_its_fields():
    """No module but the runner's own assigns a ModelRunner's fields or calls its private
    methods: its parameters, KV cache, channel and cached layouts change through its methods
    (set_params, drop_kv_cache, restore_kv_cache, swap_kv_cache, lead, attach_tier_pool,
    cached_layout)."""
    own = {ROOT / "pagedjax" / "engine" / "runner.py",
           ROOT / "pagedjax" / "kv_offload" / "block_transfers.py"}  # its base class
    runner = re.compile(r"(^|\.)(draft_)?runner$")
    found = [f"{path.relative_to(ROOT)}:{line}: {target}"
             for path in python_files(*SOURCE) if path not in own
             for line, target in assigned_attributes(path)
             if runner.search(target.rpartition(".")[0])]
    found += [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for path in python_files(*SOURCE) if path not in own
              for i, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"runner\._[a-z]", line)]
    assert found == [], "\n".join(found)


def test_the_engine_is_composed_of_parts_not_mixins():
    """LLMEngine inherits nothing: its parts (intake, weights, sleep_mode, loras, pooling,
    outputs, recovery) are objects it holds, each owning its state, and the step loop is in
    llm_engine.py. No class of pagedjax/engine/ is another's base but BackgroundWarmup, which
    EncoderWarmup specializes."""
    classes = {node.name: (path, node) for path in python_files("pagedjax/engine")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    assert classes["LLMEngine"][1].bases == []
    bases = {ast.unparse(base).split("[")[0] for _, node in classes.values() for base in node.bases}
    assert bases & set(classes) == {"BackgroundWarmup"}
    loop = ast.unparse(classes["LLMEngine"][1])
    for step in ("def step(", "def begin_step(", "def _schedule(", "def dispatch(",
                 "def finish_step(", "def complete_step("):
        assert step in loop, step
