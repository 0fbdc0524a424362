"""What a frontend produces: a module, its weights, and the model's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from picc.ir.module import Module
from picc.ir.weights import WeightStore

if TYPE_CHECKING:
    from picc.frontend.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    """A model in picc's hands: IR, weight store and (when the source has one) tokenizer."""

    module: Module
    weights: WeightStore
    tokenizer: Tokenizer | None
    source: str
    notes: tuple[str, ...] = ()  # what the import changed that a user should know (tensors requantized)
