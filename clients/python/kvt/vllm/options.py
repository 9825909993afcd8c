"""The connector's settings: the engine-wide kv_connector_extra_config (ConnectorConfig) and each
request's kv_transfer_params["kvt"] (RequestOptions), both validated with the key named."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

POLICIES = ("auto", "forbid", "force")
# How a request's translated prefix reaches its blocks: "auto" (in place when the engine's
# cache is shared, else the load region, else inline), "region" (never in place), "inline".
LOADS = ("auto", "region", "inline")
TRANSPORTS = ("auto", "shm", "inline")


@dataclass(frozen=True)
class ConnectorConfig:
    """kv_connector_extra_config; docs/VLLM.md lists every key."""
    kvtd_address: str                   # required: "host:port" or "unix:/path"
    model_name: str                     # required: the model's name in mapper manifests
    lookup_timeout_s: float = 0.5       # LookupPrefix deadline
    lookup_wait_s: float = 0.005        # how long the scheduler waits for a lookup in line
    # Read kvtd's published-prefix digest (shared memory, same host) and skip LookupPrefix for a
    # prompt whose first block no stored prefix starts with: a certain miss costs no RPC.
    lookup_digest: bool = True
    translate_timeout_s: float = 10.0   # TranslateKV deadline (whole stream)
    # Translated KV back from kvtd and published KV out: "auto" (shared memory when kvtd
    # accepts it, else inline chunks), "shm" (the same, warning when it cannot), "inline".
    transport: str = "auto"
    publish_timeout_s: float = 30.0     # Publish deadline
    publish: bool = True                # publish after prefill
    publish_final: bool = True          # publish prompt + generated when a request ends
    publish_queue_size: int = 8         # pending publishes; beyond it they are dropped
    # A publish waits this long after the engine step that queued it, so that the step's output
    # reaches the client before kvtd's work on the publish competes with it for the cores.
    publish_delay_ms: float = 30.0
    # Bytes of the region a publish is copied into when the engine's cache is not shared with
    # kvtd; a publish that does not fit goes inline. 0: four requests of max_model_len tokens,
    # at most 256 MiB.
    publish_region_bytes: int = 0
    block_tokens: int = 16              # kvtd's prefix_cache.block_tokens
    min_reuse_tokens: int = 0           # 0 = one vLLM block
    reuse: str = "auto"                 # default policy of requests without kvt params
    allow_translated_prefix_cache: bool = False  # the hazard opt-in (docs/VLLM.md)
    log_outcomes: bool = True           # one JSON log line per request
    # In an engine step with no tokens to compute while translated loads are in flight, the
    # worker waits up to this long for one to finish instead of returning at once: vLLM's
    # engine loop otherwise spins on empty steps, holding the GIL the load thread needs and a
    # core kvtd's translation needs. Bounds the delay a newly arriving request can see in such
    # a step; 0 turns the wait off.
    idle_wait_ms: float = 5.0
    load_threads: int = 2               # concurrent translated loads per worker
    # With a shared-memory load, ask kvtd for a notice per layer and kind as it lands in the
    # region and copy each into the blocks while kvtd computes the next.
    layer_notices: bool = True
    # Transport auto/shm on a CPU engine: share the engine's own KV cache with kvtd, so kvtd
    # writes translated prefixes straight into the request's blocks and reads published
    # prefixes straight out of them (kvt/vllm/engine_cache.py).
    load_in_place: bool = True
    # The cross-node source-cache tier on Mooncake Store (docs/CLUSTER_TIER.md); None: the
    # node-local tier only (kvt.cluster is never imported).
    cluster: Optional["ClusterOptions"] = None

    @classmethod
    def from_extra(cls, extra: Optional[Dict[str, Any]]) -> "ConnectorConfig":
        """Parses kv_connector_extra_config; raises ValueError naming the offending key."""
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(fields))})")
        for key in ("kvtd_address", "model_name"):
            if not extra.get(key):
                raise ValueError(f"kv_connector_extra_config.{key} is required")
        values: Dict[str, Any] = {}
        for name, value in extra.items():
            if name == "cluster":
                values[name] = ClusterOptions.from_extra(value)
                continue
            values[name] = _coerce(name, value, fields[name].type)
        config = cls(**values)
        config._check_choices()
        return config

    def _check_choices(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv_connector_extra_config.transport: {self.transport!r} is not "
                             f"one of {', '.join(TRANSPORTS)}")
        if self.reuse not in POLICIES:
            raise ValueError(f"kv_connector_extra_config.reuse: {self.reuse!r} is not one of "
                             f"{', '.join(POLICIES)}")
        for key, low in (("idle_wait_ms", 0.0), ("load_threads", 1), ("publish_queue_size", 1),
                         ("publish_delay_ms", 0.0),
                         ("block_tokens", 1), ("min_reuse_tokens", 0),
                         ("publish_region_bytes", 0), ("lookup_timeout_s", 0.0),
                         ("lookup_wait_s", 0.0), ("translate_timeout_s", 0.0),
                         ("publish_timeout_s", 0.0)):
            if getattr(self, key) < low:
                raise ValueError(f"kv_connector_extra_config.{key}: {getattr(self, key)!r} is "
                                 f"not >= {low}")


@dataclass(frozen=True)
class ClusterOptions:
    """kv_connector_extra_config.cluster: where the deployment's Mooncake Store is and the
    deadlines of its calls (docs/VLLM.md, "Multi-node: the cluster tier")."""
    master_server_address: str            # required: the Mooncake master's "host:port"
    # The transfer engine's metadata: "http://host:port/metadata" (the master's embedded HTTP
    # metadata server) or "P2PHANDSHAKE".
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"                 # "tcp" or "rdma"
    device_name: str = ""                 # RDMA device(s); "" for tcp
    # The address this process's transfer engine advertises: "" = $MC_TCP_BIND_ADDRESS, else
    # this host's name resolved (a pod's IP). 127.0.0.1 only for single-host tests.
    local_hostname: str = ""
    enabled: bool = True                  # false: the section is ignored (node-local tier only)
    chunk_blocks: int = 4                 # kvtd blocks per store object (one value per cluster)
    # Element types of the source caches looked for ("fp32", "fp16", "bf16"): "" = this
    # engine's own.
    source_dtypes: str = ""
    setup_timeout_s: float = 10.0         # store client set-up (on a background thread)
    setup_retry_s: float = 10.0           # after a failed set-up, try again this much later
    lookup_timeout_s: float = 0.2         # longest_prefix (metadata only)
    fetch_timeout_s: float = 2.0          # the fetch of a matched prefix
    put_timeout_s: float = 5.0            # a publish's put
    put: bool = True                      # put published prefixes into the store
    # Most bytes of the shared-memory region (registered with kvtd and the store) fetches land
    # in: made at the first fetch, grown to the longest prefix fetched so far (powers of two
    # from 64 MiB) up to this; a longer prefix is fetched in part. One fetch at a time per
    # engine.
    fetch_region_bytes: int = 2 << 30
    # After a fetch failed with segment_unavailable or evicted, the same prefix is not fetched
    # again for this long (a dead node's objects stay listed until the master drops them).
    failed_key_ttl_s: float = 30.0
    # Testing: wait this long between the store lookup and the fetch (to remove objects in
    # between, tests/cluster/vllm_test.py). 0 in any deployment.
    fetch_delay_s: float = 0.0

    @classmethod
    def from_extra(cls, extra: Any) -> Optional["ClusterOptions"]:
        """Parses the cluster section (None when it is absent, null or enabled: false)."""
        if extra is None:
            return None
        if not isinstance(extra, dict):
            raise ValueError("kv_connector_extra_config.cluster: expected an object, got "
                             f"{type(extra).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(f"kv_connector_extra_config.cluster: unknown key(s) "
                             f"{', '.join(unknown)} (known: {', '.join(sorted(fields))})")
        if not extra.get("master_server_address"):
            raise ValueError("kv_connector_extra_config.cluster.master_server_address is "
                             "required")
        values = {name: _coerce(f"cluster.{name}", value, fields[name].type)
                  for name, value in extra.items()}
        options = cls(**values)
        if options.protocol not in ("tcp", "rdma"):
            raise ValueError(f"kv_connector_extra_config.cluster.protocol: "
                             f"{options.protocol!r} is not one of tcp, rdma")
        for dtype in options.dtypes(""):
            if dtype not in ("fp32", "fp16", "bf16"):
                raise ValueError(f"kv_connector_extra_config.cluster.source_dtypes: {dtype!r} "
                                 "is not one of fp32, fp16, bf16")
        for key, low in (("chunk_blocks", 1), ("setup_timeout_s", 0.0), ("setup_retry_s", 0.0),
                         ("lookup_timeout_s", 0.0), ("fetch_timeout_s", 0.0),
                         ("put_timeout_s", 0.0), ("fetch_region_bytes", 1),
                         ("failed_key_ttl_s", 0.0), ("fetch_delay_s", 0.0)):
            if getattr(options, key) < low:
                raise ValueError(f"kv_connector_extra_config.cluster.{key}: "
                                 f"{getattr(options, key)!r} is not >= {low}")
        return options if options.enabled else None

    def dtypes(self, own: str) -> Tuple[str, ...]:
        names = tuple(d.strip() for d in self.source_dtypes.split(",") if d.strip())
        return names or ((own,) if own else ())


def _coerce(name: str, value: Any, kind: Any) -> Any:
    kind = str(kind)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"kv_connector_extra_config.{name}: {value!r} is not true or false")
        return value
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"kv_connector_extra_config.{name}: {value!r} is not a number")
        if kind == "int" and value != int(value):
            raise ValueError(f"kv_connector_extra_config.{name}: {value!r} is not an integer")
        return int(value) if kind == "int" else float(value)
    if not isinstance(value, str):
        raise ValueError(f"kv_connector_extra_config.{name}: {value!r} is not a string")
    return value


@dataclass(frozen=True)
class RequestOptions:
    """A request's kv_transfer_params["kvt"]."""
    reuse: str = "auto"
    mapper_id: str = ""
    min_tokens: int = 0
    load: str = "auto"


_PARAM_KEYS = {f.name for f in dataclasses.fields(RequestOptions)}


def parse_kv_transfer_params(params: Any, default_reuse: str = "auto") -> RequestOptions:
    """The kvt options of a request's kv_transfer_params ({"kvt": {...}}). Raises ValueError
    naming the offending key."""
    if params is None:
        return RequestOptions(reuse=default_reuse)
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
    kvt = params.get("kvt")
    if kvt is None:
        return RequestOptions(reuse=default_reuse)
    if not isinstance(kvt, dict):
        raise ValueError(f"kv_transfer_params.kvt: expected an object, got {type(kvt).__name__}")
    for key in kvt:
        if key not in _PARAM_KEYS:
            raise ValueError(f"kv_transfer_params.kvt.{key}: unknown key (known: "
                             f"{', '.join(sorted(_PARAM_KEYS))})")
    reuse = kvt.get("reuse", default_reuse)
    if not isinstance(reuse, str) or reuse not in POLICIES:
        raise ValueError(f"kv_transfer_params.kvt.reuse: {reuse!r} is not one of "
                         f"{', '.join(POLICIES)}")
    mapper_id = kvt.get("mapper_id", "")
    if "mapper_id" in kvt and (not isinstance(mapper_id, str) or not mapper_id):
        raise ValueError(f"kv_transfer_params.kvt.mapper_id: {mapper_id!r} is not a "
                         "non-empty string")
    min_tokens = kvt.get("min_tokens", 0)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"kv_transfer_params.kvt.min_tokens: {min_tokens!r} is not an "
                         "integer >= 0")
    load = kvt.get("load", "auto")
    if not isinstance(load, str) or load not in LOADS:
        raise ValueError(f"kv_transfer_params.kvt.load: {load!r} is not one of "
                         f"{', '.join(LOADS)}")
    return RequestOptions(reuse=reuse, mapper_id=mapper_id, min_tokens=min_tokens, load=load)


def validate_kv_transfer_params(params: Any) -> None:
    """Client-side check before submitting a request (raises ValueError naming the key)."""
    parse_kv_transfer_params(params)
