"""The codegen package's modules import one another one way: parse (spec) -> validate -> plan -> render,
with no cycle, so each can be read, tested and changed on its own."""

import ast
import os
import unittest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "codegen", "kvforge_codegen")


def internal_imports(path: str) -> set:
    """Modules of the package that `path` imports, at any depth of the file (local imports count)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
    return out


class ImportGraph(unittest.TestCase):
    def test_no_cycle(self):
        modules = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
        graph = {m: internal_imports(os.path.join(PACKAGE, m + ".py")) & modules for m in modules}
        state = {}

        def visit(m, trail):
            if state.get(m) == "done":
                return
            if state.get(m) == "open":
                self.fail("import cycle: " + " -> ".join(trail + [m]))
            state[m] = "open"
            for n in sorted(graph[m]):
                visit(n, trail + [m])
            state[m] = "done"

        for m in sorted(modules):
            visit(m, [])
        self.assertNotIn("validate", graph["plan"])
        self.assertNotIn("plan", graph["spec"])


if __name__ == "__main__":
    unittest.main()
