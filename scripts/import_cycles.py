"""Import cycles among a package's modules, from the AST (every import, lazy ones too).

    python scripts/import_cycles.py pympar   # exits 1 when it finds a cycle
"""
import ast, os, sys
root = sys.argv[1] if len(sys.argv) > 1 else "pympar"
mods = {}
for dirpath, _, files in os.walk(root):
    for f in files:
        if f.endswith(".py"):
            path = os.path.join(dirpath, f)
            name = path[:-3].replace(os.sep, ".")
            if name.endswith(".__init__"):
                name = name[:-9]
            mods[name] = path
def resolve(mod, level, module, pkg):
    if level == 0:
        return module
    base = pkg.split(".")
    base = base[:len(base) - level + 1]
    return ".".join(base + ([module] if module else []))
edges = {m: set() for m in mods}
for m, path in mods.items():
    pkg = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            target = resolve(m, node.level, node.module, pkg)
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
            cands = subs if len(subs) == len(node.names) else [target] + subs
        elif isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            continue
        for c in cands:
            if c in mods and c != m:
                edges[m].add(c)
pairs = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())})
print("mutual imports:", pairs or "none")
# longer cycles (ignoring package __init__ re-exports)
sys.setrecursionlimit(10000)
idx, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
def strong(v):
    idx[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx:
            strong(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: sccs.append(sorted(comp))
def path_is_init(m): return mods[m].endswith("__init__.py")
# drop edges into package __init__ modules from their own submodules (package re-exports)
for m in edges:
    edges[m] = {t for t in edges[m] if not (path_is_init(t) and m.startswith(t + "."))}
for v in edges:
    if v not in idx: strong(v)
print("cycles (strongly connected sets, package __init__ re-exports left out):", sccs or "none")
sys.exit(1 if pairs or sccs else 0)
