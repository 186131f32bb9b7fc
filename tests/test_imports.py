"""The repository's import graph, read from the source (ast, no module imported): no import cycle
anywhere, function-level imports included; kernels_pallas stands alone (nothing from posenc_jax
or experiments) and imports only at module level.

Every tracked .py file is a node, the tests too: nothing outside tests imports a test module, so
they cannot close a cycle through the library, but they import each other (tests.util, the
kernel checks), and a cycle there breaks collection the same way. An edge A -> B is an import
statement in A naming repository module B (for `from P import x`, P.x where that is a module,
else P). The parent packages a dotted import also runs are not edges: Python imports a
submodule of a package whose __init__ is still running, so an __init__ that re-exports its
submodules does not make a cycle with them. Imports built at run time (importlib with a
computed name) are not read.
"""
from __future__ import annotations

import ast
import os
import subprocess


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_files():
  out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                       check=False)
  if out.returncode == 0 and out.stdout.strip():
    return sorted(out.stdout.split())
  files = []   # no git (an exported tree): every .py file under the root
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames
              if f.endswith(".py")]
  return sorted(files)


def _module_name(path):
  parts = path[:-3].split("/")
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _modules():
  """{module name: (path, is_package)} of every repository module."""
  return {_module_name(p): (p, p.endswith("__init__.py")) for p in _python_files()
          if "/" in p or p != "setup.py"}


class Import:
  def __init__(self, source, target, line, in_function):
    self.source, self.target, self.line, self.in_function = source, target, line, in_function

  def __repr__(self):
    where = " (inside a function)" if self.in_function else ""
    return f"{self.source}:{self.line} imports {self.target}{where}"


def _imports(name, path, is_package, modules):
  """The repository imports of module `name` (every import statement, at any depth)."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read(), filename=path)
  package = name if is_package else name.rpartition(".")[0]
  found = []

  def resolve(dotted):   # the longest repository module that dotted names, or None
    while dotted and dotted not in modules:
      dotted = dotted.rpartition(".")[0]
    return dotted or None

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
      targets = []
      if isinstance(child, ast.Import):
        targets = [resolve(a.name) for a in child.names]
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ""
        if child.level:
          anchor = package.split(".")
          anchor = anchor[:len(anchor) - (child.level - 1)]
          base = ".".join(anchor + ([base] if base else []))
        for alias in child.names:
          full = f"{base}.{alias.name}" if base else alias.name
          targets.append(full if full in modules else resolve(base))
      for target in filter(None, targets):
        if target != name:
          found.append(Import(name, target, child.lineno, in_function))
      visit(child, inside)

  visit(tree, False)
  return found


def _graph():
  modules = _modules()
  edges = []
  for name, (path, is_package) in modules.items():
    edges += _imports(name, path, is_package, modules)
  return modules, edges


def _cycles(nodes, edges):
  """{strongly connected component of more than one module (a frozenset): one cycle through
  it (a list of Imports, the last back to the first's source)}."""
  graph = {n: [] for n in nodes}
  for e in edges:
    if e.source in graph and e.target in graph:
      graph[e.source].append(e)
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def strongconnect(v):   # Tarjan, iteratively (the graph's depth is the import chain's)
    work = [(v, iter(graph[v]))]
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    while work:
      node, it = work[-1]
      edge = next(it, None)
      if edge is not None:
        w = edge.target
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(graph[w])))
        elif w in on_stack:
          low[node] = min(low[node], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = set()
        while True:
          w = stack.pop()
          on_stack.discard(w)
          component.add(w)
          if w == node:
            break
        if len(component) > 1:
          components.append(component)

  for n in sorted(graph):
    if n not in index:
      strongconnect(n)
  return {frozenset(c): _cycle_in(c, graph) for c in components}


def _cycle_in(component, graph):
  """One cycle through the component's first module (a breadth-first path back to it)."""
  start = min(component)
  paths = {start: []}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for e in graph[v]:
        if e.target == start:
          return paths[v] + [e]
        if e.target in component and e.target not in paths:
          paths[e.target] = paths[v] + [e]
          nxt.append(e.target)
    frontier = nxt
  raise AssertionError(f"no cycle through {start}")


def _format(cycles):
  return "\n".join(f"import cycle among {', '.join(sorted(component))}, e.g.:\n  "
                   + "\n  ".join(map(repr, cycle)) for component, cycle in cycles.items())


# No cycle is tolerated; a cycle listed here would be accepted until it is broken.
KNOWN_CYCLES = set()


def test_the_graph_reads_the_repository():
  """The graph holds every package and the imports known to be there (a reader that found no
  edge would pass the cycle tests)."""
  modules, edges = _graph()
  for package in ("posenc_jax", "kernels_pallas", "kernels_pallas.path_attention",
                  "experiments", "tests.kernels"):
    assert package in modules, package
  pairs = {(e.source, e.target) for e in edges}
  assert ("kernels_pallas.path_attention.api", "kernels_pallas.path_attention.plan") in pairs
  # `from kernels_pallas.path_attention import backward` names the module
  assert ("kernels_pallas.path_attention.api", "kernels_pallas.path_attention.backward") in pairs
  # a relative import, and one inside a function (posenc_jax imports the kernels lazily)
  assert ("posenc_jax.attention", "kernels_pallas") in pairs
  assert any(e.in_function for e in edges if e.source == "posenc_jax.attention")
  assert len(edges) > 300, len(edges)


def test_cycle_finder_on_a_small_graph():
  """a -> b -> c -> a and d -> e -> d are cycles (one path each, back to its start); f -> a and
  c -> g lead into and out of one and add none."""
  pairs = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "e"), ("e", "d"), ("f", "a"), ("c", "g")]
  edges = [Import(s, t, i, False) for i, (s, t) in enumerate(pairs)]
  cycles = _cycles("abcdefg", edges)
  assert set(cycles) == {frozenset("abc"), frozenset("de")}
  assert [(e.source, e.target) for e in cycles[frozenset("abc")]] == [
      ("a", "b"), ("b", "c"), ("c", "a")]


def test_no_import_cycle():
  """No cycle among the repository's modules (experiments/benchmarks included) but the known
  ones."""
  modules, edges = _graph()
  cycles = _cycles(list(modules), edges)
  new = {c: cycle for c, cycle in cycles.items() if c not in KNOWN_CYCLES}
  assert not new, _format(new)
  gone = KNOWN_CYCLES - set(cycles)
  assert not gone, f"no longer a cycle, remove it from KNOWN_CYCLES: {sorted(map(sorted, gone))}"


def test_kernels_pallas_stands_alone():
  """kernels_pallas imports nothing from posenc_jax, experiments or tests, and every import of
  it is at module level: what a kernel module needs is visible at its top, and the file
  order of DESIGN.md ("each imports only files above it") is the import graph's."""
  _, edges = _graph()
  mine = [e for e in edges if e.source.split(".")[0] == "kernels_pallas"]
  outside = [e for e in mine if e.target.split(".")[0] != "kernels_pallas"]
  assert not outside, "\n".join(map(repr, outside))
  in_functions = [e for e in mine if e.in_function]
  assert not in_functions, "\n".join(map(repr, in_functions))
  assert len(mine) > 40, len(mine)
