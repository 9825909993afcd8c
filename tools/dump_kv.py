#!/usr/bin/env python3
"""Dump the KV cache of a Hugging Face causal LM over a text corpus, for `kvt fit`.

Runs the model over windows of --tokens tokens of a corpus and writes, per window,
one safetensors file in kvt's KV dump format (docs/FIT.md):

    <out>/seq00000.safetensors
        layers.{j}.k   [num_kv_heads, T, head_dim]   keys as the cache holds them (post-RoPE)
        layers.{j}.v   [num_kv_heads, T, head_dim]
        __metadata__   rope=post, position_offset=0, position_stride, tokens, model, corpus,
                       tokens_sha256 (kvt fit checks both models saw the same tokens)
    <out>/config.json                                 the model's config, for --source_config

Run it once per model with the same corpus, tokenizer and settings: `kvt fit` pairs the two
directories by file name. Every window starts at position 0 (an independent forward pass), as
the calibration of SPEC 4 assumes.

    python3 tools/dump_kv.py --model Qwen/Qwen3-14B --corpus fineweb.jsonl --out dumps/14b \\
        --tokens 1024 --sequences 500 --dtype bf16 --device cuda

Options worth knowing:
  --sample spread  (default) the --sequences windows are spread evenly over the whole corpus
                   (the corpus is tokenized twice: once to count); `first` takes its first
                   windows, which for a corpus of long documents means a handful of documents.
  --keep_every N   store only positions 0, N, 2N, ... (N times less disk; metadata
                   position_stride tells kvt fit the true positions, so stripping RoPE stays
                   exact). `kvt fit --stride` then subsamples further; use one or the other.
  --queries        also store the model's post-RoPE queries, `queries.{j}` [num_heads, T,
                   head_dim] (the input of kvt fit --kind both's held-out attention-output
                   cosine, SPEC 5; `kvt fit` ignores them otherwise). Captured by wrapping the
                   modeling module's apply_rotary_pos_emb, so any q normalisation (Qwen3's
                   q_norm) is included; T x num_heads x head_dim more values per layer.
  --tokenizer bytes  a built-in byte-level tokenizer (token = UTF-8 byte), for tiny test
                   models without tokenizer files; otherwise the model's own AutoTokenizer.
  corpus: a .txt file (documents separated by blank lines) or .jsonl (--text_field, default
  "text"). Documents are tokenized, joined with the EOS token and cut into windows.

Needs torch, transformers and safetensors (the project venv: scripts/bootstrap.sh --python). No
network access is attempted for local model directories.
"""

import argparse
import hashlib
import json
import os
import struct
import sys


def read_documents(path, text_field):
    """Yields the corpus documents in order."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for number, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path} line {number}: not JSON: {e}")
                if text_field not in record or not isinstance(record[text_field], str):
                    raise SystemExit(f"{path} line {number}: no string field '{text_field}'")
                yield record[text_field]
        else:
            document = []
            for line in f:
                if line.strip():
                    document.append(line)
                elif document:
                    yield "".join(document)
                    document = []
            if document:
                yield "".join(document)


def byte_tokenizer_class():
    """The byte-level tokenizer (token = UTF-8 byte, EOS 0; tiny models with a vocabulary of at
    least 256). Its one home is the kvt package (kvt.text.ByteTokenizer, which kvt.qualify cuts
    text with), imported only when asked for, so that dumping a Hugging Face model with its own
    tokenizer needs no kvt on the path."""
    try:
        from kvt.text import ByteTokenizer
    except ImportError as e:
        raise SystemExit(f"--tokenizer bytes: the kvt package (clients/python) is not importable "
                         f"({e}); run through Bazel (//tools:dump_kv) or pip install "
                         "clients/python") from None
    return ByteTokenizer


def __getattr__(name):
    # dump_kv.ByteTokenizer, as the family's code and the harness have always named it.
    if name == "ByteTokenizer":
        return byte_tokenizer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_tokenizer(name, model_path):
    if name == "bytes":
        return byte_tokenizer_class()()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name or model_path)

    class Wrapped:
        eos_token_id = tokenizer.eos_token_id

        def encode(self, text):
            return tokenizer.encode(text, add_special_tokens=False)

    return Wrapped()


def windows(token_stream, size, count):
    """Consecutive non-overlapping windows of `size` tokens, at most `count`."""
    buffer = []
    produced = 0
    for ids in token_stream:
        buffer.extend(ids)
        while len(buffer) >= size and produced < count:
            yield buffer[:size]
            buffer = buffer[size:]
            produced += 1
        if produced >= count:
            return


def spread_windows(make_stream, size, count):
    """`count` of the corpus's consecutive windows of `size` tokens, evenly spaced from its first
    window to its last, so a calibration set samples every part of the corpus rather than its
    first documents. make_stream() yields the documents' token lists; it is read twice (once to
    count the windows), so memory stays at one window whatever the corpus size."""
    total = sum(len(ids) for ids in make_stream()) // size
    if total <= count:
        yield from windows(make_stream(), size, count)
        return
    picks = {i * (total - 1) // max(1, count - 1) for i in range(count)}
    for index, window in enumerate(windows(make_stream(), size, total)):
        if index in picks:
            yield window


_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def write_safetensors(path, tensors, metadata):
    """Writes {name: torch tensor} as a safetensors file (the safetensors package; metadata
    values as strings), atomically: a reader never sees a partial file."""
    from safetensors.torch import save_file

    tmp = path + ".tmp"
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()},
              tmp, metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)


def read_safetensors(path):
    """{name: torch tensor} of a safetensors file (the inverse of write_safetensors)."""
    from safetensors.torch import load_file

    return load_file(path)


def read_safetensors_metadata(path):
    """The __metadata__ strings of a safetensors file (empty when it has none)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def legacy_cache(past_key_values):
    """[(k, v)] per layer, whatever cache class this transformers version returns: the `layers`
    of DynamicLayer objects (transformers >= 4.54; 5.x has no to_legacy_cache), an older
    DynamicCache's to_legacy_cache(), or a legacy tuple of (k, v) pairs as it is."""
    if hasattr(past_key_values, "layers") and not isinstance(past_key_values, (tuple, list)):
        return [(layer.keys, layer.values) for layer in past_key_values.layers]
    if hasattr(past_key_values, "to_legacy_cache"):
        return past_key_values.to_legacy_cache()
    return [(k, v) for k, v in past_key_values]


class QueryCapture:
    """Records the rotated queries of every attention layer during a forward pass by wrapping the
    modeling module's apply_rotary_pos_emb(q, k, cos, sin, ...) -> (q_embed, k_embed), which
    Llama, Mistral, Qwen2/3 and their relatives call once per layer, in layer order."""

    def __init__(self, model):
        import importlib

        self.module = importlib.import_module(type(model).__module__)
        self.original = getattr(self.module, "apply_rotary_pos_emb", None)
        if self.original is None:
            raise SystemExit(f"--queries: {self.module.__name__} has no apply_rotary_pos_emb to "
                             "capture queries from")
        self.captured = []

        def hooked(q, k, *args, **kwargs):
            q_embed, k_embed = self.original(q, k, *args, **kwargs)
            self.captured.append(q_embed.detach())
            return q_embed, k_embed

        self.module.apply_rotary_pos_emb = hooked

    def close(self):
        self.module.apply_rotary_pos_emb = self.original

    def take(self, num_layers):
        """The queries of the last forward pass, [batch, heads, T, d] per layer."""
        got, self.captured = self.captured, []
        if len(got) != num_layers:
            raise SystemExit(f"--queries: captured {len(got)} query tensors for {num_layers} "
                             "layers (this architecture does not call apply_rotary_pos_emb once "
                             "per layer)")
        return got


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model id or local directory")
    parser.add_argument("--corpus", required=True, help=".txt or .jsonl")
    parser.add_argument("--text_field", default="text", help="jsonl field holding the text")
    parser.add_argument("--out", required=True, help="directory for the dumps")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per window (T)")
    parser.add_argument("--sequences", type=int, default=500, help="windows to dump")
    parser.add_argument("--sample", default="spread", choices=["spread", "first"],
                        help="which windows: spread evenly over the whole corpus, or its first")
    parser.add_argument("--keep_every", type=int, default=1,
                        help="store positions 0, N, 2N, ... only")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokenizer", default="",
                        help="tokenizer id/dir (default: the model's), or 'bytes'")
    parser.add_argument("--queries", action="store_true",
                        help="also store post-RoPE queries, queries.{j} [heads, T, head_dim]")
    parser.add_argument("--corpus_name", default="",
                        help="recorded as metadata 'corpus' (default: the file name)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.sequences < 1 or args.keep_every < 1:
        raise SystemExit("--tokens, --sequences and --keep_every must be >= 1")

    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype)
    model.to(args.device).eval()
    tokenizer = load_tokenizer(args.tokenizer, args.model)
    capture = QueryCapture(model) if args.queries else None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        f.write(model.config.to_json_string())

    def stream():
        for document in read_documents(args.corpus, args.text_field):
            yield tokenizer.encode(document) + [tokenizer.eos_token_id]

    corpus_name = args.corpus_name or os.path.basename(args.corpus)
    written = 0
    picked = (spread_windows(stream, args.tokens, args.sequences) if args.sample == "spread"
              else windows(stream(), args.tokens, args.sequences))
    for index, ids in enumerate(picked):
        input_ids = torch.tensor([ids], device=args.device)
        with torch.no_grad():
            output = model(input_ids=input_ids, use_cache=True)
        tensors = {}
        for j, (k, v) in enumerate(legacy_cache(output.past_key_values)):
            # [batch, n_kv, T, d] -> [n_kv, T', d] of the kept positions.
            tensors[f"layers.{j}.k"] = k[0, :, ::args.keep_every, :].to(torch_dtype)
            tensors[f"layers.{j}.v"] = v[0, :, ::args.keep_every, :].to(torch_dtype)
        if capture is not None:
            # Named outside layers.* so KV readers (kvt's ReadCacheFile) tolerate them.
            for j, q in enumerate(capture.take(len(tensors) // 2)):
                tensors[f"queries.{j}"] = q[0, :, ::args.keep_every, :].to(torch_dtype)
        metadata = {
            "rope": "post",
            "position_offset": 0,
            "position_stride": args.keep_every,
            "tokens": args.tokens,
            "model": args.model,
            "corpus": corpus_name,
            "tokens_sha256": hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest(),
        }
        write_safetensors(os.path.join(args.out, f"seq{index:05d}.safetensors"), tensors, metadata)
        written += 1
        print(f"dump_kv: {written}/{args.sequences} windows", file=sys.stderr, end="\r")
    if capture is not None:
        capture.close()
    print(f"dump_kv: wrote {written} windows of {args.tokens} tokens to {args.out}",
          file=sys.stderr)
    if written < args.sequences:
        print(f"dump_kv: the corpus ran out after {written} windows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
