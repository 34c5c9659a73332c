"""The test tree keeps its shape: every test module in tests/unit or tests/integration, and none imports another
(what tests share is in ``tests.helpers``), so a module moves between the folders, or is renamed, alone."""

from __future__ import annotations

import ast

from tests.helpers import ROOT

TESTS = ROOT / "tests"


def imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_test_module_is_in_a_folder_and_imports_no_other():
    modules = sorted(TESTS.rglob("test_*.py"))
    assert modules and {p.parent for p in modules} <= {TESTS / "unit", TESTS / "integration"}, \
        [str(p.relative_to(TESTS)) for p in modules if p.parent not in (TESTS / "unit", TESTS / "integration")]
    stems = {p.stem for p in modules}
    for path in modules + sorted((TESTS / "helpers").glob("*.py")):
        wrong = {m for m in imported_modules(path)
                 if m.split(".")[-1] in stems or m.startswith(("tests.unit", "tests.integration", "conftest"))}
        assert not wrong, f"{path.relative_to(TESTS)} imports {sorted(wrong)}: shared code goes in tests.helpers"
