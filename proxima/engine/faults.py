"""Test-only fault injection, reachable only behind an explicit switch.

`PROXIMA_FAULT_LEAK_SLOTS=N` makes the slot manager lose N slots per freed request, so that tests
can show `proxima doctor`'s leak probe catching a real leak. It is honoured only together with
`PROXIMA_ENABLE_TEST_FAULTS=1`; set alone (a leftover in a production environment) it is ignored
with an error line, and a value that is not a positive integer is refused naming the variable.
"""

from __future__ import annotations

import logging
import os

from proxima.engine.settings import ProximaConfigError

logger = logging.getLogger(f"vllm.{__name__}")

LEAK_ENV = "PROXIMA_FAULT_LEAK_SLOTS"
ENABLE_ENV = "PROXIMA_ENABLE_TEST_FAULTS"


def leak_per_free_from_env() -> int:
    raw = os.environ.get(LEAK_ENV, "").strip()
    if not raw:
        return 0
    if os.environ.get(ENABLE_ENV) != "1":
        logger.error("Proxima: %s=%s ignored: it is a test-only fault; set %s=1 to inject it, "
                     "or unset it", LEAK_ENV, raw, ENABLE_ENV)
        return 0
    try:
        leak = int(raw)
    except ValueError:
        leak = 0
    if leak <= 0:
        raise ProximaConfigError(f"{LEAK_ENV}={raw!r} is not a positive number of slots; unset it")
    logger.warning("Proxima: TEST FAULT: leaking %d KV slots per freed request (%s=1, %s)",
                   leak, ENABLE_ENV, LEAK_ENV)
    return leak
