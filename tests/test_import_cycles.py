"""No import cycle in flexsgl/ or overrides/ (tools/import_cycles.py), and the checker finds one
that a package is given."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_imports_itself_back():
    found = _checker().cycles(ROOT)
    assert found == [], f"import cycles (python tools/import_cycles.py says where): {found}"


def test_the_checker_finds_cycles_at_import_and_in_functions(tmp_path):
    pkg = tmp_path / "flexsgl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from flexsgl.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flexsgl import c\n")
    checker = _checker()
    assert checker.cycles(tmp_path, ("top",)) == []
    assert checker.cycles(tmp_path) == [["flexsgl.a", "flexsgl.sub.b"]]
    assert sorted(checker.cycles(tmp_path, ("top", "function", "type"))) == [["flexsgl.a", "flexsgl.sub.b"],
                                                                            ["flexsgl.c", "flexsgl.d"]]
