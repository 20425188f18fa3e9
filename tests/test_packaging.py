"""The package list is complete, and a built wheel holds ssmspec.trees / .training / .cli."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"trees": "ssmspec.trees", "training": "ssmspec.training", "cli": "ssmspec.cli"}


def source_packages() -> set[str]:
    found = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        top = rel.parts[0]
        if top == "ssmspec":
            found.add(".".join(rel.parts))
        elif top in MAPPED:
            found.add(".".join((MAPPED[top], *rel.parts[1:])))
    return found


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert source_packages() == listed


def test_wheel_installs_everything_inside_the_ssmspec_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next(tmp_path.glob("ssmspec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"ssmspec"}, tops  # one name added to site-packages
    for pkg in source_packages():
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg


def test_editable_install_imports_the_mapped_packages():
    code = "import ssmspec.trees, ssmspec.training, ssmspec.cli, ssmspec.models, ssmspec.decoding; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "ok", out.stderr
