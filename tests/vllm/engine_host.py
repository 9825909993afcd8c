"""One vLLM engine (LLM, KvtConnector configured) in a process of its own, driven over stdin /
stdout by tests/vllm/engines.py: one JSON command per stdin line; each answer is one stdout line
starting with "@@kvt " (vLLM's own logs share stdout and are passed through to a log file).

    python3 engine_host.py --model=DIR --config='{"kvtd_address": ..., "model_name": ...}' \
        [--dtype=float32|bfloat16] [--no_connector] [--max_model_len=N] [--null_connector]

--null_connector configures tests/vllm/null_connector.py's NullConnector instead of KvtConnector
(a connector that does nothing: the cost of vLLM's connector plumbing alone), with the CPU core
reservation of a plain engine, as KvtConnector keeps it (kvt/vllm/cpu_cores.py).

--max_model_len=0 keeps the context the model declares (config.json max_position_embeddings),
so vLLM refuses longer prompts. A larger N than the declared context raises the model's
max_position_embeddings to N for this engine only (vLLM's hf_overrides), and says so in the log:
the bundled family declares the 512 positions it was trained on, and the speed benchmarks time it
at 1K-2K tokens, where its outputs are meaningless but its cost is not.

Commands:
  {"op": "generate", "requests": [{"prompt": [ids], "max_tokens": n, "kvt": {...} | null,
   "cache_salt": str | null, "logprobs": k, "prompt_logprobs": k,
   "skip_reading_prefix_cache": bool | null}]}
    -> {"ok": true, "results": [{"token_ids", "kv_transfer_params", "num_cached_tokens",
        "logprobs": [{token: logprob}] (first positions), "prompt_logprobs": for each prompt
        position the log-probability of the prompt's own token there (None where vLLM computed
        none; the key is null without prompt_logprobs), "wall_s"}]}
    Requests of one command are submitted together (one generate call).
  {"op": "metrics"} -> {"ok": true, "metrics": {name: value}} (vllm:kvt_* counters, summed over
    their labels)
  {"op": "quit"}
"""

import argparse
import json
import os
import sys
import time
import traceback


def context_kwargs(model_dir, max_model_len):
    """LLM arguments for --max_model_len (see the module docstring)."""
    if max_model_len == 0:
        return {}
    with open(os.path.join(model_dir, "config.json")) as f:
        declared = json.load(f).get("max_position_embeddings")
    if declared is None or max_model_len <= declared:
        return {"max_model_len": max_model_len}
    print(f"engine_host: max_model_len {max_model_len} is past the model's declared context "
          f"({declared} positions): raised for this engine, for timing only", file=sys.stderr,
          flush=True)
    return {"max_model_len": max_model_len,
            "hf_overrides": {"max_position_embeddings": max_model_len}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True, help="kv_connector_extra_config as JSON")
    parser.add_argument("--max_model_len", type=int, default=1024,
                        help="0: the model's declared context")
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--no_connector", action="store_true")
    parser.add_argument("--null_connector", action="store_true")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (vLLM LLM dtype)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    out = sys.stdout
    sys.stdout = sys.stderr  # everything else printed goes to the log

    def answer(obj):
        out.write("@@kvt " + json.dumps(obj) + "\n")
        out.flush()

    t0 = time.monotonic()
    kwargs = {}
    if args.null_connector:
        import platform
        from kvt.vllm.cpu_cores import ENV, plain_reservation
        os.environ.setdefault(ENV, str(plain_reservation(1, platform.machine().lower())))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullConnector", kv_connector_module_path="null_connector",
            kv_role="kv_both")
    elif not args.no_connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtConnector", kv_connector_module_path="kvt.vllm",
            kv_role="kv_both", kv_connector_extra_config=json.loads(args.config))
    kwargs.update(context_kwargs(args.model, args.max_model_len))
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
              enforce_eager=True, block_size=args.block_size, disable_log_stats=False, **kwargs)
    answer({"ready": True, "start_s": time.monotonic() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("op") == "quit":
            answer({"ok": True})
            break
        if command.get("op") == "metrics":
            values = {}
            for m in llm.get_metrics():
                if m.name.startswith("vllm:kvt_") and hasattr(m, "value"):
                    values[m.name] = values.get(m.name, 0) + m.value
            answer({"ok": True, "metrics": values})
            continue
        try:
            prompts, params = [], []
            for r in command["requests"]:
                extra = {"kv_transfer_params": {"kvt": r["kvt"]}} if r.get("kvt") is not None \
                    else ({"kv_transfer_params": r["kv_transfer_params"]}
                          if "kv_transfer_params" in r else None)
                plp = r.get("prompt_logprobs")
                # prompt_logprobs alone sets skip_reading_prefix_cache=True, which drops the
                # connector's external tokens too (tests/vllm/benefit_test.py); a request may
                # still ask for vLLM's default ("skip_reading_prefix_cache": null).
                skip = r.get("skip_reading_prefix_cache", False if plp is not None else None)
                params.append(SamplingParams(max_tokens=r.get("max_tokens", 16), temperature=0.0,
                                             ignore_eos=bool(r.get("ignore_eos", False)),
                                             detokenize=False, logprobs=r.get("logprobs"),
                                             prompt_logprobs=plp, skip_reading_prefix_cache=skip,
                                             extra_args=extra))
                p = TokensPrompt(prompt_token_ids=list(r["prompt"]))
                if r.get("cache_salt"):
                    p["cache_salt"] = r["cache_salt"]
                prompts.append(p)
            t = time.monotonic()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.monotonic() - t
            results = []
            for r, o in zip(command["requests"], outputs):
                c = o.outputs[0]
                lp = None
                if c.logprobs:
                    lp = [{str(tok): float(v.logprob) for tok, v in pos.items()}
                          for pos in c.logprobs[:2]]
                plps = None
                if o.prompt_logprobs is not None:
                    plps = []
                    for i, pos in enumerate(o.prompt_logprobs):
                        hit = pos.get(r["prompt"][i]) if pos else None
                        plps.append(None if hit is None else float(hit.logprob))
                results.append({"token_ids": list(c.token_ids),
                                "kv_transfer_params": o.kv_transfer_params,
                                "num_cached_tokens": o.num_cached_tokens, "logprobs": lp,
                                "prompt_logprobs": plps, "wall_s": wall})
            answer({"ok": True, "results": results})
        except Exception:
            answer({"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main()
