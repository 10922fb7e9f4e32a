"""The GPU benchmarks' library; the scripts beside this folder only parse arguments and call it.

  cases.py        the shapes measured (decode grids, MIXED steps) and the batches built for them
  layouts.py      one set of KV tokens as vLLM's paged blocks and as Proxima's slots
  calls.py        the call tables: each attention implementation on a batch, as vLLM runs it
  timers.py       GPU time eager and under CUDA-graph replay, host enqueue time, copy bandwidth
  profiling.py    where an engine step's time goes (host timer, kernel profile, cProfile)
  decode.py, mixed.py, fp8.py, pth.py, sweeps.py    the kernel benches and sweeps (pth: per-token-head KV)
  ratio_guard.py  the attention regression guard over Proxima/FA3 ratios
  e2e.py, e2e_report.py                     engines end to end, through proxima.harness

Imported as `kit` with scripts/gpu on sys.path (as when a script there runs).
"""
