"""The one door through which scripts, benchmarks and tests run vLLM engines.

  engine.py    EngineSpec -> open_engine -> Engine: an in-process vLLM `LLM` built from the flags
               `proxima serve` would give the server (token, block or stock), with a recorder
  recorder.py  EngineRecorder: a KV telemetry sink keeping every step, preemption and KV figure
  process.py   EngineProcess / run_isolated: engines in child processes (one attention registry
               per process; clean measurements)
  tiles.py     measurement only: how often the KV tiles attention reads are contiguous

    with open_engine(EngineSpec(model, "token", vllm_flags(kv_cache_memory_bytes=8 << 20))) as engine:
        engine.llm.generate(prompts, params)
        engine.recorder.running_mean(), engine.recorder.preemptions

Layer: tools, outside `proxima.engine` (it builds engines, it does not run inside them); nothing
here changes vLLM: what it records arrives through the scheduler's sinks.
"""

from proxima.harness.engine import (
    TINY_CPU_ARGS,
    Engine,
    EngineSpec,
    HarnessError,
    open_engine,
    registry_of,
    vllm_flags,
)
from proxima.harness.process import EngineProcess, EngineProcessError, run_isolated
from proxima.harness.recorder import EngineRecorder, StepRecord

__all__ = ["TINY_CPU_ARGS", "Engine", "EngineProcess", "EngineProcessError", "EngineRecorder",
           "EngineSpec", "HarnessError", "StepRecord", "open_engine", "registry_of", "run_isolated",
           "vllm_flags"]
