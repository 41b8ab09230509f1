"""The library's requirements are ranges (pyproject.toml); the reproducible environment of `make venv`, CI and the
demo is exact (constraints.txt). Every requirement, extras included, has a pin there that satisfies its range."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return [Requirement(line) for line in lines]


def _pins(name: str = "constraints.txt") -> dict[str, Version]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # exactly one clause, ==X
        assert spec.operator == "==", f"{name}: {line!r} is not an exact pin"
        assert canonicalize_name(req.name) not in pins, f"{name} pins {req.name} twice"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def test_requirements_are_ranges_not_pins():
    for req in _requirements():
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{req} pins the library's users"
        assert any(s.operator == ">=" for s in req.specifier), f"{req} states no oldest version"


def test_every_requirement_is_pinned_within_its_range():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {req}"


def test_python_range_and_the_makefile_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python = SpecifierSet(project["requires-python"])
    assert all(v in python for v in ("3.11.0", "3.12.4", "3.13.1")) and "3.14.0" not in python
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = f"torch=={_pins()['torch']}"
    assert torch_pin in makefile, f"the Makefile installs a torch other than constraints.txt's {torch_pin}"
    assert makefile.count("-c constraints.txt") >= 3  # torch, the project, the GGUF weights


def test_lightevals_environment_differs_from_ours_only_where_lighteval_moves_a_package():
    """make test-lighteval: our pins, then lighteval's second step, which moves the packages docs/tasks.md names."""
    ours, theirs = _pins(), _pins("constraints-lighteval.txt")
    moved = {name for name in ours.keys() & theirs.keys() if ours[name] != theirs[name]}
    assert moved == {"latex2sympy2-extended", "fsspec", "nltk", "xxhash"}, moved
    assert theirs["lighteval"] == Version("0.13.0") and theirs["xxhash"] < Version("4")
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints-lighteval.txt lighteval 'xxhash<4'" in makefile
    assert "make test-lighteval" in (ROOT / ".ci" / "run").read_text()


def test_the_floors_venv_pins_every_requirement_at_its_floor_and_the_readme_says_the_same():
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("floors", ROOT / "tools" / "floors.py")
    floors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floors)
    pins = floors.floors()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        (low,) = [s.version for s in req.specifier if s.operator == ">="]
        assert pins[req.name] == low, f"tools/floors.py pins {req.name}=={pins[req.name]}, not its floor {low}"
    readme = (ROOT / "README.md").read_text()
    for name in ("torch", "transformers"):
        said = re.search(rf"{name} \(>= ([0-9.]+)\)", readme)
        assert said and Version(said.group(1)) == Version(pins[name]), f"README's {name} floor is not pyproject's"
