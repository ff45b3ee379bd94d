"""What produced a run or a report: the kvhive commit and the versions of the packages behind the
numbers (a report states both, so a reader can tell which code a verdict comes from)."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "numpy", "rouge-score")


def _git(source: Path, *arguments: str) -> str:
    return subprocess.run(
        ["git", "-C", str(source), *arguments], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def kvhive_commit() -> str:
    """The short commit of the kvhive source tree, with ``-dirty`` when files of the ``kvhive``
    package differ from it (results and reports written beside the code do not count), or
    "unknown" (an installed copy outside a git checkout)."""
    package = Path(__file__).resolve().parents[1]
    try:
        commit = _git(package, "rev-parse", "--short=7", "HEAD")
        changed = _git(package, "status", "--porcelain", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("-dirty" if changed else "")) if commit else "unknown"


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
