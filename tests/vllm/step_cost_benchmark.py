#!/usr/bin/env python3
"""What KvtConnector adds to each engine step, measured inside one engine with the connector
attached and detached in turn (docs/VLLM.md, "What the connector costs").

tax_benchmark compares two engine instances, and two instances of the same engine differ by more
than the per-step cost of a connector (a few percent on this machine). Here one in-process vLLM
engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler and model runner in this process) is built
with KvtConnector, and between requests the connector is detached (the scheduler's connector and
vLLM's worker-side connector global set to None, so every `if connector` branch of vLLM takes the
plain path) and attached again. Requests alternate, attached and detached, on the same engine,
cache and threads: the paired ratio resolves a fraction of a percent. Each request has reuse
forbidden and a fresh prompt; publishing is on unless --config turns it off. With --time_hooks,
each KvtConnector hook vLLM calls is wrapped in a timer (which adds about 0.4 us per call).

Not covered here: what differs between processes (the metadata pickled between the engine core
and the model runner, the connector's threads in a process of its own); tax_benchmark measures
those, end to end.

    PATH=$PWD/.venv/bin:$PATH bazel run //tests/vllm:step_cost_benchmark -- [--runs=60]
        [--prompt=256] [--generate=64] [--time_hooks] [--config='{"publish": false}'] [--reader]
        [--model=tiny-L|qwen3-0.6b]
"""

import argparse
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time

from tax_benchmark import add_model_args, paired_interval, subject_of

HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
         "build_connector_meta", "update_connector_output", "request_finished",
         "bind_connector_metadata", "handle_preemptions", "start_load_kv",
         "has_connector_metadata", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
         "get_transfer_results", "get_block_ids_with_load_errors", "get_kv_connector_stats",
         "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
         "clear_connector_metadata")


def time_hooks(cls, totals):
    """Wraps each hook of `cls` in a timer adding into totals[name] = [calls, seconds]."""
    def wrap(name, hook):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                entry = totals[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - start
        return timed
    for name in HOOKS:
        setattr(cls, name, wrap(name, getattr(cls, name)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60, help="requests per mode")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--generate", type=int, default=64, help="generated tokens")
    parser.add_argument("--config", default="{}", help="kv_connector_extra_config overrides")
    parser.add_argument("--time_hooks", action="store_true")
    parser.add_argument("--reader", action="store_true",
                        help="as tax_benchmark's --reader: kvtd stores every publish (without "
                             "it kvtd refuses them, and the connector pauses publishing)")
    add_model_args(parser)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import family
    import engines as E
    import vllm.distributed.kv_transfer.kv_transfer_state as transfer_state
    from engine_host import context_kwargs
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from kvt.vllm.connector import KvtConnector

    totals = collections.defaultdict(lambda: [0, 0.0])
    if args.time_hooks:
        time_hooks(KvtConnector, totals)
    work = tempfile.mkdtemp(prefix="kvt-step-cost-")
    os.makedirs(os.path.join(work, "store"))
    subject = subject_of(args.model, args.models_dir or work)
    if args.reader:
        subject.reader(os.path.join(work, "store"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(subject.kv_space_gib))
    port = E.free_port()
    kvtd = family.start_kvtd(os.path.join(work, "store"), port,
                             family.kvtd_yaml(os.path.join(work, "kvtd.yaml"),
                                              max_bytes=subject.kvtd_bytes)).__enter__()
    try:
        config = {"kvtd_address": f"127.0.0.1:{port}", "model_name": subject.name,
                  **json.loads(args.config)}
        llm = LLM(model=subject.path, skip_tokenizer_init=True, dtype=subject.dtype,
                  enforce_eager=True, block_size=32,
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="KvtConnector", kv_connector_module_path="kvt.vllm",
                      kv_role="kv_both", kv_connector_extra_config=config),
                  **context_kwargs(subject.path, 2048))
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        connectors = (scheduler.connector, transfer_state._KV_CONNECTOR_AGENT)
        assert None not in connectors, "the engine has no connector to detach"

        def attach(on):
            # A finished request whose blocks the connector holds (its publishes still read
            # them) is released by a later step: run steps until none is left, so the plain
            # engine never inherits one.
            end = time.monotonic() + 30
            while scheduler.requests and time.monotonic() < end:
                llm.llm_engine.step()
            scheduler.connector = connectors[0] if on else None
            transfer_state._KV_CONNECTOR_AGENT = connectors[1] if on else None

        rng = random.Random(1)
        params = SamplingParams(max_tokens=args.generate, temperature=0.0, ignore_eos=True,
                                detokenize=False,
                                extra_args={"kv_transfer_params": {"kvt": {"reuse": "forbid"}}})

        def one():
            prompt = TokensPrompt(prompt_token_ids=[rng.randrange(256)
                                                    for _ in range(args.prompt)])
            start = time.perf_counter()
            llm.generate([prompt], [params], use_tqdm=False)
            return (time.perf_counter() - start) * 1e3

        for on in (False, True, False, True):  # warm-up
            attach(on)
            one()
        totals.clear()
        walls = {False: [], True: []}
        for i in range(args.runs):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                attach(on)
                walls[on].append(one())
        attach(True)
        report(walls, totals, args, subject.label)
    finally:
        kvtd.__exit__(None, None, None)
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine has non-daemon threads


def report(walls, totals, args, label):
    plain, kvt = statistics.median(walls[False]), statistics.median(walls[True])
    paired, low, high = paired_interval(walls[False], walls[True])
    print(f"{label}: {args.prompt} prompt tokens, {args.generate} generated, reuse forbidden, "
          f"{args.runs} requests per mode, config {args.config}")
    print(f"  detached (plain): median {plain:.2f} ms")
    print(f"  attached:         median {kvt:.2f} ms ({kvt - plain:+.2f} ms)")
    print(f"  paired ratio: median {paired:.4f}, 95% interval [{low:.4f}, {high:.4f}]")
    if args.generate > 1:
        steps = args.generate
        print(f"  per step: {(kvt - plain) / steps * 1e3:+.1f} us ({steps} steps a request)")
    if totals:
        whole = sum(seconds for _, seconds in totals.values()) * 1e3 / args.runs
        print(f"  KvtConnector's hooks: {whole:.3f} ms per request (timers included)")
        for name, (calls, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            print(f"    {name:34s} {calls / args.runs:7.1f} calls  "
                  f"{seconds / calls * 1e6:7.2f} us each  {seconds * 1e3 / args.runs:7.3f} ms")


if __name__ == "__main__":
    main()
