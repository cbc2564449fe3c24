"""What an install from the package needs: ``requires-python = ">=3.10"`` (Ubuntu 22.04's python3,
e.g. cluster.yaml's AMI) -- no module imports at run time a name the standard library gained in
3.11+ (``typing.Self`` broke ``train-drafter`` on 3.10; a static check, since this suite runs on one
Python) -- and commands whose extra is missing say which one to install."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEWER = {
    "typing": {"Self", "LiteralString", "Never", "assert_never", "assert_type", "reveal_type",
               "Required", "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform",
               "override", "TypeAliasType", "get_overloads", "clear_overloads"},
    "enum": {"StrEnum", "verify", "EnumCheck", "ReprEnum"},
    "datetime": {"UTC"},
}
NEW_MODULES = {"tomllib", "wsgiref.types"}


def _runtime_imports(tree: ast.AST):
    """(module, name, line) of imports not under ``if TYPE_CHECKING:``."""
    def walk(node, guarded):
        for child in ast.iter_child_nodes(node):
            g = guarded or (isinstance(child, ast.If)
                            and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.ImportFrom) and not g:
                for a in child.names:
                    yield child.module or "", a.name, child.lineno
            elif isinstance(child, ast.Import) and not g:
                for a in child.names:
                    yield a.name, "", child.lineno
            yield from walk(child, g)
    yield from walk(tree, False)


def test_no_module_needs_a_newer_python_than_requires_python():
    files = [p for d in ("dart_ray", "deployments", "tuning", "batch")
             for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    bad = []
    for f in files:
        for mod, name, line in _runtime_imports(ast.parse(f.read_text(), str(f))):
            if name in NEWER.get(mod, ()) or mod in NEW_MODULES:
                bad.append(f"{f.relative_to(ROOT)}:{line}: {mod} {name}".strip())
    assert not bad, bad


def test_a_command_whose_extra_is_missing_says_which_to_install(monkeypatch, capsys):
    """The delegated commands import Ray/Optuna lazily, deep inside: a missing extra was a raw
    traceback (or, for `tune --help`, a ModuleNotFoundError) naming no extra."""
    import importlib.util

    from dart_ray import cli

    real = importlib.util.find_spec

    def no_optuna(name, *a, **k):
        if name.split(".")[0] == "optuna":
            return None
        return real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", no_optuna)
    assert cli.main(["tune", "--help"]) == 2
    err = capsys.readouterr().err
    assert "optuna not installed" in err and "pip install 'dart-ray[tune]'" in err
    assert cli.missing_modules(["ray.data", "json"]) == []
    assert cli.missing_modules(["no_such_pkg.sub"]) == ["no_such_pkg.sub"]
