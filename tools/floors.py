"""The suite at the oldest versions pyproject.toml claims: a venv where every requirement sits at its floor.

pyproject.toml states ranges (`torch>=2.8,<3`, `transformers>=5.17,<6`, ...) so that bridgelm installs beside the
torch a GPU machine already has. This builds a venv with each requirement of the library and its `dev` extra pinned
to its lower bound (`make test-floors`), installs bridgelm into it, and runs the tests there, so that a floor is a
version that was run, not a guess. Transitive packages float (pip picks what the floors allow).

    python tools/floors.py                        # .venv-floors, python3.11, then pytest -m "not slow"
    python tools/floors.py --find-links DIR -- tests/test_engine.py   # wheels already downloaded; some tests

On Linux, PyPI's torch before 2.13 is the CUDA build (about 3.7 GB with its nvidia-* wheels): download it once
(`pip download torch==2.8.0 -d DIR`) and pass `--find-links DIR`. The CUDA build runs on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("dev",)  # the extras the suite imports


def floors(pyproject: Path = ROOT / "pyproject.toml", extras=EXTRAS) -> dict[str, str]:
    """{requirement name: its lower bound} for the library's requirements and `extras`. Every requirement must
    state one (`>=`): a range without a floor claims every version ever released."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    out = {}
    for line in lines:
        req = Requirement(line)
        lows = [s.version for s in req.specifier if s.operator == ">="]
        if len(lows) != 1:
            raise SystemExit(f"floors: {line!r} in {pyproject} states no single lower bound (>=): expected one")
        out[req.name] = lows[0]
    return out


def run(*cmd, env=None) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), check=True, cwd=ROOT, env=env)


def build(venv: Path, python: str, find_links: str | None) -> Path:
    """Create `venv` (when missing) and install bridgelm[dev] with every floor pinned. -> its python."""
    pins = floors()
    venv.mkdir(parents=True, exist_ok=True)
    py = venv / "bin" / "python"
    if not py.exists():
        run(python, "-m", "venv", venv)
    constraints = venv / "floors.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    pip = [py, "-m", "pip", "install", "-q", "-c", constraints] + (["--find-links", find_links] if find_links else [])
    run(*pip, f"torch=={pins['torch']}")  # first: pinned, so nothing later swaps it
    run(*pip, "-e", ".[" + ",".join(EXTRAS) + "]")
    return py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-floors", help="where the venv goes")
    ap.add_argument("--python", default="python3.11", help="the interpreter the venv is made from")
    ap.add_argument("--find-links", help="a folder of wheels already downloaded (torch's CUDA build)")
    ap.add_argument("pytest_args", nargs="*", default=["-m", "not slow", "tests"], help="after --: pytest's")
    args = ap.parse_args()
    py = build(args.venv, args.python, args.find_links)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    show = "import torch, transformers, numpy; print('floors:', torch.__version__, transformers.__version__, numpy.__version__)"
    run(py, "-c", show, env=env)
    sys.exit(subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args],
                            cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
