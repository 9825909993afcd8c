"""The connector's scheduler side (engine core process): per request, the reuse decision
(LookupPrefix on a thread of its own, never waited on for long in the scheduler loop), the cache
salt that keeps translated blocks out of exact prefix-cache hits, what each step asks of the
workers (KvtConnectorMetadata), and the outcome every request ends with."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from kvt.prefix_digest import DigestFollower
from kvt.vllm.metadata import (Gate, KvtConnectorMetadata, KvtWorkerMetadata, LoadResult,
                               LoadSpec, PublishSpec)
from kvt.vllm.options import ConnectorConfig, RequestOptions, parse_kv_transfer_params
from kvt.vllm.regions import describe_error

logger = logging.getLogger("vllm.kvt")


@dataclass
class RequestState:
    """What the scheduler side knows of one request."""
    request: Any
    options: RequestOptions
    outcome: Dict[str, Any] = field(default_factory=dict)
    lookup: Optional[Future] = None
    lookup_started: float = 0.0
    lookup_ms: float = 0.0
    decided: bool = False        # the reuse decision is made (external tokens fixed)
    ext_tokens: int = 0          # tokens this connector loads
    load: Optional[LoadSpec] = None
    load_sent: bool = False
    load_result: Optional[LoadResult] = None
    prompt_published: bool = False  # its prompt publish was handed to the workers
    salted: bool = False
    orig_salt: Optional[str] = None
    # What the cluster tier did for this request (ClusterLookup.consult); None: not asked.
    cluster: Optional[Dict[str, Any]] = None


class KvtScheduler:
    """`kvt()`: the connection to kvtd (client, PrefixCache); `count(name, value)`: counters;
    `block_ids(req_id)`: the request's block ids of vLLM's KV cache manager."""

    def __init__(self, config: ConnectorConfig, block_size: int, kvt: Callable[[], Any],
                 count: Callable[..., None], cluster: Any = None) -> None:
        self.config = config
        # A kvt.vllm.cluster_tier.ClusterLookup when the cluster tier is configured.
        self.cluster = cluster
        self.block_size = block_size
        self.kvt = kvt
        self._count = count
        self._reqs: Dict[str, RequestState] = {}
        self._pending_loads: List[LoadSpec] = []
        self._pending_finals: List[PublishSpec] = []
        self._pending_releases: List[str] = []
        # Requests whose prompt publish is still to come: a decode step of requests that all
        # published theirs looks at no request at all.
        self._unpublished: Set[str] = set()
        # With the cluster tier, a lookup thread may also wait for a fetch from the store.
        self._lookups = ThreadPoolExecutor(max_workers=2 if cluster is None else 4,
                                           thread_name_prefix="kvt-lookup")
        # The outcome lines are formatted and written here, in order: a log record costs the
        # scheduler loop a few hundred microseconds per request otherwise.
        self._outcome_log = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvt-log")
                             if config.log_outcomes else None)
        # kvtd's published-prefix digest: a prompt it shows no stored prefix can match needs no
        # LookupPrefix. Not with the cluster tier, which asks the store on every local miss.
        self.digest: Optional[DigestFollower] = None
        if config.lookup_digest and cluster is None:
            self.digest = DigestFollower(lambda: self.kvt()[0], self._lookups.submit)
            self.digest.refresh()

    def shutdown(self) -> None:
        if self.digest is not None:
            self.digest.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self._outcome_log is not None:
            self._outcome_log.shutdown(wait=True)  # the lines already handed over are written

    # -- a new request and its reuse decision --------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._count("requests")
        state = RequestState(request=request, options=RequestOptions(reuse="forbid"))
        try:
            state.options = parse_kv_transfer_params(request.kv_transfer_params,
                                                     self.config.reuse)
        except ValueError as error:
            state.outcome = {"outcome": "unsupported", "reason": "bad_kv_transfer_params",
                             "detail": str(error)}
            state.decided = True
            logger.error("kvt: request %s: %s (served without reuse)", request.request_id,
                         error)
        if getattr(request, "skip_reading_prefix_cache", False) and not state.outcome:
            # vLLM drops external and cached prefixes for such requests (prompt_logprobs sets
            # it): decided here, before any lookup or lease.
            state.outcome = {"outcome": "unsupported", "reason": "prefix_cache_skipped",
                             "detail": "vLLM skips reading cached prefixes for this request "
                                       "(prompt_logprobs or "
                                       "SamplingParams.skip_reading_prefix_cache)"}
            state.decided = True
        self._reqs[request.request_id] = state
        if self.config.publish:
            self._unpublished.add(request.request_id)

    def _state(self, request: Any) -> RequestState:
        if request.request_id not in self._reqs:
            self.on_new_request(request)
        return self._reqs[request.request_id]

    def _fallback(self, st: RequestState, reason: str, detail: str = "") -> Tuple[int, bool]:
        st.decided = True
        st.ext_tokens = 0
        if not st.outcome:
            st.outcome = {"outcome": "fallback_reprefill", "reason": reason}
            if detail:
                st.outcome["detail"] = detail
            if st.cluster is not None:
                st.outcome["cluster"] = st.cluster
        return 0, False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        st = self._state(request)
        if st.decided:
            return self._asked_again(st, num_computed_tokens)
        if st.options.reuse == "forbid":
            return self._fallback(st, "forbidden", "kv_transfer_params kvt.reuse=forbid")
        prompt = request.prompt_token_ids or []
        # vLLM computes at least the last prompt token itself; whole vLLM blocks only.
        limit = (len(prompt) - 1) // self.block_size * self.block_size
        if limit <= num_computed_tokens:
            return self._fallback(
                st, "too_short" if num_computed_tokens == 0 else "local_prefix_cache",
                f"{len(prompt)} prompt tokens, {num_computed_tokens} from the engine's own "
                f"prefix cache, block size {self.block_size}")
        if st.lookup is None:
            if self.digest is not None and self.digest.certain_miss(prompt[:limit]):
                self._count("digest_misses")
                return self._fallback(st, "no_prefix", "no stored cache starts with the "
                                      "prompt's first block (kvtd's prefix digest; no lookup "
                                      "sent)")
            st.lookup = self._start_lookup(st, prompt, num_computed_tokens, limit)
        lookup = st.lookup
        if not lookup.done():
            # A local kvtd answers in a millisecond or two: wait that long in line (saves a
            # scheduler step), else ask again next step (the scheduler loop never waits longer).
            wait = self.config.lookup_wait_s
            if wait <= 0 or not _wait(lookup, wait):
                return None, False
        try:
            response = lookup.result()
        except Exception as error:  # kvtd down, deadline, any RPC error
            self._count("lookup_errors")
            return self._fallback(st, "lookup_failed", describe_error(error))
        return self._decide(st, response, num_computed_tokens, limit)

    def _asked_again(self, st: RequestState, num_computed_tokens: int
                     ) -> Tuple[Optional[int], bool]:
        """Asked again (the allocation failed, or the request was preempted / its load failed):
        never load twice from one lease."""
        if st.load is not None and not st.load_sent:
            if num_computed_tokens == st.load.start:
                return st.ext_tokens, st.ext_tokens > 0
            # The engine's own prefix-cache hit changed meanwhile: the decision no longer fits;
            # drop the lease (it expires) and prefill.
            self._unsalt(st)
            st.load, st.ext_tokens = None, 0
            st.outcome = {"outcome": "fallback_reprefill", "reason": "rescheduled",
                          "detail": "the engine's own prefix-cache hit changed before the "
                                    "translated prefix could be allocated"}
        return 0, False

    def _start_lookup(self, st: RequestState, prompt: List[int], num_computed_tokens: int,
                      limit: int) -> Future:
        min_tokens = max(num_computed_tokens + self.block_size, self.config.min_reuse_tokens,
                         st.options.min_tokens)
        _, prefix = self.kvt()
        st.lookup_started = time.monotonic()
        self._count("lookups")
        tokens = list(prompt)

        def local() -> Any:
            return prefix.lookup(
                self.config.model_name, tokens, policy=st.options.reuse,
                mapper_id=st.options.mapper_id, min_tokens=min_tokens, max_tokens=limit,
                request_id=st.request.request_id, timeout=self.config.lookup_timeout_s)

        if self.cluster is None:
            lookup = self._lookups.submit(local)
        else:
            lookup = self._lookups.submit(self._both_tiers, st, tokens, local, limit)
        lookup.add_done_callback(_LookupClock(st))
        return lookup

    def _both_tiers(self, st: RequestState, prompt: List[int], local: Callable[[], Any],
                    limit: int) -> Any:
        """On a lookup thread: kvtd first; on a miss or a shorter hit the cluster tier, whose
        fetch ends with kvtd's LookupPrefix again (kvtd's gate and lease decide either way)."""
        response = local()
        response, st.cluster = self.cluster.consult(prompt, response, local, limit,
                                                    self.block_size)
        return response

    def _decide(self, st: RequestState, response: Any, num_computed_tokens: int, limit: int
                ) -> Tuple[int, bool]:
        from kvt.cache import DTYPE_NAMES
        if getattr(response, "verify", False):
            # kvtd's live verification sample: prefill this request (its output is the plain
            # engine's); its prompt publish is what kvtd compares the translation with.
            self._count("verification_samples")
            return self._fallback(st, "verification_sample", response.detail)
        if not response.hit:
            cluster = st.cluster or {}
            if cluster.get("result") == "error":
                cluster["local_reason"] = response.miss_reason
                return self._fallback(st, f"cluster_{cluster['reason']}",
                                      cluster.get("detail", ""))
            if cluster.get("result") == "miss":
                cluster["local_reason"] = response.miss_reason
                return self._fallback(st, "cluster_miss", f"kvtd: {response.detail}; store: "
                                      f"{cluster.get('detail', '')}")
            return self._fallback(st, response.miss_reason or "miss", response.detail)
        self._count("hits")
        end = min(response.matched_tokens, limit) // self.block_size * self.block_size
        if end <= num_computed_tokens:
            return self._fallback(st, "local_prefix_cache",
                                  f"kvtd offers {response.matched_tokens} tokens, the engine's "
                                  f"own prefix cache holds {num_computed_tokens}")
        gate = response.gate
        st.decided = True
        st.ext_tokens = end - num_computed_tokens
        st.load = LoadSpec(
            req_id=st.request.request_id, lease_id=response.lease_id,
            mapper_id=response.mapper_id, matched_tokens=response.matched_tokens,
            dtype=DTYPE_NAMES.get(response.dtype, "fp32"), start=num_computed_tokens, end=end,
            load=st.options.load, source_model=response.source_model,
            gate=Gate(passed=gate.passed, mapper_quality=gate.mapper_quality,
                      input_shift_score=(gate.input_shift_score
                                         if gate.HasField("input_shift_score") else None)))
        if not self.config.allow_translated_prefix_cache:
            self._salt(st, response.mapper_id)
        return st.ext_tokens, True

    def _salt(self, st: RequestState, mapper_id: str) -> None:
        """Re-hash the request under a salt so its translated blocks (and every block computed
        on top of them) never match a plain request's prefix-cache lookup."""
        request = st.request
        st.orig_salt = request.cache_salt
        salt = f"kvt-translated:{mapper_id}"
        request.cache_salt = f"{st.orig_salt}|{salt}" if st.orig_salt else salt
        request.block_hashes.clear()
        request.update_block_hashes()
        st.salted = True

    def _unsalt(self, st: RequestState) -> None:
        if not st.salted:
            return
        request = st.request
        request.cache_salt = st.orig_salt
        request.block_hashes.clear()
        request.update_block_hashes()
        st.salted = False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.load is None or st.load_sent or num_external_tokens == 0:
            return
        st.load.block_ids = list(blocks.get_block_ids()[0])
        self._pending_loads.append(st.load)
        st.load_sent = True

    # -- each step -----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any,
                             block_ids: Callable[[str], List[int]]) -> KvtConnectorMetadata:
        preempted = scheduler_output.preempted_req_ids
        meta = KvtConnectorMetadata(
            loads=self._pending_loads, publishes=self._pending_finals,
            releases=self._pending_releases,
            fence=[r for r in preempted if r in self._reqs and self._reqs[r].prompt_published]
            if preempted else [],
            idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._pending_loads, self._pending_finals, self._pending_releases = [], [], []
        if self._unpublished:
            meta.publishes.extend(self._prompt_publishes(scheduler_output, block_ids))
        return meta

    def _prompt_publishes(self, scheduler_output: Any, block_ids: Callable[[str], List[int]]
                          ) -> List[PublishSpec]:
        """Requests whose prompt is computed by the end of this step: publish it (whole kvtd
        blocks)."""
        scheduled: List[Tuple[str, int]] = [(new.req_id, new.num_computed_tokens)
                                            for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled.extend(zip(cached.req_ids, cached.num_computed_tokens))
        out = []
        block_tokens = self.config.block_tokens
        for req_id, computed in scheduled:
            st = self._reqs.get(req_id) if req_id in self._unpublished else None
            if st is None:
                continue
            request = st.request
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done < request.num_prompt_tokens:
                continue
            n = request.num_prompt_tokens // block_tokens * block_tokens
            blocks = self._blocks_for(block_ids(req_id), n) if n else []
            if not blocks:
                continue
            st.prompt_published = True
            self._unpublished.discard(req_id)
            out.append(PublishSpec(req_id=req_id, final=False,
                                   token_ids=list(request.prompt_token_ids[:n]),
                                   block_ids=blocks))
        return out

    def _blocks_for(self, block_ids: List[int], tokens: int) -> List[int]:
        return list(block_ids[:(tokens + self.block_size - 1) // self.block_size])

    def update_connector_output(self, meta: Any) -> None:
        if not isinstance(meta, KvtWorkerMetadata):
            return
        for req_id, result in meta.loads.items():
            st = self._reqs.get(req_id)
            if st is None or st.load is None:
                continue
            st.load_result = result
            if not result.ok:
                self._count("load_failures")
                # vLLM recomputes the request from scratch: its blocks are exact again.
                self._unsalt(st)
                st.outcome = {"outcome": "fallback_reprefill", "reason": "translate_failed",
                              "detail": result.error}

    # -- the end of a request ------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        self._unpublished.discard(request.request_id)
        if st is None:
            return False, None
        outcome = self._outcome(st)
        self._report(request, outcome)
        # Never publish blocks a load may still be writing (a request aborted while waiting
        # for its translated prefix: num_computed_tokens already counts it).
        unconfirmed = st.load is not None and st.load_result is None
        final = (self._final_publish(request, block_ids, st)
                 if self.config.publish_final and block_ids and not unconfirmed else None)
        if final is not None:
            self._pending_finals.append(final)
        # vLLM holds the blocks until the workers report the request in finished_sending, which
        # they do once no publish of it reads them any more.
        hold = final is not None or st.prompt_published
        if hold:
            self._pending_releases.append(request.request_id)
        return hold, {"kvt": outcome}

    def _final_publish(self, request: Any, block_ids: List[int], st: RequestState
                       ) -> Optional[PublishSpec]:
        block_tokens = self.config.block_tokens
        n = min(request.num_computed_tokens, len(request.all_token_ids))
        n = n // block_tokens * block_tokens
        prompt_blocks = request.num_prompt_tokens // block_tokens * block_tokens
        if n == 0 or (n <= prompt_blocks and self.config.publish):
            return None  # nothing beyond what the prompt publish covers
        return PublishSpec(req_id=request.request_id, final=True,
                           token_ids=list(request.all_token_ids[:n]),
                           block_ids=self._blocks_for(block_ids, n))

    def _outcome(self, st: RequestState) -> Dict[str, Any]:
        if st.outcome:
            return st.outcome
        if st.load is not None and st.load_result is not None and st.load_result.ok:
            return self._applied(st)
        if st.load is not None:
            return {"outcome": "fallback_reprefill", "reason": "not_loaded",
                    "detail": "the request ended before its translated prefix loaded"}
        return {"outcome": "fallback_reprefill", "reason": "not_scheduled",
                "detail": "the request ended before a reuse decision"}

    def _applied(self, st: RequestState) -> Dict[str, Any]:
        load, result = st.load, st.load_result
        assert load is not None and result is not None
        outcome = {
            "outcome": "applied", "tokens_reused": load.end - load.start,
            "prefix_tokens": load.end, "source_model": load.source_model,
            "mapper_id": load.mapper_id,
            "timings": {"lookup_ms": round(st.lookup_ms, 3),
                        "translate_ms": result.translate_ms, "load_ms": result.load_ms,
                        "kvtd_total_ms": result.kvtd_total_ms},
            "gate": load.gate.as_json(), "transport": result.transport,
            "prefix_cache": "shared" if self.config.allow_translated_prefix_cache
            else "salted"}
        if result.input_shift_score is not None:
            outcome["input_shift_score"] = result.input_shift_score
        if self.cluster is not None:
            fetched = st.cluster is not None and st.cluster.get("result") == "fetched"
            outcome["tier"] = "cluster" if fetched else "local"
            if st.cluster is not None:
                outcome["cluster"] = st.cluster
        return outcome

    def _report(self, request: Any, outcome: Dict[str, Any]) -> None:
        self._count({"applied": "applied", "fallback_reprefill": "fallback_reprefill"}.get(
            outcome["outcome"], "unsupported"))
        if outcome["outcome"] == "applied":
            self._count("tokens_reused", outcome["tokens_reused"])
            if outcome.get("tier") == "cluster":
                self._count("applied_cluster")
        if self._outcome_log is not None:
            record = {"request_id": request.request_id, "model": self.config.model_name,
                      **outcome}
            try:
                self._outcome_log.submit(_log_outcome, record)
            except RuntimeError:  # shut down: the engine is stopping
                _log_outcome(record)


def _log_outcome(record: Dict[str, Any]) -> None:
    logger.info("kvt_outcome %s", json.dumps(record, sort_keys=True))


class _LookupClock:
    """Done-callback of a lookup future: records its round trip on the request's state."""

    def __init__(self, st: RequestState) -> None:
        self.st = st

    def __call__(self, _future: "Future[Any]") -> None:
        self.st.lookup_ms = (time.monotonic() - self.st.lookup_started) * 1e3


def _wait(future: Future, seconds: float) -> bool:
    try:
        future.exception(timeout=seconds)
        return True
    except Exception:  # concurrent.futures.TimeoutError
        return future.done()
