"""The architecture, checked from the source: services meet only through events, the libraries
and the pure cores know nothing of the broker or etcd, and no module grows past one job's size.

The sets come from the filesystem: every package under services/ is a service except the
libraries ``engine`` and ``common``, so a new service is covered the day it appears."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections import deque
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
LIBRARIES = frozenset({"engine", "common"})
BROKER = frozenset({"bus", "nats", "aetcd", "faststream"})
# The pure cores: policies, decision, capacity planner and cluster view, every engine with its
# scheduler, the shared libraries (the prefix index among them), and the event schemas.
CORE_FILES = [
    *(f"services/planner/{name}.py" for name in ("policy", "kv_policy", "disagg", "decision")),
    *(
        f"services/planner/{name}.py"
        for name in ("capacity", "cluster", "replay", "policy_registry")
    ),
]
CORE_TREES = ["services/engine", "services/common", "schemas"]
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _repo_modules() -> dict[str, Path]:
    """Every importable module of the repository (top-level packages except the tests)."""
    packages = [p for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests"]
    return {_module_name(path): path for pkg in packages for path in pkg.rglob("*.py")}


@cache
def _imports(path: Path) -> frozenset[str]:
    """Absolute names of what a file imports anywhere (function-local and type-only imports
    too): ``from a import b`` yields ``a`` and ``a.b``, as ``b`` may be a module."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*base_parts, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(names)


def _executed(name: str) -> list[str]:
    """Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _broker_chains(start: str) -> list[str]:
    """Each way ``start`` reaches broker or etcd code through the repository's own imports."""
    modules = _repo_modules()
    came_from: dict[str, str | None] = {m: None for m in _executed(start) if m in modules}
    queue = deque(came_from)
    chains = []
    while queue:
        name = queue.popleft()
        imports = _imports(modules[name])
        for broker in sorted({i.split(".")[0] for i in imports} & BROKER):
            chain = [name]
            while (parent := came_from[chain[-1]]) is not None:
                chain.append(parent)
            first = min(i for i in imports if i.split(".")[0] == broker)
            chains.append(" -> ".join([*reversed(chain), first]))
        for imported in sorted(imports):
            if imported.split(".")[0] in BROKER:
                continue
            for step in _executed(imported):
                if step in modules and step not in came_from:
                    came_from[step] = name
                    queue.append(step)
    return chains


def _packages(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if (p / "__init__.py").exists())


def _services() -> list[Path]:
    return [p for p in _packages(SERVICES) if p.name not in LIBRARIES]


def _services_imported(path: Path) -> set[str]:
    return {
        name.split(".")[1]
        for name in _imports(path)
        if name.startswith("services.") and (SERVICES / name.split(".")[1]).is_dir()
    }


def test_libraries_and_services_are_found() -> None:
    assert {p.name for p in _packages(SERVICES)} >= LIBRARIES
    assert _services(), "no service package under services/"


def test_no_service_imports_another() -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports services.{other}"
        for service in _services()
        for path in sorted(service.rglob("*.py"))
        for other in sorted(_services_imported(path) - LIBRARIES - {service.name})
    ]
    assert offences == []


def test_the_libraries_import_no_service_and_no_broker() -> None:
    offences = []
    for library in sorted(LIBRARIES):
        for path in sorted((SERVICES / library).rglob("*.py")):
            for name in sorted(_imports(path)):
                parts = name.split(".")
                imported_service = (
                    parts[0] == "services" and parts[1:2] != [] and (parts[1] not in LIBRARIES)
                )
                if parts[0] in BROKER or imported_service:
                    offences.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offences == []


def test_the_bus_imports_no_service() -> None:
    """The bus is below the services: what they share with it (the KV fold's source, say) is
    a protocol of theirs that the bus implements, not service code it imports."""
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "bus").rglob("*.py"))
        for name in sorted(_imports(path))
        if name.split(".")[0] == "services"
    ]
    assert offences == []


def test_the_product_imports_no_benchmark() -> None:
    """Probes and profilers (``benchmarks/``) stay out of the wheel: nothing that ships imports
    them, or an installed Laneway would fail on a module it does not have."""
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = [name.rstrip("*") for name in shipped["packages"]["find"]["include"]]
    assert "benchmarks" not in packages
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(_imports(path))
        if name.split(".")[0] == "benchmarks"
    ]
    assert offences == []


def _core_modules() -> list[str]:
    paths = [ROOT / f for f in CORE_FILES]
    missing = [str(p.relative_to(ROOT)) for p in paths if not p.exists()]
    assert missing == [], "a pure core moved: say where in CORE_FILES"
    paths += [path for tree in CORE_TREES for path in sorted((ROOT / tree).rglob("*.py"))]
    return [_module_name(path) for path in paths]


def test_the_pure_cores_reach_no_broker_code_even_indirectly() -> None:
    chains = [chain for module in _core_modules() for chain in _broker_chains(module)]
    assert chains == []


def _strictly_typed(module: str, patterns: list[str]) -> bool:
    """As mypy reads an override's modules: ``a.*`` is ``a`` and everything under it."""
    return any(
        module == pattern.removesuffix(".*")
        or (pattern.endswith(".*") and module.startswith(pattern[:-1]))
        for pattern in patterns
    )


def test_mypy_is_strict_on_every_pure_core() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    patterns = [
        module
        for override in config.get("overrides", [])
        if override.get("strict")
        for module in override["module"]
    ]
    assert [m for m in _core_modules() if not _strictly_typed(m, patterns)] == []


def test_the_tokenizers_and_the_services_but_the_worker_import_without_torch() -> None:
    """Torch takes seconds to import: only a worker running the torch engine pays for it."""
    modules = ["services.common.tokenizer", "services.common.hf_tokenizer"]
    modules += [
        f"services.{p.name}.main"
        for p in _services()
        if p.name != "worker" and (p / "main.py").exists()
    ]
    code = f"import sys\nimport {', '.join(modules)}\nprint('torch' in sys.modules)"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_every_module_is_under_400_lines() -> None:
    """Tests aside, a module longer than this has more than one job."""
    lengths = {
        path.relative_to(ROOT): len(path.read_text().splitlines())
        for top in ROOT.iterdir()
        if top.is_dir() and not top.name.startswith(".") and top.name != "tests"
        and not (top / "pyvenv.cfg").exists()
        for path in top.rglob("*.py")
    }  # fmt: skip
    assert lengths, "no modules found"
    offenders = sorted(f"{path}: {n} lines" for path, n in lengths.items() if n >= MAX_LINES)
    assert offenders == []


def _shared_test_module(name: str) -> str | None:
    """The test module or conftest an import reaches into, if it does."""
    parts = name.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part == "conftest" or part.startswith("test_"):
            return ".".join(parts[: i + 1])
    return None


def test_tests_share_helpers_not_test_modules_or_conftest() -> None:
    """What tests share lives in helper modules; a test module imported elsewhere is a test
    module doing two jobs, and conftest is pytest's to load."""
    offences = sorted(
        {
            f"{path.relative_to(ROOT)} imports {module}"
            for path in (ROOT / "tests").rglob("*.py")
            for name in _imports(path)
            if name.startswith("tests.") and (module := _shared_test_module(name))
        }
    )
    assert offences == []


def test_the_cli_starts_without_the_benchmarks() -> None:
    """`laneway up` and the other product commands load no benchmark, simulator harness or
    plotting: each command's module is imported only when that command runs."""
    code = (
        "import sys\nimport infra.cli\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'matplotlib')"
        " or m.startswith('infra.bench')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
