"""kvt.Session: incremental handoffs of one conversation (the Python TranslateSession). Each turn
sends the source tokens added since the previous handoff, at absolute positions continuing where
the last turn stopped, and appends their translation to the target cache it keeps.

The pieces equal one translation of the whole sequence for every mapper:

* A token-wise mapper (MapperInfo.window 1, or 0 from an older server; SPEC 3) maps each token on
  its own, so a turn sends only its added tokens.
* A window mapper (window w > 1; docs/MAPPER_FORMAT.md, "Window mappers") maps token p from the
  source cache of tokens p, p-1, ..., p-w+1 of the same request. The session keeps a copy of the
  last w-1 source tokens of the turns so far (same dtype and layout), sends them again in front
  of each later turn's added tokens, at their own positions, and drops their outputs, so every
  output token sees the same predecessors as in one request. A turn shorter than w-1 tokens is
  fine: the kept tail then spans several turns. A turn the client splits
  (Client.max_request_tokens) is split with the same overlap by Client.translate.

Every response header names the window of the mapper version that served it
(TranslateResponseHeader.window), so the session needs no extra call: a turn keeps the last
window - 1 source tokens for the next one. Each turn's window is checked against the overlap it
carried, so a later turn served with a larger window (a pair re-resolved to another mapper after
a store reload, or a mapper hot-reloaded under the same id) is refused (FailedPreconditionError,
the session unchanged: start a new session). A server older than that field reports 0; the
window then comes from get_mapper, once per mapper the responses name.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional, Tuple

import numpy as np

from kvt.cache import KVCache
from kvt.client import Client
from kvt.errors import FailedPreconditionError, InternalError, InvalidArgumentError, KvtError
from kvt.response import TranslateResult


class Session:
    """Name the pair or the mapper once; call extend() with each turn's new source tokens.

    `target` is the translated cache of every token so far (None before the first turn),
    `tokens` their count, `turns` the turns completed. Turns are numbered from 1 in the headers
    (kvtd's drift telemetry buckets them); `session_id` defaults to a random id. `window` is the
    serving mapper's window once known (1 before: token-wise) and `kept_tokens` the source tokens
    kept for the next turn's overlap (min(window - 1, tokens)).
    """

    def __init__(self, client: Client, *, mapper_id: str = "", source_model: str = "",
                 target_model: str = "", output_dtype: Optional[str] = None,
                 output_layout: Optional[str] = None, session_id: Optional[str] = None,
                 start_position: int = 0, timeout: Optional[float] = None) -> None:
        if not mapper_id and not (source_model and target_model):
            raise InvalidArgumentError("session: set mapper_id, or source_model and target_model")
        self._client = client
        self._mapper_id = mapper_id
        self._source_model = source_model
        self._target_model = target_model
        self._output_dtype = output_dtype
        self._output_layout = output_layout
        self._timeout = timeout
        self.session_id = session_id or uuid.uuid4().hex
        self.start_position = start_position
        self.tokens = 0
        self.turns = 0
        self.target: Optional[KVCache] = None
        self.window = 1
        self._source_form: Optional[Tuple[Any, ...]] = None
        self._window_mapper = ""  # the mapper that served the last turn
        self._tail: Optional[KVCache] = None  # the last min(window - 1, tokens) source tokens

    @property
    def kept_tokens(self) -> int:
        return 0 if self._tail is None else self._tail.num_tokens

    def extend(self, added: KVCache, **header_fields: Any) -> TranslateResult:
        """Translates `added` (every source layer, only the new tokens) at positions
        [start_position + tokens, ... + added.num_tokens) and appends the result to `target`.

        Returns this turn's result: its target holds only the added tokens' translation and
        header.num_tokens their count; the trailer is the server's for what was sent, so with a
        window mapper its num_tokens and input_bytes include the w - 1 re-sent tokens. On any
        error the session is unchanged (the turn may be retried)."""
        turn = self.turns + 1
        form = (added.dtype, added.layout, added.num_layers, added.num_kv_heads, added.head_dim)
        if self._source_form is not None and form != self._source_form:
            raise InvalidArgumentError(
                f"session {self.session_id}: turn {turn} has dtype/layout/layers/heads/"
                f"head_dim {form}, earlier turns {self._source_form}")
        if added.num_tokens == 0:
            raise InvalidArgumentError(f"session {self.session_id}: turn {turn} adds no tokens")
        tail = self._tail
        overlap = 0 if tail is None else tail.num_tokens
        request = added if tail is None else KVCache.concat([tail, added])
        result = self._client.translate(
            request, position_offset=self.start_position + self.tokens - overlap,
            output_dtype=self._output_dtype, output_layout=self._output_layout,
            session_id=self.session_id, turn=turn, timeout=self._timeout,
            mapper_id=self._mapper_id, source_model=self._source_model,
            target_model=self._target_model, **header_fields)
        if result.target is None or result.target.num_tokens != request.num_tokens:
            raise InternalError(
                f"session {self.session_id}: turn {turn} sent {request.num_tokens} tokens "
                f"and got {0 if result.target is None else result.target.num_tokens} back")
        served = result.header.mapper_id or self._mapper_id
        window = result.header.window
        if window == 0:  # a server older than the response's window
            window = self.window
            if served and served != self._window_mapper:
                _, window = self._learn_window(turn, served, translated=True)
        # The overlap sent covers a window of window - 1 unless the request began at the
        # sequence's first token (nothing before it to re-send).
        if overlap < self.tokens and window - 1 > overlap:
            raise FailedPreconditionError(
                f"session {self.session_id}: turn {turn} was served by mapper {served!r} with "
                f"window {window}, earlier turns by {self._window_mapper!r} with window "
                f"{self.window} (another mapper, or the same one reloaded); it re-sent {overlap} "
                f"earlier tokens where the window needs {window - 1}, so it would not equal one "
                f"translation; start a new session")
        piece = result.drop_leading(overlap).target
        assert piece is not None
        self.target = piece if self.target is None else KVCache.concat([self.target, piece])
        # The next turn's overlap: the last window - 1 source tokens so far (all while fewer),
        # which the request ends with; copied, as the caller may reuse its buffers.
        keep = min(window - 1, request.num_tokens)
        if keep > 0:
            kept = request.slice_tokens(request.num_tokens - keep, request.num_tokens)
            self._tail = KVCache(k=[np.array(a) for a in kept.k], v=[np.array(a) for a in kept.v],
                                 layout=kept.layout, dtype=kept.dtype)
        else:
            self._tail = None
        if served:
            self._window_mapper = served
        self.window = window
        self._source_form = form
        self.tokens += added.num_tokens
        self.turns += 1
        return result

    def _learn_window(self, turn: int, mapper_id: str, translated: bool = False
                      ) -> Tuple[str, int]:
        """(mapper id, window) of `mapper_id`; a KvtError of the same code, naming the session,
        when the call fails."""
        try:
            info = self._client.get_mapper(mapper_id, timeout=self._timeout)
        except KvtError as error:
            note = f" (turn {turn} was translated but is not recorded)" if translated else ""
            raise type(error)(f"session {self.session_id}: turn {turn}: GetMapper({mapper_id!r}) "
                              f"for the mapper's window: {error.details}{note}",
                              error.code) from error
        return info.mapper_id or mapper_id, max(1, int(info.window))
