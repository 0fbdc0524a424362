"""Reading a Hugging Face ``config.json`` the way transformers 5.x does.

transformers fills every missing key with the config class's default, checks field types strictly
(an int field rejects ``64.0`` and ``true``), and turns the legacy ``rope_theta`` / ``rope_scaling``
keys into one ``rope_parameters`` dict. ``HFConfig`` gives typed access with the class default
passed at each call site, and one-line errors that name the file and the field;
``rope_from_config`` reproduces the RoPE normalisation (see docs/hf_semantics.md, 0.3).

One deliberate difference: the fields that fix tensor shapes (``hidden_size`` and friends) are
required. transformers would fall back to the 7B-model default, which can only match the weights
by accident.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from picc.errors import PiccError
from picc.frontend.llama import RopeSpec
from picc.ir.positional import yarn_freq_factors, yarn_mscale

_REQUIRED = object()

# transformers' ACT2FN names -> picc activation. Names that compute the same function share one
# picc activation: gelu_fast and gelu_accurate are the tanh approximation with rounded constants.
HF_ACTIVATIONS: dict[str, str] = {
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
}
_GATED_FORMS = {"relu": "reglu", "silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class HFConfig:
    """The parsed ``config.json`` of one checkpoint, with typed getters that name bad fields."""

    path: Path
    raw: dict[str, object]

    @staticmethod
    def read(directory: Path) -> HFConfig:
        """The ``config.json`` of checkpoint directory ``directory``."""
        return HFConfig.read_json(Path(directory) / "config.json")

    @staticmethod
    def read_json(path: Path) -> HFConfig:
        """Any JSON object file with config.json's conventions (also generation_config.json)."""
        try:
            raw = json.loads(path.read_text())
        except OSError as e:
            raise PiccError(f"{path}: cannot read ({e.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PiccError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise PiccError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return HFConfig(path, raw)

    def has(self, key: str) -> bool:
        return key in self.raw

    def _value(self, key: str, default: object) -> object:
        if key in self.raw:
            return self.raw[key]
        if default is _REQUIRED:
            raise PiccError(f"{self.path}: required field {key!r} is missing")
        return default

    def bad(self, key: str, value: object, expected: str) -> PiccError:
        return PiccError(f"{self.path}: field {key!r} must be {expected}, got {json.dumps(value)}")

    def integer(self, key: str, default: object = _REQUIRED, *, minimum: int = 1) -> int:
        """An integer field (``minimum`` or more); bools and floats are refused, as transformers does."""
        v = self._value(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.bad(key, v, f"an integer >= {minimum}")
        return v

    def opt_integer(self, key: str, default: int | None, *, minimum: int = 1) -> int | None:
        """An integer field that may be null (or absent, meaning ``default``)."""
        if self.raw.get(key, default) is None:
            return None
        return self.integer(key, default, minimum=minimum)

    def number(self, key: str, default: object = _REQUIRED) -> float:
        v = self._value(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.bad(key, v, "a number")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self._value(key, default)
        if not isinstance(v, bool):
            raise self.bad(key, v, "true or false")
        return v

    def truthy(self, key: str, default: bool) -> bool:
        """A ``bool | None`` field that the model tests for truth (Falcon's flags: null is false)."""
        v = self._value(key, default)
        if v is not None and not isinstance(v, bool):
            raise self.bad(key, v, "true, false or null")
        return bool(v)

    def string(self, key: str, default: object = _REQUIRED) -> str:
        v = self._value(key, default)
        if not isinstance(v, str):
            raise self.bad(key, v, "a string")
        return v

    def token_id(self, key: str, default: int | None) -> int | None:
        """``bos_token_id`` / ``eos_token_id``: an int, a list (the first is kept) or null."""
        v = self._value(key, default)
        if isinstance(v, list) and v:
            v = v[0]
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise self.bad(key, v, "a token id, a list of token ids or null")

    def token_ids(self, key: str) -> tuple[int, ...]:
        """``eos_token_id`` as ``generate`` stops at it: every id of a list, one id, or none."""
        v = self._value(key, None)
        ids = v if isinstance(v, list) else [] if v is None else [v]
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            return tuple(ids)
        raise self.bad(key, v, "a token id, a list of token ids or null")


def _longrope(cfg: HFConfig, params: dict, source: str, theta: float, head_dim: int, rotary_dim: int | None,
              max_position: int, positive: Callable[[str], float]) -> RopeSpec:
    """``_compute_longrope_parameters`` for contexts up to ``original_max_position_embeddings``,
    where transformers takes the short factors; ``attention_factor`` (the cosines' and sines'
    factor) defaults to ``sqrt(1 + ln(factor) / ln(original))``, ``factor`` to
    ``max_position_embeddings / original``. The long factors go with them: a compile for a longer
    context takes them (``longrope_for_context``)."""
    rotated = rotary_dim or head_dim
    original = positive("original_max_position_embeddings")
    if original != int(original) or original < 2:
        raise cfg.bad(f"{source}.original_max_position_embeddings", original, "an integer >= 2")
    factors = {}
    for key in ("short_factor", "long_factor"):
        v = params.get(key)
        if (not isinstance(v, list) or len(v) != rotated // 2
                or not all(isinstance(f, int | float) and not isinstance(f, bool) and f > 0 for f in v)):
            raise cfg.bad(f"{source}.{key}", v, f"a list of {rotated // 2} numbers > 0 (one per rotary pair)")
        factors[key] = tuple(float(f) for f in v)
    factor = positive("factor") if params.get("factor") is not None else max_position / original
    if params.get("attention_factor") is not None:
        attention = positive("attention_factor")
    else:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeSpec(theta=theta, rotary_dim=rotary_dim, scaling="longrope", original_max_position=int(original),
                    freq_factors=factors["short_factor"], long_factors=factors["long_factor"],
                    attention_factor=attention)


def _yarn(cfg: HFConfig, params: dict, source: str, theta: float, head_dim: int, max_position: int,
          positive: Callable[[str], float]) -> RopeSpec:
    """``_compute_yarn_parameters``: each pair's frequency divided by its factor from
    :func:`yarn_freq_factors` (``beta_fast`` 32 and ``beta_slow`` 1 where null or 0, ``truncate``
    true by default; gpt-oss sets it false), the cosines and sines times ``attention_factor``,
    which defaults to ``yarn_mscale(factor)``, or with ``mscale`` and ``mscale_all_dim`` both
    non-zero (DeepSeek's) to ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``.
    A null ``factor`` is ``max_position_embeddings / original``. Static: every position rotates
    alike, past the original context too."""
    original = positive("original_max_position_embeddings")
    if original != int(original):
        raise cfg.bad(f"{source}.original_max_position_embeddings", original, "an integer >= 1")
    factor = max_position / original if params.get("factor", 0) is None else positive("factor")
    if factor < 1:
        raise cfg.bad(f"{source}.factor", params.get("factor", factor), "a number >= 1")

    def number(key: str, default: float) -> float:  # as transformers reads them: null and 0 mean the default
        v = params.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
            raise cfg.bad(f"{source}.{key}", v, "a number >= 0 or null")
        return float(v or default)

    beta_fast, beta_slow = number("beta_fast", 32.0), number("beta_slow", 1.0)
    if beta_fast < beta_slow:
        raise PiccError(f"{cfg.path}: {source} needs beta_fast >= beta_slow for yarn rope, got {beta_fast} and "
                        f"{beta_slow}")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise cfg.bad(f"{source}.truncate", truncate, "true or false")
    mscale, mscale_all_dim = number("mscale", 0.0), number("mscale_all_dim", 0.0)
    if params.get("attention_factor") is not None:
        attention = positive("attention_factor")
    elif mscale and mscale_all_dim:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention = yarn_mscale(factor)
    return RopeSpec(theta=theta, scaling="yarn", factor=factor, original_max_position=int(original),
                    freq_factors=yarn_freq_factors(head_dim, theta, factor, int(original), beta_fast, beta_slow,
                                                   truncate), attention_factor=attention)


def ffn_form(cfg: HFConfig, key: str, default: str, *, gated: bool) -> str:
    """The picc FFN form for activation field ``key``: ``act`` itself, or its GLU form."""
    name = cfg.raw.get(key, default)
    act = HF_ACTIVATIONS.get(name) if isinstance(name, str) else None
    if act is None:
        raise PiccError(f"{cfg.path}: {key} {json.dumps(name)} is not supported (supported: "
                        f"{', '.join(HF_ACTIVATIONS)})")
    return _GATED_FORMS[act] if gated else act


def rope_parameters(cfg: HFConfig) -> tuple[str, dict]:
    """The rope's dict as transformers reads it, and the key it came from: a non-empty legacy
    ``rope_scaling`` wins over ``rope_parameters`` (a copy; empty where neither is set)."""
    legacy = cfg.raw.get("rope_scaling")
    source = "rope_scaling" if legacy else "rope_parameters"
    params = legacy or cfg.raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise cfg.bad(source, params, "an object")
    return source, dict(params)


def rope_from_config(cfg: HFConfig, head_dim: int, max_position: int, *, partial: bool = False) -> RopeSpec:
    """The rope op's settings from ``rope_parameters`` or the legacy ``rope_theta``/``rope_scaling``.

    As ``convert_rope_params_to_dict`` and ``standardize_rope_params``: a non-empty
    ``rope_scaling`` wins over ``rope_parameters``; ``rope_theta`` (top level, else 10000) and a
    top-level ``partial_rotary_factor`` fill in missing keys; ``rope_type`` beats the legacy
    ``type``; for llama3 a top-level ``original_max_position_embeddings`` beats the dict's, which
    defaults to ``max_position_embeddings``. ``partial``: the family rotates only the first
    ``head_dim * partial_rotary_factor`` features of a head with default rope (Phi-3's does).
    """
    source, params = rope_parameters(cfg)
    if "full_attention" in params or "sliding_attention" in params:
        raise PiccError(f"{cfg.path}: {source} per layer type is not supported (one dict for all "
                        "layers is)")
    params.setdefault("rope_theta", cfg.raw.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in cfg.raw:
        params.setdefault("partial_rotary_factor", cfg.raw["partial_rotary_factor"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise PiccError(f"{cfg.path}: rope type {json.dumps(rope_type)} is not supported (supported: "
                        f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    if head_dim % 2:
        raise PiccError(f"{cfg.path}: head dim {head_dim} is odd; rotary embeddings need an even one")

    def positive(key: str) -> float:
        v = params.get(key)
        if key not in params:
            raise PiccError(f"{cfg.path}: {source} of rope type {rope_type!r} needs {key!r}")
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise PiccError(f"{cfg.path}: {source}.{key} must be a number > 0, got {json.dumps(v)}")
        return float(v)

    theta = positive("rope_theta")
    prf = params.get("partial_rotary_factor", 1.0)
    # transformers ignores partial_rotary_factor for LLaMA's default rope (it always rotates
    # head_dim); Phi-3 rotates int(head_dim * factor) and passes the rest through, with its
    # default rope and with longrope (Phi-4-mini).
    if partial and prf != 1.0 and rope_type in ("default", "longrope"):
        if isinstance(prf, bool) or not isinstance(prf, int | float) or not 0 < prf < 1 or int(head_dim * prf) % 2:
            raise cfg.bad("partial_rotary_factor", prf, f"a number in (0, 1] that leaves an even share of {head_dim}")
        rotary_dim: int | None = int(head_dim * prf)
    else:
        rotary_dim = None
    if rope_type == "default":
        return RopeSpec(theta=theta, rotary_dim=rotary_dim)
    if prf != 1.0 and rotary_dim is None:
        # transformers shrinks inv_freq for the scaled types but not the rotation: its forward fails.
        raise PiccError(f"{cfg.path}: partial_rotary_factor {json.dumps(prf)} with rope type "
                        f"{rope_type!r} is not supported (transformers cannot run it either)")
    if rope_type == "linear":
        return RopeSpec(theta=theta, scaling="linear", factor=positive("factor"))
    if "original_max_position_embeddings" in cfg.raw:
        params["original_max_position_embeddings"] = cfg.raw["original_max_position_embeddings"]
    params.setdefault("original_max_position_embeddings", max_position)
    if rope_type == "longrope":
        return _longrope(cfg, params, source, theta, head_dim, rotary_dim, max_position, positive)
    if rope_type == "yarn":
        return _yarn(cfg, params, source, theta, head_dim, max_position, positive)
    low, high = positive("low_freq_factor"), positive("high_freq_factor")
    if high <= low:
        raise PiccError(f"{cfg.path}: {source} needs high_freq_factor > low_freq_factor for llama3 "
                        f"rope, got {high} and {low}")
    original = positive("original_max_position_embeddings")
    if original != int(original):
        raise PiccError(f"{cfg.path}: original_max_position_embeddings must be an integer, got "
                        f"{original}")
    return RopeSpec(theta=theta, scaling="llama3", factor=positive("factor"), low_freq_factor=low,
                    high_freq_factor=high, original_max_position=int(original))
