"""Services meet only through events: no service imports another (engine and common are libraries)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parent.parent / "services"
SHARED = {"engine", "common"}


def _imported_services(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_no_service_imports_another() -> None:
    services = [p for p in SERVICES.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert {"ingress", "planner", "kv_indexer", "worker"} <= {
        p.name for p in services
    }
    offences = []
    for service in services:
        for module in service.rglob("*.py"):
            for other in _imported_services(module) - SHARED - {service.name}:
                offences.append(f"{module.relative_to(SERVICES)} imports services.{other}")
    assert offences == []


def test_the_engine_package_imports_no_service() -> None:
    for module in (SERVICES / "engine").rglob("*.py"):
        assert _imported_services(module) <= SHARED, module
