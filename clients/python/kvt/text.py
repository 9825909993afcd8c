"""Text as token windows, the way the evaluation (docs/EVAL.md) and kvt.qualify cut it: the
byte-level tokenizer of the bundled tiny family (one token per UTF-8 byte, EOS 0; also
tools/dump_kv.py's `--tokenizer bytes`), a Hugging Face tokenizer wrapped to the same two
members (encode, eos_token_id), text files read as documents, and windows of one length spread
evenly over a token stream. numpy only; transformers is imported when a Hugging Face tokenizer
is loaded.
"""

from __future__ import annotations

import json
from typing import Any, List, Optional, Sequence

import numpy as np


class ByteTokenizer:
    """Token = UTF-8 byte; EOS = 0. For tiny models with a vocabulary of at least 256."""

    eos_token_id: Optional[int] = 0

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))


class HfTokenizer:
    """A transformers tokenizer with encode() that adds no special tokens (the windows are cut
    from a stream of documents; BOS / EOS are placed by the stream, not per encode call)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id

    @classmethod
    def load(cls, directory: str) -> "HfTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(directory))

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def read_documents(path: str, text_field: str = "text") -> List[str]:
    """The documents of a text file: a `.jsonl` file's `text_field` per non-empty line, in order;
    any other file (UTF-8 text) is one document. ValueError names the file and line of a bad
    record."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
            return [f.read()]
        documents = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path} line {number}: not JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path} line {number}: no string field '{text_field}'")
            documents.append(record[text_field])
        return documents


def token_stream(documents: Sequence[str], tokenizer: Any) -> List[int]:
    """The documents' tokens end to end, each followed by the tokenizer's EOS (when it has one),
    as the evaluation streams its held-out documents and license texts."""
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    return [t for text in documents for t in list(tokenizer.encode(text)) + eos]


def spread_windows(tokens: Sequence[int], length: int, count: int) -> List[List[int]]:
    """`count` windows of `length` tokens spread evenly over the stream: of its len // length
    consecutive whole windows, the first, the last and evenly spaced ones between (all of them
    when there are at most `count`, so fewer than `count` come back then). ValueError when the
    stream holds no whole window."""
    n = len(tokens) // length
    if n == 0:
        raise ValueError(f"a stream of {len(tokens)} tokens holds no window of {length}")
    picks = np.linspace(0, n - 1, min(count, n)).astype(int)
    return [list(tokens[i * length:(i + 1) * length]) for i in picks]
