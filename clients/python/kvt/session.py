"""kvt.Session: incremental handoffs of one conversation (the Python TranslateSession). Each turn
sends only the source tokens added since the previous handoff, at absolute positions continuing
where the last turn stopped, and appends their translation to the target cache it keeps: the map
is token-wise (SPEC 3), so the pieces equal one translation of the whole."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Optional, Tuple

from kvt.cache import KVCache
from kvt.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvt.client import Client, TranslateResult


class Session:
    """Name the pair or the mapper once; call extend() with each turn's new source tokens.

    `target` is the translated cache of every token so far (None before the first turn),
    `tokens` their count, `turns` the turns completed. Turns are numbered from 1 in the headers
    (kvtd's drift telemetry buckets them); `session_id` defaults to a random id.
    """

    def __init__(self, client: "Client", *, mapper_id: str = "", source_model: str = "",
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
        self._source_form: Optional[Tuple[Any, ...]] = None

    def extend(self, added: KVCache, **header_fields: Any) -> "TranslateResult":
        """Translates `added` (every source layer, only the new tokens) at positions
        [start_position + tokens, ... + added.num_tokens) and appends the result to `target`.
        Returns this turn's result (its target holds only the added tokens)."""
        form = (added.dtype, added.layout, added.num_layers, added.num_kv_heads, added.head_dim)
        if self._source_form is not None and form != self._source_form:
            raise InvalidArgumentError(
                f"session {self.session_id}: turn {self.turns + 1} has dtype/layout/layers/heads/"
                f"head_dim {form}, earlier turns {self._source_form}")
        result = self._client.translate(
            added, position_offset=self.start_position + self.tokens,
            output_dtype=self._output_dtype, output_layout=self._output_layout,
            session_id=self.session_id, turn=self.turns + 1, timeout=self._timeout,
            mapper_id=self._mapper_id, source_model=self._source_model,
            target_model=self._target_model, **header_fields)
        piece = result.target
        assert piece is not None
        self.target = piece if self.target is None else KVCache.concat([self.target, piece])
        self._source_form = form
        self.tokens += added.num_tokens
        self.turns += 1
        return result
