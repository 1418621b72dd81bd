"""The layer rules (docs/architecture.md), checked on every module's imports.

Each layer imports only layers below it; the services see the mesh through
``meshd.mesh``; only the composition root (``meshd/daemon.py``) and the CLI
import both.  Imports inside functions count as much as those at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("meshd", "dashboard")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    return _imports_as(path, _module_name(path))


def _imports_as(path: Path, module: str) -> set[str]:
    """Every module ``path`` (module ``module``) imports, relative imports made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
    return out


def _modules() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _importing(prefix: str) -> set[str]:
    """Modules that import ``prefix`` or anything under it."""
    return {m for m, imported in MODULES.items()
            if any(i == prefix or i.startswith(prefix + ".") for i in imported)}


def _under(prefix: str) -> set[str]:
    return {m for m in MODULES if m == prefix or m.startswith(prefix + ".")}


TESTING = _under("meshd.testing")  # test support: may reach anywhere, and nothing product reaches it


def test_the_rules_see_every_layer():
    for must in ("meshd.swim.core", "meshd.wire", "meshd.node", "meshd.daemon", "meshd.pipeline.service",
                 "dashboard.app", "meshd.net.channel", "meshd.relay.server"):
        assert must in MODULES


def test_the_membership_core_is_sans_io_and_imports_nothing_above_it(modules=MODULES):
    allowed = ("meshd.swim", "meshd.wire", "meshd.identity")
    for module in (m for m in modules if m.startswith("meshd.swim")):
        for imported in modules[module]:
            assert not imported.startswith("trio"), f"{module} imports {imported}"
            if imported.startswith(("meshd", "dashboard")):
                assert imported.startswith(allowed), f"{module} imports {imported}"


def test_the_wire_imports_nothing_of_the_project_but_identity():
    for imported in MODULES["meshd.wire"]:
        if imported.startswith(("meshd", "dashboard")):
            assert imported.startswith("meshd.identity"), f"meshd.wire imports {imported}"


@pytest.mark.parametrize("service", ["dashboard", "meshd.pipeline.service"])
def test_only_the_composition_root_and_the_cli_import_the_services(service):
    importers = _importing(service) - _under(service) - TESTING
    if service == "meshd.pipeline.service":
        importers -= _under("meshd.pipeline")
    assert importers <= {"meshd.daemon", "meshd.cli"}, importers


def test_the_mesh_runtime_knows_no_service():
    for module in (*_under("meshd.net"), *_under("meshd.relay"), "meshd.node", "meshd.mesh"):
        for imported in MODULES[module]:
            assert not imported.startswith(("dashboard", "meshd.pipeline", "meshd.daemon", "meshd.launch")), \
                f"{module} imports {imported}"


def test_the_pipeline_never_imports_the_dashboard_nor_the_runtime():
    for module in _under("meshd.pipeline"):
        for imported in MODULES[module]:
            assert not imported.startswith(("dashboard", "meshd.node", "meshd.net", "meshd.daemon")), \
                f"{module} imports {imported}"


def test_the_dashboard_reaches_the_node_only_through_the_mesh_interface():
    for module in _under("dashboard"):
        for imported in MODULES[module]:
            forbidden = ("meshd.node", "meshd.pipeline.service", "meshd.swim", "meshd.daemon")
            assert not imported.startswith(forbidden), f"{module} imports {imported}"


def test_product_code_never_imports_the_test_support():
    for module in set(MODULES) - TESTING:
        for imported in MODULES[module]:
            assert not imported.startswith("meshd.testing"), f"{module} imports {imported}"


def test_a_broken_rule_is_caught(tmp_path):
    """The checker itself: a core module that imports trio and a service is caught."""
    (tmp_path / "bad.py").write_text("import trio\nfrom ..pipeline import service\n")
    imported = _imports_as(tmp_path / "bad.py", "meshd.swim.bad")
    assert imported >= {"trio", "meshd.pipeline", "meshd.pipeline.service"}
    with pytest.raises(AssertionError, match="meshd.swim.bad imports"):
        test_the_membership_core_is_sans_io_and_imports_nothing_above_it({"meshd.swim.bad": imported})
