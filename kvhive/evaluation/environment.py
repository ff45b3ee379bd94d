"""What produced a run or a report: the kvhive commit and the versions of the packages behind the
numbers (a report states both, so a reader can tell which code a verdict comes from)."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "numpy", "rouge-score")


def kvhive_commit() -> str:
    """``git describe --always --dirty`` of the kvhive source tree, or "unknown" (an installed
    copy outside a git checkout)."""
    source = Path(__file__).resolve().parents[2]
    try:
        described = subprocess.run(
            ["git", "-C", str(source), "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return described or "unknown"


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def run_environment() -> dict:
    """``{"kvhive_commit": ..., "versions": {...}}`` for a run's ``run_config.json``."""
    return {"kvhive_commit": kvhive_commit(), "versions": package_versions()}


def versions_text(versions: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


__all__ = ["kvhive_commit", "package_versions", "run_environment", "versions_text"]
