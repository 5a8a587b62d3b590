"""The container image (deploy/Containerfile) cannot be built here (no container runtime): what
can drift from the rest of the repository is checked instead, as text."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
CONTAINERFILE = (ROOT / "deploy" / "Containerfile").read_text()


def test_the_image_pins_the_makefiles_torch() -> None:
    pins = re.findall(r"torch==([\w.]+)", (ROOT / "Makefile").read_text())
    assert pins and re.findall(r"torch==([\w.]+)", CONTAINERFILE) == pins[:1]


def test_the_image_copies_every_package_the_project_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) ", CONTAINERFILE, flags=re.MULTILINE))
    assert packages <= copied
    assert re.search(r"^COPY pyproject.toml README.md ", CONTAINERFILE, flags=re.MULTILINE)


def test_the_image_runs_as_the_manifests_user() -> None:
    defaults = yaml.safe_load(
        (ROOT / "deploy" / "k8s" / "base" / "service-defaults.yaml").read_text()
    )
    context = defaults["spec"]["template"]["spec"]["securityContext"]
    user = f"{context['runAsUser']}:{context['runAsGroup']}"
    assert re.findall(r"^USER (\S+)$", CONTAINERFILE, flags=re.MULTILINE) == [user]
