#!/usr/bin/env python3
"""Checks the imports of the first-party Python code (docs/ARCHITECTURE.md, "Python imports").

Three rules, each a failure with the file, line and reason (and a fourth that keeps the
module graph well defined: no two first-party modules of one name that something imports):

- No import cycles between first-party modules, counting every import: module level,
  function-local and under `if TYPE_CHECKING:` (a cycle moved into a function is still one).
- No private imports across modules: `from m import _name`, or a module path with a segment
  `_x` (`kvt._proto`), only from inside the module or package that owns the private name.
- No `sys.path` edits (insert, append, assignment, site.addsitedir) outside entry points. An
  entry point is a script with an `if __name__ == "__main__":` block that no first-party module
  imports; it may edit the path once, at module level. Under Bazel, py_library `imports=` and
  deps give every module its path instead.

Modules are found from the files: a directory without __init__.py is an import root for the
files in it (Bazel's `imports = ["."]`), a package's modules are named from the first directory
above it without __init__.py. An import that names no first-party module (the standard library,
the venv, generated code such as kvt._proto) is outside the graph.

Usage: check_py_imports.py [ROOT]: the *.py files under ROOT (default: the workspace in the
runfiles under `bazel test`, else the checkout this file is in; in a checkout, its tracked files).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Dict, Iterator, List, Optional, Set, Tuple

SKIP_DIRS = {".venv", ".git", "node_modules", "__pycache__"}


class Module:
    def __init__(self, path: str, name: str, root: str, is_package: bool) -> None:
        self.path = path  # relative to the tree
        self.name = name  # dotted module name
        self.root = root  # the import root it is found under
        self.is_package = is_package
        self.tree: Optional[ast.Module] = None


def python_files(tree: str) -> Iterator[str]:
    """The *.py files under `tree`: in a git checkout the tracked ones (not the generated stubs
    of a pip install or a scratch file), else every one (Bazel's runfiles)."""
    if os.path.isdir(os.path.join(tree, ".git")) or os.path.isfile(os.path.join(tree, ".git")):
        listed = subprocess.run(["git", "-C", tree, "ls-files", "-z", "--", "*.py"],
                                capture_output=True, text=True)
        if listed.returncode == 0:
            yield from sorted(p for p in listed.stdout.split("\0") if p)
            return
    for directory, subdirs, files in os.walk(tree, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs
                            if d not in SKIP_DIRS and not d.startswith("bazel-")
                            and not d.startswith("."))
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.relpath(os.path.join(directory, f), tree)


def module_of(tree: str, path: str) -> Module:
    directory, file = os.path.split(path)
    stem = file[:-3]
    parts = [] if stem == "__init__" else [stem]
    while directory and os.path.exists(os.path.join(tree, directory, "__init__.py")):
        directory, package = os.path.split(directory)
        parts.insert(0, package)
    return Module(path, ".".join(parts), directory, stem == "__init__")


class Graph:
    def __init__(self, tree: str) -> None:
        self.tree = tree
        self.modules: List[Module] = [module_of(tree, p) for p in python_files(tree)]
        self.by_name: Dict[str, List[Module]] = {}
        for m in self.modules:
            if m.name:
                self.by_name.setdefault(m.name, []).append(m)
        self.errors: List[str] = []
        for m in self.modules:
            with open(os.path.join(tree, m.path), "rb") as f:
                source = f.read()
            try:
                m.tree = ast.parse(source, m.path)
            except SyntaxError as e:
                self.errors.append(f"{m.path}:{e.lineno}: does not parse: {e.msg}")
        # Two modules of one name that something imports: on one sys.path the first shadows
        # the other, and which one an import means is not stated anywhere.
        imported: Set[str] = set()
        for m in self.modules:
            if m.tree is not None:
                for _, dotted, names in imports(m):
                    parts = dotted.split(".") if dotted else []
                    imported.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
                    imported.update(f"{dotted}.{n}" for n in names)
        for name, same in sorted(self.by_name.items()):
            if len(same) > 1 and name in imported:
                self.errors.append(f"two first-party modules named {name}: " +
                                   ", ".join(m.path for m in same))

    def resolve(self, importer: Module, dotted: str) -> Optional[Module]:
        """The first-party module `dotted` names for `importer`: the one under the importer's own
        root first (what `imports = ["."]` of its library gives), else the only one."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            candidates = self.by_name.get(".".join(parts[:n]), [])
            if not candidates:
                continue
            same_root = [c for c in candidates if c.root == importer.root]
            if same_root:
                return same_root[0]
            if len(candidates) == 1:
                return candidates[0]
            return None  # two modules of that name on different roots (reported on its own)
        return None


def absolute(importer: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer.name.split(".") if importer.is_package else importer.name.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(importer: Module) -> Iterator[Tuple[int, str, List[str]]]:
    """(line, module path, names imported from it) of every import statement, anywhere."""
    assert importer.tree is not None
    for node in ast.walk(importer.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, absolute(importer, node), [a.name for a in node.names]


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def inside(importer: Module, owner: str) -> bool:
    """Whether `importer` is the module `owner` or lies in the package `owner`."""
    return importer.name == owner or importer.name.startswith(owner + ".")


def check_private(g: Graph) -> None:
    for m in g.modules:
        if m.tree is None:
            continue
        for line, dotted, names in imports(m):
            parts = dotted.split(".") if dotted else []
            for i, part in enumerate(parts):
                owner = ".".join(parts[:i])
                if private(part) and owner and not inside(m, owner) and \
                        g.resolve(m, owner) is not None:  # first-party (not torch._C)
                    g.errors.append(f"{m.path}:{line}: imports {'.'.join(parts[:i + 1])}, "
                                    f"private to {owner}")
                    break
            else:
                # `from m import _name` (a name or a submodule): private to m, when m is
                # first-party.
                if not dotted or g.resolve(m, dotted) is None or inside(m, dotted):
                    continue
                for name in names:
                    if private(name):
                        g.errors.append(f"{m.path}:{line}: imports {name} from {dotted}, "
                                        f"private to it")


def edges(g: Graph) -> Dict[str, Dict[str, int]]:
    """module path -> {imported module path: first line}."""
    out: Dict[str, Dict[str, int]] = {m.path: {} for m in g.modules}
    for m in g.modules:
        if m.tree is None:
            continue
        for line, dotted, names in imports(m):
            targets = [g.resolve(m, dotted)] if dotted else []
            # `from pkg import mod` imports the submodule pkg.mod too.
            targets += [g.resolve(m, f"{dotted}.{n}") for n in names
                        if f"{dotted}.{n}" in g.by_name]
            for t in targets:
                # A package's modules import the package itself freely: Python has it (and
                # its __init__.py) in sys.modules before any of them runs.
                if t is not None and t.path != m.path and \
                        not (t.is_package and inside(m, t.name)):
                    out[m.path].setdefault(t.path, line)
            # Importing pkg.sub runs pkg/__init__.py first.
            if dotted:
                parts = dotted.split(".")
                for n in range(1, len(parts)):
                    parent = g.resolve(m, ".".join(parts[:n]))
                    if parent is not None and parent.is_package and parent.path != m.path \
                            and not inside(m, parent.name):
                        out[m.path].setdefault(parent.path, line)
    return out


def check_cycles(g: Graph) -> None:
    graph = edges(g)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan, iterative over the successors
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, successors = work[-1]
            advanced = False
            for w in successors:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    for component in components:
        members = set(component)
        lines = [f"  {a}:{line} imports {b}" for a in component
                 for b, line in sorted(graph[a].items()) if b in members]
        g.errors.append("import cycle between " + ", ".join(component) + ":\n" +
                        "\n".join(lines))


def sys_path_edits(tree: ast.Module) -> List[Tuple[int, bool]]:
    """(line, at module level) of every edit of sys.path."""

    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and
                isinstance(node.value, ast.Name) and node.value.id == "sys")

    top_level: Set[int] = set()
    for stmt in tree.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top_level.update(id(n) for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        edit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value):
                edit = node.func.attr in ("insert", "append", "extend", "remove", "pop",
                                          "clear", "__setitem__", "__delitem__")
            elif node.func.attr == "addsitedir":
                edit = True
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target]
            for t in targets:
                if is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)):
                    edit = True
        if edit:
            found.append((node.lineno, id(node) in top_level))
    return found


def has_main_block(tree: ast.Module) -> bool:
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare):
            names = [stmt.test.left] + list(stmt.test.comparators)
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in names):
                return True
    return False


def check_sys_path(g: Graph) -> None:
    imported: Set[str] = set()
    for targets in edges(g).values():
        imported.update(targets)
    for m in g.modules:
        if m.tree is None:
            continue
        found = sorted(sys_path_edits(m.tree))
        if not found:
            continue
        if not has_main_block(m.tree):
            why = "not an entry point (no `if __name__ == \"__main__\":` block)"
        elif m.path in imported:
            why = "a module other first-party modules import"
        elif len(found) > 1:
            why = "an entry point may edit it once"
        elif not found[0][1]:
            why = "an entry point edits it at module level only, not in a function"
        else:
            continue
        for line, _ in found:
            g.errors.append(f"{m.path}:{line}: edits sys.path: {why}; state the path in Bazel "
                            "(py_library imports and deps) instead")


def default_tree() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for variable in ("TEST_SRCDIR", "RUNFILES_DIR"):
        root = os.environ.get(variable)
        if root and os.path.isdir(os.path.join(root, "kvt")):
            return os.path.join(root, "kvt")
    return os.path.dirname(here)


def main(argv: List[str]) -> int:
    tree = argv[1] if len(argv) > 1 else default_tree()
    g = Graph(tree)
    check_cycles(g)
    check_private(g)
    check_sys_path(g)
    if g.errors:
        for e in g.errors:
            print(e, file=sys.stderr)
        print(f"check_py_imports: {len(g.errors)} problem(s) in {len(g.modules)} files under "
              f"{tree}", file=sys.stderr)
        return 1
    print(f"check_py_imports: ok ({len(g.modules)} files under {tree})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
