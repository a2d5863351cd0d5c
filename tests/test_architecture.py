"""The package layout keeps its shape: imports flow one way (no circle, not even through an import inside a
function), and the commands that need no cluster (export, chat, report, prepare) never import Ray."""

import ast
import json
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


RAY_FREE = textwrap.dedent("""
    import contextlib, io, json, sys
    from raysft import cli

    for command in ("export", "chat", "report", "prepare"):
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            cli.main([command, "--help"])
    tmp = sys.argv[1]
    codes = {
        "report": cli.main(["report", tmp, "--out", f"{tmp}/report.png"]),
        "prepare": cli.main(["prepare", "--set", f"data.paths=[{tmp}/chats.jsonl]", "--set", "data.max_seq_len=64",
                             "--set", f"run.storage_path={tmp}/runs"]),
    }
    print(json.dumps({"codes": codes, "ray": sorted(m for m in sys.modules if m.split(".")[0] == "ray")}))
""")


def test_commands_without_a_cluster_do_not_import_ray(tmp_path):
    """export, chat, report and prepare run where Ray is not installed (an inference box, a laptop): the CLI, each
    command's help, a real report and a real prepare (tokenizing here) leave Ray out of sys.modules."""
    rows = [{"step": s, "time": 0, "loss": 3 - 0.1 * s, "tokens_per_s": 100.0} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    (tmp_path / "chats.jsonl").write_text(json.dumps(chat) + "\n")
    out = subprocess.run([sys.executable, "-c", RAY_FREE, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"codes": {"report": 0, "prepare": 0}, "ray": []}, (seen, out.stderr[-3000:])
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
