"""Token ids <-> text for the rollout side, and the agent's markup.

Engines run with ``--skip-tokenizer-init`` (token ids in and out); the agent loop owns the
tokenizer. :class:`ByteTokenizer` is the default for models made here from configs (no tokenizer
can be downloaded): 8 special tokens, then the 256 bytes (vocabulary 264). A Hugging Face
tokenizer with the same markup tokens added works behind the same three methods.

Markup (one special token each): a model turn that calls a tool ends with ``</call>`` and holds
``<call>COMMAND</call>``; an environment's answer to it is ``<obs>OUTPUT</obs>``; a final answer
is ``<answer>TEXT<eos>`` (or any turn ending in ``<eos>``).
"""
from __future__ import annotations

import re
from typing import Protocol, Sequence

PAD, BOS, EOS, CALL, END_CALL, OBS, END_OBS, ANSWER = (
    "<pad>", "<bos>", "<eos>", "<call>", "</call>", "<obs>", "</obs>", "<answer>")
SPECIALS = (PAD, BOS, EOS, CALL, END_CALL, OBS, END_OBS, ANSWER)


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_id(self, special: str) -> int: ...


class ByteTokenizer:
    """UTF-8 bytes plus the markup tokens: ids 0-7 are ``SPECIALS``, id ``8 + b`` is byte ``b``.

    ``encode`` maps markup strings to their special ids (so ``"<call>ls</call>"`` is 4 ids);
    ``decode`` is its inverse (undecodable byte runs become U+FFFD).
    """

    vocab_size = len(SPECIALS) + 256
    _split = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part in self._split.split(text):
            if not part:
                continue
            if part in SPECIALS:
                out.append(SPECIALS.index(part))
            else:
                out.extend(len(SPECIALS) + b for b in part.encode("utf-8"))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the byte tokenizer's vocabulary of {self.vocab_size}")
            if i < len(SPECIALS):
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(SPECIALS[i])
            else:
                buf.append(i - len(SPECIALS))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_id(self, special: str) -> int:
        return SPECIALS.index(special)
