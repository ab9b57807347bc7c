"""docs/ARCHITECTURE.md's import rules, checked: every megarl module imports only the megarl
packages its package's "Imports:" line names there (the doc is the single source of the rules).

Every import counts: top-level and lazy (inside functions), absolute and relative.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ARCHITECTURE.md"
PKG = REPO / "megarl"
ROOT = "__init__.py"  # the key of megarl/__init__.py in the rules


def parse_rules(text: str) -> tuple[dict[str, set[str]], set[str]]:
    """({package: packages it may import}, packages any package may import) from the doc's
    "## Packages" bullets: `- **`megarl/NAME`**: ... Imports: a, b (why), c. ...`."""
    section = text.split("\n## Packages", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n- (?=\*\*)", "\n" + section)[1:]
    rules, anyone = {}, set()
    for bullet in bullets:
        name = re.match(r"\*\*`megarl/([^`]+?)/?`\*\*", bullet)
        if name is None:  # launchers/, csrc/: not Python packages of megarl
            continue
        body = " ".join(bullet.split())
        imports = re.search(r"Imports: (.+?)\.(?:\s|$)", body)
        if imports is None:
            continue  # data only (megarl/configs/)
        words = re.sub(r"\([^)]*\)", "", imports.group(1))
        allowed = set()
        if not words.strip().startswith("nothing of megarl"):
            allowed = {w.strip(" `") for w in re.split(r",|\band\b", words) if w.strip(" `")}
        rules[name.group(1)] = allowed
        if "Any package may import it" in body:
            anyone.add(name.group(1))
    return rules, anyone


def package_of(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else ROOT


def megarl_imports(path: Path) -> set[tuple[str, int]]:
    """(top-level megarl package, line) for every import of megarl in the module."""
    rel = path.relative_to(PKG.parent).with_suffix("").parts  # ('megarl', 'data', 'synthetic')
    here = rel[:-1] if rel[-1] != "__init__" else rel  # the module's own package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            modules = [f"{module}.{a.name}" for a in node.names] if module == "megarl" else [module]
        else:
            continue
        for m in modules:
            parts = m.split(".")
            if parts[0] == "megarl" and len(parts) > 1:
                target = parts[1] if (PKG / parts[1]).is_dir() else ROOT
                found.add((target, node.lineno))
    return found


def python_packages() -> set[str]:
    return {p.name for p in PKG.iterdir() if p.is_dir() and any(p.rglob("*.py"))} | {ROOT}


def test_rules_parse_and_cover_every_package():
    rules, anyone = parse_rules(DOC.read_text())
    assert "utils" in anyone and rules["config"] == {"algorithms"} and rules["models"] == {"config", "runtime"}
    assert {"checkpoint", "config", "data", "models", "roles", "runtime", "tracking", "trainers"} <= rules["cli"]
    undocumented = python_packages() - set(rules)
    assert not undocumented, f"packages without an 'Imports:' line in {DOC.name}: {sorted(undocumented)}"
    stale = set(rules) - python_packages()
    assert not stale, f"{DOC.name} has rules for packages that do not exist: {sorted(stale)}"
    for pkg, allowed in rules.items():
        unknown = allowed - python_packages()
        assert not unknown, f"{DOC.name}: megarl/{pkg} may import unknown packages {sorted(unknown)}"


def test_every_module_imports_only_what_the_doc_allows():
    rules, anyone = parse_rules(DOC.read_text())
    violations = []
    for path in sorted(PKG.rglob("*.py")):
        pkg = package_of(path)
        allowed = rules.get(pkg, set()) | anyone | {pkg}
        for target, line in sorted(megarl_imports(path)):
            if target not in allowed:
                violations.append(f"{path.relative_to(REPO)}:{line} imports megarl.{target} "
                                  f"(megarl/{pkg} may import: {', '.join(sorted(allowed - {pkg})) or 'nothing'})")
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("source, expected", [
    ("import megarl.data.synthetic", {"data"}),
    ("from megarl import roles", {"roles"}),
    ("from megarl import __version__", {ROOT}),
    ("def f():\n    from megarl.models.gpt import build\n", {"models"}),  # lazy imports count
    ("from ..config import schema", {"config"}),  # relative, from megarl/data/x.py
    ("from . import errors", {"data"}),
    ("import megarlx\nimport os", set()),
])
def test_import_scanner_sees_every_form(tmp_path, monkeypatch, source, expected):
    fake = tmp_path / "megarl"
    (fake / "data").mkdir(parents=True)
    for pkg in ("config", "roles", "models"):
        (fake / pkg).mkdir()
    module = fake / "data" / "x.py"
    module.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert {t for t, _ in megarl_imports(module)} == expected



def module_imports(path: Path) -> set[str]:
    """The megarl modules (dotted, e.g. 'megarl.trainers.weights') that a module imports, lazy
    ones included; `from megarl.pkg import name` counts as importing megarl.pkg.name when that
    is a module, else megarl.pkg (its __init__)."""
    rel = path.relative_to(PKG.parent).with_suffix("").parts
    here = rel[:-1] if rel[-1] != "__init__" else rel
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            for a in node.names:
                sub = f"{module}.{a.name}"
                is_module = (PKG.parent.joinpath(*sub.split(".")).with_suffix(".py").is_file()
                             or PKG.parent.joinpath(*sub.split("."), "__init__.py").is_file())
                found.add(sub if is_module else module)
    return {m for m in found if m.startswith("megarl.")}


def cycles_within_packages(pkg_root: Path) -> list[list[str]]:
    """Import cycles among the modules of one package (a package's __init__, a facade that
    re-exports its modules, is left out)."""
    modules = {}
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(pkg_root.parent).with_suffix("").parts
        if rel[-1] != "__init__":
            modules[".".join(rel)] = path
    graph = {m: {t for t in module_imports(p) if t in modules and t.rsplit(".", 1)[0] == m.rsplit(".", 1)[0]}
             for m, p in modules.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles_between_modules_of_one_package():
    cycles = cycles_within_packages(PKG)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_sees_a_lazy_cycle(tmp_path, monkeypatch):
    fake = tmp_path / "megarl"
    (fake / "roles").mkdir(parents=True)
    (fake / "roles" / "__init__.py").write_text("")
    (fake / "roles" / "a.py").write_text("from megarl.roles.b import x\n")
    (fake / "roles" / "b.py").write_text("def x():\n    from megarl.roles import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert cycles_within_packages(fake) == [["megarl.roles.a", "megarl.roles.b", "megarl.roles.a"]]
