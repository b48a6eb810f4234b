"""Incremental detokenization with stop strings, one :class:`IncrementalDetokenizer` per sequence.

Re-decoding the whole output on every token costs O(n) per token, O(n^2) per sequence. Instead, as vLLM's
incremental detokenizer does, each step decodes a small window: the tokens since the last character boundary
plus a few before them for context (``prefix_offset``/``read_offset``), and keeps the part after the
context's own text. The context matters for decoders whose text depends on what precedes (a SentencePiece
"▁" is a space only after other text); the boundary matters for byte-level BPE, where one character's UTF-8
bytes can span tokens: while the decoded window ends in U+FFFD (an incomplete character, or an invalid
byte) that text is held back, and the window keeps its start until the character completes.

The concatenated output equals ``tokenizer.decode(out_ids, skip_special_tokens=True)`` once flushed (the
held U+FFFD included, as the whole decode has them), cut at the first stop string: text that could be the
start of a stop string is held back until the next tokens rule that out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# A character's UTF-8 bytes span at most 4 tokens (each token carries >= 1 byte; skipped special tokens carry
# none). A window still ending in U+FFFD after this many tokens holds an invalid byte, which no later token
# changes: slide the window anyway, so a run of bad bytes cannot make each step decode more and more tokens.
_MAX_PENDING = 8

Decode = Callable[[Sequence[int]], str]


def fast_decode(tokenizer) -> Decode:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, straight on the Rust tokenizer where that is
    all the transformers wrapper would do (its argument checks cost ~3 us a call, against ~0.4 us for the
    1-2 token windows decoded here)."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if type(rust).__name__ == "Tokenizer" and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        def decode(ids: Sequence[int]) -> str:
            return rust.decode(ids, skip_special_tokens=True)
        return decode

    def decode_wrapped(ids: Sequence[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return decode_wrapped


class IncrementalDetokenizer:
    """Turns one sequence's tokens into text deltas. ``add(token, final)`` returns ``(delta, stopped)``;
    ``flush()`` returns what is still held (the sequence ended on EOS)."""

    __slots__ = ("_decode", "ids", "_prefix", "_read", "_prefix_text", "_sent", "stop", "_held", "stopped")

    def __init__(self, decode: Decode, stop: Sequence[str] = ()):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are never decoded again
        self._read = 0  # tokens before it (a character boundary) are in the output
        self._prefix_text = ""  # decode(ids[_prefix:_read]): the context, cut off the window's text
        self._sent = 0  # characters of the window's new text already passed on
        self.stop = [x for x in stop if x]
        self._held = ""  # passed the UTF-8 check, held back as a possible start of a stop string
        self.stopped = False

    def add(self, token: int, final: bool = False) -> tuple[str, bool]:
        """Take the next token; return the text that may be sent now and whether a stop string ended the
        text (the delta is then cut before it). ``final``: the last token, release everything."""
        self.ids.append(token)
        return self._filter(self._new_text(final), final)

    def flush(self) -> str:
        """Everything still held (trailing U+FFFD of an incomplete character, a partial stop string)."""
        if self.stopped:
            return ""
        return self._filter(self._new_text(True), True)[0]

    def _new_text(self, final: bool) -> str:
        ids = self.ids
        text = self._decode(ids[self._prefix:])
        new = text[len(self._prefix_text):]
        end = len(new)
        if not final:
            while end > self._sent and new[end - 1] == "\ufffd":
                end -= 1
        if (end == len(new) and end > self._sent) or len(ids) - self._read >= _MAX_PENDING:
            # the window ends on a whole character: slide it, the new tokens become the next one's context (not
            # when they added nothing, e.g. a skipped special token: the context keeps some text)
            out = new[self._sent:]
            self._prefix, self._read = self._read, len(ids)
            self._prefix_text = self._decode(ids[self._prefix:self._read])
            self._sent = 0
            return out
        out = new[self._sent:end]
        self._sent = end
        return out

    def _filter(self, new: str, final: bool) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return new, False
        # A stop string can only start in the held text or later: text ending in a stop string's proper prefix
        # was held, so everything sent already is clear of any match.
        text = self._held + new if self._held else new
        cut = -1
        for x in self.stop:
            i = text.find(x)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return text[:cut], True
        if final:
            self._held = ""
            return text, False
        hold = 0
        for x in self.stop:  # the longest suffix of text that is a proper prefix of a stop string
            for k in range(min(len(x) - 1, len(text)), hold, -1):
                if text.endswith(x[:k]):
                    hold = k
                    break
        if hold:
            self._held = text[len(text) - hold:]
            return text[:len(text) - hold], False
        self._held = ""
        return text, False
