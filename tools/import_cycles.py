"""Import cycles among the modules of flexsgl/ and overrides/ (overrides/ is imported as flexsgl.overrides).

Builds the graph of every `import` / `from ... import` in each module, top-level and inside
functions alike (each edge marked by where it sits: "top", "function", or "type" under
`if TYPE_CHECKING:`), resolves relative imports, and maps `from pkg import name` to pkg.name where
that is a module. Reports each strongly connected component with more than one module, a cycle
through it, and whether it holds with top-level imports alone (an import-time cycle) or needs a
function-level import; cycles through type-only imports, which never run, are listed for the
record. Exits 1 if any cycle runs. tests/test_import_cycles.py keeps the repository at none.
Usage: python tools/import_cycles.py [REPO_ROOT]
"""

import argparse
import ast
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    mods = {}
    for base, pkg in ((root / "flexsgl", "flexsgl"), (root / "overrides", "flexsgl.overrides")):
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def edges(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, where: "top", "function" or "type", line) for each import of `name` that
    lands in mods."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    # top level: outside every function body (under if/try/class too)
    top = {id(n) for node in tree.body for n in _outside_functions(node)}
    type_only = set()  # under `if TYPE_CHECKING:`, never run
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for b in node.body for n in ast.walk(b))
    out = []
    for node in ast.walk(tree):
        kind = "type" if id(node) in type_only else "top" if id(node) in top else "function"
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.append((t, kind, node.lineno))
    return out


def _outside_functions(node):
    """The nodes under `node` that no function body holds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _outside_functions(child)


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def a_cycle(graph, comp):
    """One cycle through comp's first module, by breadth-first search back to it."""
    start, inside = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def cycles(root: Path, kinds=("top", "function")) -> list[list[str]]:
    """The groups of modules under `root` that import each other through imports of `kinds`."""
    mods = modules(root)
    all_edges = {m: edges(m, p, mods) for m, p in mods.items()}
    return sccs({m: {t for t, k, _ in es if k in kinds} for m, es in all_edges.items()})


def main(root: Path) -> int:
    mods = modules(root)
    all_edges = {m: edges(m, p, mods) for m, p in mods.items()}
    graphs = {kinds: {m: {t for t, k, _ in es if k in kinds} for m, es in all_edges.items()}
              for kinds in (("top",), ("top", "function"), ("top", "function", "type"))}
    counts = {k: sum(1 for es in all_edges.values() for _, kk, _ in es if kk == k) for k in ("top", "function", "type")}
    print(f"{len(mods)} modules; import statements: {counts['top']} top-level, {counts['function']} in functions, "
          f"{counts['type']} under TYPE_CHECKING")
    found = 0
    names = {("top",): "import-time (top-level imports)", ("top", "function"): "with function-level imports",
             ("top", "function", "type"): "with TYPE_CHECKING imports too (never run; for the record)"}
    for kinds, graph in graphs.items():
        comps = sccs(graph)
        print(f"{names[kinds]}: {len(comps)} cycle group(s)")
        for comp in comps:
            found += "type" not in kinds
            cycle = a_cycle(graph, comp)
            print(f"  {len(comp)} modules: {', '.join(comp)}")
            print(f"    e.g. {' -> '.join(cycle)}")
            for a, b in zip(cycle, cycle[1:]):
                lines = sorted({f"{ln} ({k})" for tt, k, ln in all_edges[a] if tt == b and k in kinds})
                print(f"      {a} -> {b}: line {', '.join(lines)}")
    return 1 if found else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("root", nargs="?", default=".", help="the checkout to read (default: this folder)")
    root = Path(ap.parse_args().root)
    if not (root / "flexsgl").is_dir():
        ap.error(f"{str(root)!r} holds no flexsgl/ folder to read")
    sys.exit(main(root))
