"""The packages' import graph points downward only.

The layering is what lets the scheduler core be tested in milliseconds and
run unchanged in the simulator, the engine run without Ray on a GPU box,
and the studies stay out of the product: each package may import only the
packages below it (docs/structures.md, "Packages").  Every import counts,
lazy ones inside functions included: an upward import deferred to call time
is still an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Our packages, and which of them (and which heavy third-party packages)
# each may import.  Anything of ours not listed is an upward or sideways
# import.
OURS = {"scheduler", "engine", "kvstore", "api", "deployments", "app", "workloads",
        "predictor", "bench", "batch", "studies", "tests"}
ALLOWED: dict[str, set[str]] = {
    "scheduler": set(),
    "engine": {"scheduler"},
    "kvstore": {"scheduler", "engine"},
    "api": {"scheduler", "engine"},
    "workloads": {"engine"},
    # scheduler: the allocation a predicted length is padded to, scored by
    # the predictor's metrics as the scheduler makes it.
    "predictor": {"workloads", "engine", "scheduler"},
    "bench": {"workloads", "scheduler", "engine", "kvstore"},
    # Batch files, their Ray Jobs and the /v1/files and /v1/batches routes:
    # wire shapes and HTTP checks from api, nothing of the engines.
    "batch": {"api"},
    "deployments": {"api", "scheduler", "engine", "kvstore", "predictor", "batch"},
    # The composition root: builds the application, and its command line
    # dispatches to bench's and predictor's.
    "app": {"api", "deployments", "scheduler", "engine", "kvstore", "predictor", "bench",
            "batch"},
}
# Third-party packages a layer must not need: the scheduler core runs in the
# simulator and in millisecond tests; the engine runs where Ray is absent.
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "scheduler": {"ray", "torch", "transformers", "numpy", "pydantic_settings"},
    "engine": {"ray"},
    "workloads": {"ray", "torch"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_imports(package: str) -> dict[str, set[str]]:
    """Module path -> top-level packages it imports."""
    return {str(f.relative_to(ROOT)): imported_top_levels(f)
            for f in sorted((ROOT / package).rglob("*.py"))}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downward(package: str) -> None:
    assert (ROOT / package / "__init__.py").exists(), f"{package}/ is not a package"
    bad = {}
    for module, names in package_imports(package).items():
        upward = (names & OURS) - ALLOWED[package] - {package}
        banned = names & FORBIDDEN_THIRD_PARTY.get(package, set())
        if upward | banned:
            bad[module] = sorted(upward | banned)
    assert not bad, f"{package}/ imports what it must not: {bad}"


def test_every_package_is_layered() -> None:
    """A new top-level package gets a place in the layering."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"studies", "tests"} == set(ALLOWED)


def test_the_wheel_carries_no_study() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = pyproject.split("[tool.setuptools.packages.find]", 1)[1].split("\n\n", 1)[0]
    assert "studies" not in include and "tests" not in include
    for package in ALLOWED:
        assert f'"{package}*"' in include, f"{package} is missing from the wheel"


def test_checker_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from deployments.engine import X\n    import ray.util\n")
    assert imported_top_levels(module) == {"deployments", "ray"}
