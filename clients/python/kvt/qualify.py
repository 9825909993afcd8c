"""Qualify a mapper on an operator's own text: how much of the target model's context benefit a
translated cache recovers, measured on the target itself (docs/OPERATIONS.md, "Qualifying a
mapper").

    python -m kvt.qualify --kvtd=HOST:PORT --mapper_id=ID --source_model=DIR --target_model=DIR \\
        --text=NAME=PATH [--text=NAME2=PATH2 ...] [--out=FILE.json] [--record=MAPPER_DIR]

Per text, `--windows` windows of context + continuation + 1 tokens are spread evenly over the
text's token stream (kvt.text.spread_windows, as the evaluation cuts its held-out windows). On
each window the target model (transformers AutoModelForCausalLM, eval mode, no grad) scores the
continuation's next tokens (cross-entropy, nats/token) after

    own     its own prefill of the context,
    none    no context (the continuation alone, from position 0),
    mapped  the source model's prefill of the context translated by kvtd (kvt.Client.translate),
            the continuation fed on top,

and the next-token KL(own || mapped) is averaged over the continuation. The benefit recovered is
(CE_none - CE_mapped) / (CE_none - CE_own) over all windows' continuation tokens, with a 95%
paired bootstrap interval over the windows (kvt.intervals). `--record=MAPPER_DIR` then writes the
figures into the mapper's manifest (`kvt record-benefit`, quality.benefit), where kvtd's quality
gate reads the worst text's lower95.

Needs torch and transformers (pip install kvt[hf]). The models run on `--device` (default cpu);
caches go to kvtd through host memory. Exit status 2 with a message naming the flag
when the text, the windows or the models cannot give an honest figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvt import adapters
from kvt.client import Client
from kvt.intervals import benefit_of, paired_bootstrap
from kvt.text import ByteTokenizer, HfTokenizer, read_documents, spread_windows, token_stream

# The keys of one quality.benefit entry of a mapper manifest (docs/MAPPER_FORMAT.md), in order:
# what `kvt record-benefit` reads; the other keys of a result entry are for the operator.
RECORD_KEYS = ("text", "windows", "context_tokens", "continuation_tokens", "recovered",
               "lower95", "upper95", "kl")
TEXT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
# Encoded by both tokenizers (--tokenizer auto): they must agree token for token.
PROBE = ("The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!?'\"()[]{} "
         "naïve café 東京 \t\n  def f(x): return x ** 2")
DTYPES = ("float32", "bfloat16", "float16")

Layers = List[Tuple[Any, Any]]


class QualifyError(Exception):
    """A measurement that cannot be made honestly (the message names the flag to change)."""


# -- the target and source through transformers -------------------------------------------------

def load_model(directory: str, dtype: str = "float32", device: str = "cpu") -> Any:
    """A Hugging Face causal LM from `directory`, in eval mode, on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    return model.to(torch.device(device)).eval()


def prefill(model: Any, ids: Sequence[int]) -> Layers:
    """Per-layer (K, V) [1, num_kv_heads, T, head_dim] of the model's cache after a forward pass
    over `ids` from position 0 (copies: the model's cache object is not kept)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=True)
    return [(k.clone(), v.clone()) for k, v in adapters.dynamic_cache_layers(out.past_key_values)]


def continuation_logprobs(model: Any, layers: Optional[Layers], cont: Sequence[int]) -> Any:
    """Next-token log-probabilities [len(cont), vocab] (float64) after feeding `cont` on top of
    the cache `layers` (None: no context, positions from 0)."""
    import torch
    import torch.nn.functional as F

    cache = None
    if layers is not None:
        cache = adapters.to_dynamic_cache(adapters.from_torch(layers), dtype=model.dtype,
                                          device=model.device, config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(cont)], device=model.device),
                    past_key_values=cache, use_cache=cache is not None)
    return F.log_softmax(out.logits[0].double(), dim=-1)


def nll_of(logp: Any, targets: Sequence[int]) -> np.ndarray:
    """Per-token negative log-likelihood (nats, float64) of `targets` under rows of `logp`."""
    import torch

    index = torch.tensor(list(targets), device=logp.device)[:, None]
    return -logp.gather(1, index)[:, 0].cpu().numpy()


def kl_of(own: Any, logp: Any) -> Any:
    """Per position KL(own || logp) of two next-token log-probability rows."""
    return (own.exp() * (own - logp)).sum(-1)


def translate(client: Client, mapper_id: str, layers: Layers) -> Layers:
    """`layers` (the source's cache) translated by kvtd with `mapper_id`, as torch layers."""
    result = client.translate(adapters.from_torch(layers), mapper_id=mapper_id)
    if result.target is None:  # only when the output was sent to a shared-memory region
        raise QualifyError(f"--mapper_id={mapper_id}: kvtd returned no inline cache")
    return list(adapters.to_torch(result.target))


def score_window(client: Client, mapper_id: str, source: Any, target: Any, ids: Sequence[int],
                 context: int) -> Dict[str, np.ndarray]:
    """One window: the continuation's per-token NLL under own, none and mapped, and the
    per-token KL(own || mapped)."""
    ctx, cont, targets = list(ids[:context]), list(ids[context:-1]), list(ids[context + 1:])
    own = continuation_logprobs(target, prefill(target, ctx), cont)
    none = continuation_logprobs(target, None, cont)
    mapped = continuation_logprobs(target, translate(client, mapper_id, prefill(source, ctx)),
                                   cont)
    return {"own": nll_of(own, targets), "none": nll_of(none, targets),
            "mapped": nll_of(mapped, targets), "kl": kl_of(own, mapped).cpu().numpy()}


# -- text ----------------------------------------------------------------------------------------

def max_positions(model: Any) -> Optional[int]:
    value = getattr(model.config, "max_position_embeddings", None)
    return int(value) if value else None


def load_tokenizer(kind: str, source_dir: str, target_dir: str) -> Any:
    """bytes: kvt.text.ByteTokenizer. auto: the target's AutoTokenizer, refused unless the
    source's encodes a probe string to the same tokens (a mapper pairs caches token by token)."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "auto":
        raise QualifyError(f"--tokenizer={kind}: expected auto or bytes")
    target = HfTokenizer.load(target_dir)
    source = HfTokenizer.load(source_dir)
    t, s = target.encode(PROBE), source.encode(PROBE)
    if t != s or target.eos_token_id != source.eos_token_id:
        first = next((i for i, (a, b) in enumerate(zip(t, s)) if a != b), min(len(t), len(s)))
        raise QualifyError(
            f"--tokenizer=auto: the source's tokenizer ({source_dir}) and the target's "
            f"({target_dir}) differ (a probe string: {len(s)} vs {len(t)} tokens, first "
            f"difference at token {first}; EOS {source.eos_token_id} vs {target.eos_token_id}): "
            "a mapper translates caches of the same tokens, so both models must share one")
    return target


def text_windows(name: str, path: str, tokenizer: Any, windows: int,
                 context: int, continuation: int) -> List[List[int]]:
    """The `windows` windows of context + continuation + 1 tokens of one text file."""
    try:
        documents = read_documents(path)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise QualifyError(f"--text={name}={path}: {e}") from None
    stream = token_stream(documents, tokenizer)
    length = context + continuation + 1
    have = len(stream) // length
    if have < windows:
        raise QualifyError(
            f"--text={name}={path}: {len(stream)} tokens hold {have} window(s) of "
            f"--context={context} + --continuation={continuation} + 1 tokens, fewer than "
            f"--windows={windows}: give more text, or lower --windows, --context or "
            "--continuation")
    return spread_windows(stream, length, windows)


# -- the measurement -----------------------------------------------------------------------------

def benefit_entry(name: str, per_window: Dict[str, List[float]], kl: float, context: int,
                  continuation: int, seed: int = 0) -> Dict[str, Any]:
    """One text's figures from per-window mean CE {own, none, mapped} (every window has the
    same continuation length, so the mean of window means is the mean over all tokens)."""
    ce = {key: float(np.mean(v)) for key, v in per_window.items()}
    gain = ce["none"] - ce["own"]
    if not gain > 0:
        raise QualifyError(
            f"--text={name}: the target gains nothing from context on this text (CE without "
            f"context {ce['none']:.4f} <= with its own prefill {ce['own']:.4f} nats/token over "
            f"{len(per_window['own'])} windows of --context={context}): no benefit to recover, "
            "so none is reported; qualify on text where context matters, or a longer --context")
    recovered, low, high = paired_bootstrap(per_window, lambda m: benefit_of(m, "mapped"),
                                            seed=seed)
    # A percentile interval need not hold its estimate (a skewed ratio, or rounding when every
    # resample gives the same figure); the manifest requires lower95 <= recovered <= upper95.
    low, high = min(low, recovered), max(high, recovered)
    return {"text": name, "windows": len(per_window["own"]), "context_tokens": context,
            "continuation_tokens": continuation, "recovered": recovered, "lower95": low,
            "upper95": high, "kl": max(0.0, kl), "ce_own": ce["own"], "ce_none": ce["none"],
            "ce_mapped": ce["mapped"]}


def measure_text(client: Client, mapper_id: str, source: Any, target: Any, name: str,
                 windows: Sequence[Sequence[int]], context: int,
                 seed: int = 0) -> Dict[str, Any]:
    """The benefit entry of one text from its windows (see the module docstring)."""
    start = time.monotonic()
    per_window: Dict[str, List[float]] = {"own": [], "none": [], "mapped": []}
    kl = []
    for ids in windows:
        scores = score_window(client, mapper_id, source, target, ids, context)
        for key in per_window:
            per_window[key].append(float(np.mean(scores[key])))
        kl.append(scores["kl"])
    continuation = len(windows[0]) - context - 1
    entry = benefit_entry(name, per_window, float(np.mean(np.concatenate(kl))), context,
                          continuation, seed)
    entry["seconds"] = round(time.monotonic() - start, 3)
    return entry


def qualify(kvtd: str, mapper_id: str, source_model: str, target_model: str,
            texts: Sequence[Tuple[str, str]], tokenizer: str = "auto", windows: int = 64,
            context: int = 384, continuation: int = 96, seed: int = 0,
            dtype: str = "float32", timeout: float = 300.0,
            device: str = "cpu") -> Dict[str, Any]:
    """The result document of `python -m kvt.qualify` (texts: [(name, path)])."""
    for name, _ in texts:
        if not TEXT_NAME.match(name):
            raise QualifyError(f"--text={name}=...: a text name is letters, digits, '.', '_' "
                               "and '-' (the manifest's quality.benefit[].text)")
    if len({name for name, _ in texts}) != len(texts):
        raise QualifyError("--text: a text name given twice (one benefit entry per text)")
    if not texts:
        raise QualifyError("--text=NAME=PATH: give at least one text")
    if windows < 2:
        raise QualifyError(f"--windows={windows}: an interval needs at least 2 windows")
    if context < 1 or continuation < 1:
        raise QualifyError(f"--context={context} and --continuation={continuation} must be >= 1")
    if dtype not in DTYPES:
        raise QualifyError(f"--dtype={dtype}: expected one of {', '.join(DTYPES)}")
    import torch

    try:
        where = torch.device(device)
    except RuntimeError as e:
        raise QualifyError(f"--device={device}: {e}") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise QualifyError(f"--device={device}: torch sees no CUDA device here")
    torch.manual_seed(seed)
    target = load_model(target_model, dtype, device)
    source = load_model(source_model, dtype, device)
    for flag, model in (("--target_model", target), ("--source_model", source)):
        limit = max_positions(model)
        needed = context + continuation if model is target else context
        if limit is not None and needed > limit:
            raise QualifyError(
                f"--context={context} + --continuation={continuation}: {needed} positions, more "
                f"than {flag}'s max_position_embeddings {limit}")
    if tokenizer == "bytes":
        for flag, model in (("--target_model", target), ("--source_model", source)):
            if model.config.vocab_size < 256:
                raise QualifyError(f"--tokenizer=bytes: {flag} has a vocabulary of "
                                   f"{model.config.vocab_size} < 256 byte tokens")
    tok = load_tokenizer(tokenizer, source_model, target_model)
    cut = [(name, text_windows(name, path, tok, windows, context, continuation))
           for name, path in texts]
    out: Dict[str, Any] = {"mapper_id": mapper_id, "source_model": source_model,
                           "target_model": target_model, "benefit": []}
    with Client(kvtd, timeout=timeout) as client:
        for name, ws in cut:
            out["benefit"].append(measure_text(client, mapper_id, source, target, name, ws,
                                               context, seed))
    return out


# -- recording into the manifest -----------------------------------------------------------------

def record_document(result: Dict[str, Any]) -> Dict[str, Any]:
    """What `kvt record-benefit --benefit=FILE` reads: {"benefit": [entries]} with only the
    manifest's quality.benefit keys."""
    return {"benefit": [{key: entry[key] for key in RECORD_KEYS} for entry in result["benefit"]]}


def find_kvt_binary(explicit: Optional[str] = None) -> str:
    """--kvt_binary, else `kvt` on PATH, else bazel-bin/cli/kvt of the working directory or of
    the checkout this file is in."""
    if explicit:
        return explicit
    on_path = shutil.which("kvt")
    if on_path:
        return on_path
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.getcwd(), os.path.normpath(os.path.join(here, "..", "..", ".."))):
        candidate = os.path.join(root, "bazel-bin", "cli", "kvt")
        if os.access(candidate, os.X_OK):
            return candidate
    raise QualifyError("--record: no kvt binary (give --kvt_binary=PATH, put `kvt` on PATH, or "
                       "bazel build //cli:kvt in the checkout)")


def record(result: Dict[str, Any], mapper_dir: str, kvt_binary: Optional[str] = None) -> str:
    """Runs `kvt record-benefit --mapper=MAPPER_DIR --benefit=<file>` on the result's entries;
    returns its output. QualifyError with its output when it fails."""
    binary = find_kvt_binary(kvt_binary)
    with tempfile.TemporaryDirectory(prefix="kvt-qualify-") as tmp:
        path = os.path.join(tmp, "benefit.json")
        with open(path, "w") as f:
            json.dump(record_document(result), f, indent=2)
        cmd = [binary, "record-benefit", f"--mapper={mapper_dir}", f"--benefit={path}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise QualifyError(f"--record: {' '.join(cmd)}: {e}") from None
    if done.returncode != 0:
        raise QualifyError(f"--record: {' '.join(cmd)} failed ({done.returncode}):\n"
                           f"{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


# -- command line --------------------------------------------------------------------------------

def summary(result: Dict[str, Any]) -> str:
    """The result as a table, one row per text."""
    rows = [f"mapper {result['mapper_id']}: {result['source_model']} -> {result['target_model']}",
            f"{'text':<20} {'windows':>7} {'ctx+cont':>9} {'recovered':>9} {'95% interval':>17} "
            f"{'KL':>8} {'CE own':>8} {'none':>8} {'mapped':>8} {'seconds':>8}"]
    for e in result["benefit"]:
        rows.append(f"{e['text']:<20} {e['windows']:>7} "
                    f"{e['context_tokens']:>5}+{e['continuation_tokens']:<3} "
                    f"{e['recovered']:>9.3f} [{e['lower95']:>7.3f}, {e['upper95']:>7.3f}] "
                    f"{e['kl']:>8.4f} {e['ce_own']:>8.4f} {e['ce_none']:>8.4f} "
                    f"{e['ce_mapped']:>8.4f} {e['seconds']:>8.1f}")
    if result["benefit"]:
        worst = min(result["benefit"], key=lambda e: e["lower95"])
        rows.append(f"worst lower95 (what the quality gate reads): {worst['lower95']:.3f} "
                    f"({worst['text']})")
    return "\n".join(rows)


def parse_text(value: str) -> Tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"'{value}': expected NAME=PATH")
    return name, path


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvt.qualify", description=(
        "Measure the context benefit a mapper's translated cache recovers on the target model, "
        "per text source, with a 95%% paired bootstrap interval over windows."))
    p.add_argument("--kvtd", required=True, help="kvtd address HOST:PORT serving the mapper")
    p.add_argument("--mapper_id", required=True)
    p.add_argument("--source_model", required=True, help="Hugging Face model directory")
    p.add_argument("--target_model", required=True, help="Hugging Face model directory")
    p.add_argument("--text", action="append", type=parse_text, default=[], metavar="NAME=PATH",
                   help="a text sample (.txt: one document; .jsonl: a 'text' field per line); "
                        "repeat for each kind of text served")
    p.add_argument("--tokenizer", default="auto", choices=("auto", "bytes"))
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--record", metavar="MAPPER_DIR",
                   help="write the figures into the mapper's manifest (kvt record-benefit)")
    p.add_argument("--kvt_binary", help="the kvt binary for --record")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--device", default="cpu",
                   help="where the models run (torch device: cpu, cuda, cuda:1, ...)")
    p.add_argument("--timeout", type=float, default=300.0, help="per translate call, seconds")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default, one per core). On a machine "
                        "kvtd shares, 1 keeps the two from oversubscribing the cores "
                        "(docs/OPERATIONS.md)")
    args = p.parse_args(argv)
    if args.threads < 0:
        print(f"kvt.qualify: error: --threads={args.threads} must be >= 0", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        result = qualify(args.kvtd, args.mapper_id, args.source_model, args.target_model,
                         args.text, tokenizer=args.tokenizer, windows=args.windows,
                         context=args.context, continuation=args.continuation, seed=args.seed,
                         dtype=args.dtype, timeout=args.timeout, device=args.device)
        print(summary(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
        if args.record:
            sys.stdout.write(record(result, args.record, args.kvt_binary))
    except QualifyError as e:
        print(f"kvt.qualify: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
