"""How often the KV tiles attention reads are one ascending run of slots (measurement only).

Layer: tools; pure numpy but for `ContextTiles`, which reads an in-process engine's slot table.
A dense-tile kernel path (attention/triton_dense_kv.py) pays only where tiles are contiguous;
scripts/bench_capacity.py and scripts/gpu/e2e.py count how often they are, step by step.
"""

from __future__ import annotations

from proxima.engine.slot_table import DenseTileTally
from proxima.metrics.sink import SchedulerStep


class ContextTiles:
    """A step listener (`Engine.listening`) of an engine with token slots: each step, the
    contiguous tiles of every running request's context (each step reads them all) and of the
    contexts being prefilled (more than one token scheduled). It reads slot lists, milliseconds a
    step on a large batch: keep it out of timed runs."""

    def __init__(self, engine) -> None:
        self._scheduler = engine.scheduler
        self._table = engine.kv_manager.table
        self.running = DenseTileTally()
        self.prefilled = DenseTileTally("prefill_dense_tiles")

    def __call__(self, step: SchedulerStep) -> None:
        self.running.add(self._table, (r.request_id for r in self._scheduler.running))
        self.prefilled.add(self._table, (rid for rid, n in step.num_scheduled_tokens.items() if n > 1))

    def shares(self) -> dict[str, float]:
        return self.running.shares() | self.prefilled.shares()
