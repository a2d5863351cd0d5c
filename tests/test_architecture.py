"""The package layout keeps its shape: imports flow one way (no circle, not even through an import inside a
function; packages import only those below them in PACKAGE_ORDER, but for at most MAX_BACK_ARROWS), one module
parses the safetensors index, and the commands that need no cluster (export, chat, report, prepare) never import
Ray."""

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "raysft"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The raysft modules an import statement names: `from raysft.x import y` is raysft.x.y when that is a module
    (a submodule import), else raysft.x; relative imports are resolved against `module`."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # `import raysft.a.b` also names what exists of raysft.a.b
            name = name.rpartition(".")[0]
        while name:  # importing raysft.a.b runs raysft.a's __init__ first, unless the importer is inside raysft.a
            if not (module == name or module.startswith(name + ".")):
                found.add(name)
            name = name.rpartition(".")[0]
    return found


def import_graph() -> dict[str, set[str]]:
    """Every raysft module -> the raysft modules it imports anywhere in its body (at module level, inside a
    function, under TYPE_CHECKING alike): a circle through any of them is a circle of the design."""
    files = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    modules = set(files)
    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, is_package, modules)
        graph[module] = edges - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a closed path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path_through(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle from the component's first module back to itself (breadth first), to name in a failure."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return sorted(component)


def test_cycles_finds_a_circle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_function_level_and_relative_imports():
    graph = import_graph()
    assert "raysft.checkpoint.checkpointer" in graph["raysft.checkpoint"]  # __init__'s exports
    assert "raysft.config" in graph["raysft.training.trainer"]
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # it read the package, not a corner of it


def test_raysft_imports_have_no_circle():
    found = cycles(import_graph())
    assert not found, "import circles (a lower module imports a higher one): " + "; ".join(
        " -> ".join(c) for c in found)


# The packages from the bottom up (raysft/__init__'s docstring gives the same order): a package imports only those
# before it. The top level's modules: errors at the bottom, the CLI, the entry points and the package's face on top.
PACKAGE_ORDER = ("errors", "storage", "distributed", "config", "hf", "data", "model", "parallel", "checkpoint",
                 "training", "products", "evals", "tools", "launch", "cli")
TOP_LEVEL_PACKAGE = {"raysft": "cli", "raysft.__main__": "cli", "raysft.cli": "cli", "raysft.run": "cli",
                     "raysft.errors": "errors"}
MAX_BACK_ARROWS = 2


def package_of(module: str) -> str:
    return TOP_LEVEL_PACKAGE.get(module) or module.split(".")[1]


def back_arrows(graph: dict[str, set[str]], order: tuple[str, ...] = PACKAGE_ORDER) -> list[tuple[str, str]]:
    """(importing module, imported package) for each import of a package later in `order` than the importer's."""
    rank = {name: i for i, name in enumerate(order)}
    return sorted({(module, package_of(name)) for module, names in graph.items() for name in names
                   if rank[package_of(name)] > rank[package_of(module)]})


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, names in graph.items():
        packages.setdefault(package_of(module), set()).update(package_of(n) for n in names)
    return {package: names - {package} for package, names in packages.items()}


def test_back_arrows_and_package_graph_name_the_importing_module():
    graph = {"raysft.hf.a": {"raysft.model.b"}, "raysft.model.b": {"raysft.hf.c", "raysft.errors"},
             "raysft.hf.c": set(), "raysft.errors": set()}
    assert back_arrows(graph) == [("raysft.hf.a", "model")]
    assert package_graph(graph) == {"hf": {"model"}, "model": {"hf", "errors"}, "errors": set()}
    assert cycles(package_graph(graph)) == [["hf", "model", "hf"]]


def test_every_package_has_its_place_in_the_order():
    """A new package must be placed in PACKAGE_ORDER (and raysft/__init__'s docstring), not slip past the check."""
    placed = {package_of(module) for module in import_graph()}
    assert placed <= set(PACKAGE_ORDER), f"packages not in PACKAGE_ORDER: {sorted(placed - set(PACKAGE_ORDER))}"
    face = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    order = next(part for part in face.split("\n\n") if "→" in part)
    named = re.findall(rf"\b({'|'.join(PACKAGE_ORDER)})\b", re.sub(r"\([^)]*\)", "", order))
    assert named == list(PACKAGE_ORDER[:-1]), f"raysft/__init__'s docstring gives another order: {named}"


def test_packages_import_only_those_below_them_and_form_no_circle():
    """Arrows run one way: the file format (hf) below the checkpoint and the model, the products built on them
    (export, adapters) above both; a package importing one above it is named with the module that does it."""
    graph = import_graph()
    found = back_arrows(graph)
    assert len(found) <= MAX_BACK_ARROWS, f"{len(found)} imports run back up the package order (at most " \
        f"{MAX_BACK_ARROWS}): " + "; ".join(f"{module} -> {package}" for module, package in found)
    circles = cycles(package_graph(graph))
    assert not circles, "package circles: " + "; ".join(" -> ".join(c) for c in circles) + " (through " + \
        "; ".join(f"{module} -> {package}" for module, package in found) + ")"


def test_one_module_parses_the_safetensors_index():
    """`*.safetensors.index.json` is read in one place (raysft.hf.shards.read_weight_map): a module that reads an
    index's weight_map itself would check its names by rules of its own."""
    readers = sorted(_module_name(p) for p in PACKAGE.rglob("*.py")
                     if any(isinstance(node, ast.Constant) and node.value == "weight_map"
                            for node in ast.walk(ast.parse(p.read_text()))))
    assert readers == ["raysft.hf.shards"], f"modules that read a weight_map: {readers}"


RAY_FREE = textwrap.dedent("""
    import contextlib, io, json, sys
    from raysft import cli

    for command in ("train", "export", "chat", "report", "prepare", "plan", "eval"):
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            cli.main([command, "--help"])
    tmp = sys.argv[1]
    with contextlib.redirect_stderr(io.StringIO()):
        codes = {"config error": cli.main(["train", "--set", "train.max_stepz=3"]),
                 "report": cli.main(["report", tmp, "--out", f"{tmp}/report.png"])}
    heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    codes["prepare"] = cli.main(["prepare", "--set", f"data.paths=[{tmp}/chats.jsonl]", "--set",
                                 "data.max_seq_len=64", "--set", f"run.storage_path={tmp}/runs"])
    print(json.dumps({"codes": codes, "ray": sorted(m for m in sys.modules if m.split(".")[0] == "ray"),
                      "torch or transformers before prepare": heavy}))
""")


def test_commands_without_a_cluster_do_not_import_ray_and_the_cli_imports_what_its_command_needs(tmp_path):
    """export, chat, report and prepare run where Ray is not installed (an inference box, a laptop): the CLI, each
    command's help, a real report and a real prepare (tokenizing here) leave Ray out of sys.modules. Each command
    imports what it needs when it runs: every help, a config error and a report come without torch and
    transformers (seconds of imports before a typo's message)."""
    rows = [{"step": s, "time": 0, "loss": 3 - 0.1 * s, "tokens_per_s": 100.0} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    (tmp_path / "chats.jsonl").write_text(json.dumps(chat) + "\n")
    out = subprocess.run([sys.executable, "-c", RAY_FREE, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"codes": {"config error": 2, "report": 0, "prepare": 0}, "ray": [],
                    "torch or transformers before prepare": []}, (seen, out.stderr[-3000:])
    assert (tmp_path / "report.png").is_file() and list((tmp_path / "runs" / "datasets").glob("*/manifest.json"))


TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "errors.py", "run.py"}  # the face, the CLI, the entry points


def test_the_top_level_is_the_package_face_and_its_entry_points():
    """`ls raysft/` is the architecture: every module but the package's face and its entry points lives in a role
    package, so the top level does not drift back into thirty modules side by side."""
    modules = {p.name for p in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL, f"modules outside a role package: {sorted(modules - TOP_LEVEL)}"
    assert len(TOP_LEVEL) <= 6
    for package in (p for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))
                    and p.name != "assets"):
        init = package / "__init__.py"
        assert init.is_file(), f"{package} is no package"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        listed = {m.stem for m in package.glob("*.py")} - {"__init__"}
        unnamed = sorted(m for m in listed if m not in doc)
        assert not unnamed, f"{init}'s docstring names each module by role; it does not name {unnamed}"


def test_what_ray_runs_of_raysft_outside_the_workers_imports_neither_torch_nor_transformers():
    """Ray Train's controller unpickles the run's callback and validation function, and the StopFlag actor imports
    its class's module: each such process would otherwise import torch and transformers (seconds of CPU on every
    launch's path to its first step). Their module, and what loading each of them pulls in, stays light."""
    from raysft.launch import ray_controller, ray_driver

    assert ray_driver.StopFlag is ray_controller.StopFlag
    assert ray_driver.EndRunOnRecordedError.__module__ == ray_driver.validate_checkpoint.__module__ == \
        "raysft.launch.ray_controller"
    code = ("import sys, raysft.launch.ray_controller as c\n"
            "c.StopFlag.__ray_actor_class__().request()\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[]"], out.stdout
