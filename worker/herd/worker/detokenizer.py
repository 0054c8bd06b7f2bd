"""Incremental detokenization with stop strings, for streaming text one step at a time.

Text is decoded over a sliding window (vLLM's prefix/read offsets): the new text of a step is
``decode(window) - decode(window before the new tokens)``, held back while it ends in an incomplete
UTF-8 character. The window starts on the last prompt tokens so a leading space decodes as in the
full text. Stop strings are searched in the text produced so far; a match truncates the text at the
match (the stop string is not part of the output). Text that could still become the start of a
stop string is held back until it cannot, so no emitted delta ever has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

from herd.api.prompt import PromptRenderer

__all__ = ["IncrementalDetokenizer"]

_PROMPT_CONTEXT = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Feed generated ids with ``add``; read each step's new text from its return value."""

    def __init__(
        self, renderer: PromptRenderer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> None:
        self.renderer = renderer
        self.stop = tuple(s for s in stop if s)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self._num_emitted = 0
        self.is_stopped = False

    def add(self, token_ids: Sequence[int], *, is_last: bool = False, may_stop: bool = True) -> str:
        """Append ``token_ids``; returns the new text safe to emit (all of it when ``is_last``).

        ``may_stop`` False (``min_tokens`` not yet out) leaves stop strings unmatched, as vLLM does.
        """
        if self.is_stopped:
            return ""
        self._ids.extend(token_ids)
        self._decode_new(force=is_last)
        if may_stop:
            self._check_stop()
        end = (
            len(self.text)
            if is_last or self.is_stopped
            else max(self._num_emitted, len(self.text) - self._holdback)
        )
        delta = self.text[self._num_emitted : end]
        self._num_emitted = end
        return delta

    def _decode_new(self, *, force: bool) -> None:
        prefix = self.renderer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self.renderer.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and (force or not full.endswith(_INCOMPLETE)):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _check_stop(self) -> None:
        if not self.stop:
            return
        window_start = max(0, self._num_emitted - self._holdback)
        matches = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
        if matches:
            self.text = self.text[: min(matches)]
            self.is_stopped = True
