"""The built wheel's metadata, and the error a feature gives when its extra is not installed.

The wheel is built offline from a copy of the sources (``python -m build --wheel --no-isolation``:
the build backend of the running environment, no download, nothing written into the checkout).
"""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hf_galore_plugin
from hf_galore_plugin import utils

REPO = Path(__file__).resolve().parent.parent
OPTIONAL = ("deepspeed", "peft", "triton")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hf_galore_plugin", src / "hf_galore_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    out = src / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (member,) = [m for m in wheel.namelist() if m.endswith(f".dist-info/{name}")]
    return wheel.read(member).decode()


def _requirement_name(requirement: str) -> str:
    name = requirement.split(";")[0]
    for stop in "<>=![ (~":
        name = name.split(stop)[0]
    return name.strip().lower()


def test_required_dependencies_name_no_optional_package(wheel):
    metadata = email.parser.Parser().parsestr(_dist_info(wheel, "METADATA"))
    required = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    names = {_requirement_name(r) for r in required}
    assert names == {"torch", "transformers", "accelerate"}, required


def test_each_optional_package_is_an_extra_and_all_gathers_them(wheel):
    metadata = email.parser.Parser().parsestr(_dist_info(wheel, "METADATA"))
    extras = set(metadata.get_all("Provides-Extra"))
    assert {*OPTIONAL, "all", "dev"} <= extras
    by_extra: dict[str, set[str]] = {}
    for requirement in metadata.get_all("Requires-Dist"):
        if "extra ==" in requirement:
            extra = requirement.rsplit("extra ==", 1)[1].strip().strip("\"'")
            by_extra.setdefault(extra, set()).add(requirement.split(";")[0].strip())
    for package in OPTIONAL:
        assert {_requirement_name(r) for r in by_extra[package]} == {package}
    assert by_extra["all"] == {"hf-galore-plugin[deepspeed,peft,triton]"}
    assert "hf-galore-plugin[all]" in by_extra["dev"]  # the test environment installs every extra


def test_version_license_and_entry_points(wheel):
    metadata = email.parser.Parser().parsestr(_dist_info(wheel, "METADATA"))
    assert metadata["Name"] == "hf-galore-plugin"
    assert metadata["Version"] == hf_galore_plugin.__version__  # one version source
    assert metadata["License-Expression"] == "Apache-2.0"
    entry_points = _dist_info(wheel, "entry_points.txt")
    assert "[hf_galore_plugin.optimizers]" in entry_points
    presets = {
        line.split("=")[0].strip(): line.split("=")[1].strip() for line in entry_points.splitlines() if "=" in line
    }
    assert presets == {name: f"hf_galore_plugin.presets:{name}" for name in hf_galore_plugin.PRESETS}


def test_wheel_holds_every_module_of_the_package_and_nothing_else(wheel):
    packaged = {n for n in wheel.namelist() if n.endswith(".py")}
    source = {p.relative_to(REPO).as_posix() for p in (REPO / "hf_galore_plugin").rglob("*.py")}
    assert packaged == source


@pytest.mark.parametrize("package", OPTIONAL)
def test_a_missing_extra_is_named_in_the_error(monkeypatch, package):
    monkeypatch.setattr(utils, "is_package_available", lambda name: name != package)
    with pytest.raises(ImportError, match=rf"needs {package}.*pip install 'hf-galore-plugin\[{package}\]'"):
        utils.require(package, feature="this feature")


def test_deepspeed_features_name_the_deepspeed_extra(monkeypatch):
    from hf_galore_plugin.engines.deepspeed import import_deepspeed

    monkeypatch.setattr(utils, "is_package_available", lambda name: name != "deepspeed")
    with pytest.raises(ImportError, match=r"prepare_zero3_model needs deepspeed.*\[deepspeed\]"):
        import_deepspeed("prepare_zero3_model")


def test_require_refuses_a_package_that_is_not_an_extra():
    with pytest.raises(ValueError, match="'numpy' is not an optional dependency"):
        utils.require("numpy", feature="x")
