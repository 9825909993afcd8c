"""What the connector's scheduler side tells its worker side each step (KvtConnectorMetadata) and
what the workers answer (KvtWorkerMetadata): typed records, pickled across vLLM's processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                                 KVConnectorWorkerMetadata)


@dataclass
class Gate:
    """kvtd's quality-gate verdict on the pair a lookup offered."""
    passed: bool
    mapper_quality: float
    input_shift_score: Optional[float] = None

    def as_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"passed": self.passed, "mapper_quality": self.mapper_quality}
        if self.input_shift_score is not None:
            out["input_shift_score"] = self.input_shift_score
        return out


@dataclass
class LoadSpec:
    """One translated prefix to load: kvtd's lease, translated into tokens [start, end) of the
    request's blocks."""
    req_id: str
    lease_id: str
    mapper_id: str
    matched_tokens: int          # tokens the lease covers (the translation's length)
    dtype: str                   # the source entry's dtype
    start: int                   # first token to write (the engine's own prefix-cache hit)
    end: int                     # one past the last token to write (whole vLLM blocks)
    load: str                    # the request's load option (auto, region, inline)
    source_model: str
    gate: Gate
    block_ids: List[int] = field(default_factory=list)


@dataclass
class PublishSpec:
    """Tokens [0, len(token_ids)) of a request, in `block_ids`, to publish as this model's KV.
    `final`: published when the request ended (prompt + generated), its blocks held by vLLM
    until the worker reports the request in finished_sending."""
    req_id: str
    final: bool
    token_ids: List[int]
    block_ids: List[int]

    @property
    def kind(self) -> str:
        return "final" if self.final else "prompt"


@dataclass
class KvtConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    publishes: List[PublishSpec] = field(default_factory=list)
    # Finished requests whose blocks vLLM holds for the connector: the worker reports each in
    # finished_sending once no publish of it reads its blocks any more.
    releases: List[str] = field(default_factory=list)
    # Requests preempted in this step: their blocks may be reused from this step on, so the
    # worker finishes their publishes before the step writes any block.
    fence: List[str] = field(default_factory=list)
    # The step computes no tokens (only connector work): the worker may wait for loads.
    idle: bool = False


@dataclass
class LoadResult:
    """How one translated load ended (the worker's answer to a LoadSpec)."""
    ok: bool
    error: str = ""
    transport: str = "inline"
    translate_ms: float = 0.0
    load_ms: float = 0.0
    kvtd_total_ms: float = 0.0
    kvtd_compute_ms: float = 0.0
    input_shift_score: Optional[float] = None


@dataclass
class KvtWorkerMetadata(KVConnectorWorkerMetadata):
    loads: Dict[str, LoadResult] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvtWorkerMetadata":
        assert isinstance(other, KvtWorkerMetadata)
        for req_id, result in other.loads.items():
            mine = self.loads.get(req_id)
            if mine is None or (mine.ok and not result.ok):
                self.loads[req_id] = result  # a failure on any worker fails the load
        return self
