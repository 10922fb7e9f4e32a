"""e2e.py --profile's host timer (scripts/gpu/kit/profiling.py) beside cProfile, as the job runs them.

sys.monitoring is Python 3.12+: on 3.11 (this CI) the test skips; the GPU machine's 3.12 runs it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is Python 3.12+")

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "kit" / "profiling.py"
_spec = importlib.util.spec_from_file_location("kit_profiling", _PATH)
profiling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profiling)


def work(n: int) -> int:
    return sum(range(n))


def test_the_host_timer_leaves_cprofile_its_tool_id_and_both_see_the_calls():
    timer = profiling.HostTimer()
    try:
        timer.watch(work, "work")
        report = profiling.host_profile(lambda: [work(1000) for _ in range(7)])
        assert "work" in report  # cProfile ran while the timer was open
        assert timer.calls == {"work": 7}
        assert timer.seconds["work"] > 0
    finally:
        timer.close()
    assert sys.monitoring.get_tool(sys.monitoring.PROFILER_ID) is None
