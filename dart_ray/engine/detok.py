"""Incremental detokenisation: decode only a small window of new tokens per step.

The window starts at the tokens emitted in the previous chunk (``prefix_offset``) so that
leading-space handling matches decoding the whole sequence; text is emitted only when the window
does not end in a replacement character (a UTF-8 character split across byte-level tokens).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, new_ids: list[int]) -> str:
        """Append token ids; return the newly readable text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset],
                                 skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""
