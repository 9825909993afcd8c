"""Keeps a CPU engine's core binding what it is without a KV connector.

vLLM's CPU backend binds each worker's OpenMP threads to cores and reserves cores for the rest
of the engine: one per local rank for the scheduler process, which busy-waits on its queues, and
one more per rank whenever *any* KV connector is configured (vllm/utils/ompmultiprocessing.py:
"reserve at one more core for nixl_connector under p/d case"). KvtConnector needs no core of
its own: its threads wait on kvtd almost all the time. The extra reservation costs a plain
engine one OpenMP thread of compute; on a machine where it reserves every core, vLLM drops the
reservation altogether and the scheduler's busy wait then shares the model's cores, which
measured 4-18x slower requests on 2 cores (docs/VLLM.md, "What the connector costs").

vLLM reads the reservation from VLLM_CPU_NUM_OF_RESERVED_CPU when set, in the engine-core
process, which inherits this process's environment. vLLM imports this package while it
validates the engine's configuration, before it starts that process, and offers connectors no
hook with the configuration before the workers bind their cores; so the value is set at import,
from the configuration being validated. A value the user set is never changed.
"""

from __future__ import annotations

import logging
import os
import sys
from types import FrameType
from typing import Any, Optional

logger = logging.getLogger("vllm.kvt")

ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def plain_reservation(local_world_size: int, machine: str) -> int:
    """Cores vLLM reserves on a CPU engine without a KV connector (vLLM 0.32)."""
    if machine in ("x86_64", "amd64", "aarch64", "arm64") or machine.startswith("riscv"):
        return local_world_size
    return 1


def keep_plain_reservation() -> Optional[int]:
    """Sets VLLM_CPU_NUM_OF_RESERVED_CPU to the plain engine's reservation when vLLM runs on
    CPU, the user left it unset and the configuration being validated is found; returns the
    value set, or None."""
    if ENV in os.environ:
        return None
    config = _config_being_validated()
    if config is None or not _is_cpu():
        return None
    try:
        local = max(1, int(config.parallel_config.local_world_size))
    except Exception:  # not derivable yet: the common single-rank engine
        local = 1
    import platform
    value = plain_reservation(local, platform.machine().lower())
    os.environ[ENV] = str(value)
    logger.info("kvt: %s=%d (the cores a CPU engine reserves without a KV connector; "
                "KvtConnector needs none of its own)", ENV, value)
    return value


def _config_being_validated() -> Any:
    """The VllmConfig whose validation imported this package (a caller's `self`), or None."""
    try:
        from vllm.config import VllmConfig
    except Exception:
        return None
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back
    return None


def _is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except Exception:
        return False
