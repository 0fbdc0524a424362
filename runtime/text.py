"""Text <-> token ids in the runtime, from the tokenizer a .pib carries.

The compiler writes the model's tokenizer in its serialized form (``picc.frontend.tokenizer``:
``{"format": "picc-tokenizer", "version": 1, "bos_id", "eos_id", "stop_ids", "add_bos", "add_eos",
"chat_template", "backend": tokenizer.json}``), which was made to be read with nothing but the
``tokenizers`` library: the backend turns text into ids without special tokens, and BOS / EOS are
added here. ``stop_ids`` are the tokens that end a reply (EOS and any others the model names;
absent in older files: EOS alone). ``chat_template`` (absent in older files: no template) is
rendered by ``runtime.chat``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import tokenizers


def partial_end(text: str, strings: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``strings`` (and is not all of
    it): text a stream holds back until the next text shows whether it is one of them."""
    return max((k for s in strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class TextCodec:
    """Encode and decode text as the model's own tokenizer does."""

    def __init__(self, document: str) -> None:
        data = json.loads(document)
        if data.get("format") != "picc-tokenizer" or data.get("version") != 1:
            raise ValueError("not a picc tokenizer (version 1)")
        self.backend = tokenizers.Tokenizer.from_str(json.dumps(data["backend"]))
        self.bos_id: int | None = data["bos_id"]
        self.eos_id: int | None = data["eos_id"]
        stops = data.get("stop_ids", [] if self.eos_id is None else [self.eos_id])
        self.stop_ids: frozenset[int] = frozenset(int(t) for t in stops)
        # The model's recommended sampling parameters (a server's defaults): absent in older files.
        self.sampling: dict[str, float] = {str(k): float(v) for k, v in (data.get("sampling") or {}).items()}
        self.add_bos: bool = bool(data["add_bos"])
        self.add_eos: bool = bool(data.get("add_eos", False))
        self.chat_template: str | None = data.get("chat_template")
        # Chat templates write BOS / EOS as text ({{ bos_token }}), so they need their spelling.
        self.bos_token: str | None = self._spelling(self.bos_id)
        self.eos_token: str | None = self._spelling(self.eos_id)

    def _spelling(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def _ids(self, text: str) -> list[int]:
        # encode_batch, unlike encode, lets go of the GIL while it works: a server's event loop and
        # engine go on meanwhile (a 5 MB prompt takes the tokenizer seconds).
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Ids of prompt ``text``: with the BOS (and EOS) the model's tokenizer adds, unless not ``special``."""
        ids = self._ids(text)
        if special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a prompt rendered by a chat template, with no BOS / EOS added.

        The template writes every special token the prompt needs (BOS included, where the model
        wants one), so adding BOS again would double it; transformers' ``apply_chat_template``
        likewise encodes its rendering with ``add_special_tokens=False``.
        """
        return self._ids(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)
