"""ONNX frontend: decoder LLMs exported by torch.onnx (dynamo), optimum or onnxruntime-genai.

``load_onnx`` reads the file (external data too), recognises the decoder by pattern over the
graph (``onnx_match``: an abstract interpretation of the data path; ``onnx_decoder``: the layer
structure) and emits IR with the same builders the Hugging Face and GGUF frontends use, so the
same model gives the same IR whichever way it arrives. See docs/onnx_frontend.md for the
recognised patterns.

An ONNX graph does not say which tokenizer, BOS/EOS ids or context length the model has; they are
read from files next to the .onnx when present (tokenizer.json and friends, Hugging Face's
config.json / generation_config.json as optimum writes them, or onnxruntime-genai's
genai_config.json), and are otherwise absent (then the model runs on token ids only).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from picc.errors import PiccError
from picc.frontend.hf_config import HFConfig
from picc.frontend.llama import LlamaSpec, build_llama
from picc.frontend.model import LoadedModel
from picc.frontend.onnx_decoder import Metadata, read_decoder
from picc.frontend.onnx_graph import Probe, load, opset_of
from picc.frontend.onnx_match import Act, Heads, Matcher, NoMatch
from picc.frontend.opt import OptSpec, build_opt
from picc.ir.module import Module
from picc.ir.weights import WeightStore

# Probe lengths: small (the auxiliary subgraphs are evaluated in numpy at this size), with past
# tokens when the graph has a KV cache so that the cache's part of the mask is checked too.
PROBE_NO_CACHE = Probe(seq=7, past=0)
PROBE_WITH_CACHE = Probe(seq=4, past=3)
MAX_LISTED = 12


def load_onnx(path: Path) -> LoadedModel:
    """Import the decoder LLM in ONNX file ``path``."""
    path = Path(path)
    model = load(path)
    has_cache = any("past" in vi.name for vi in model.graph.input)
    matcher = Matcher(model, PROBE_WITH_CACHE if has_cache else PROBE_NO_CACHE, opset_of(model))
    try:
        matcher.run()
    except NoMatch as e:
        raise PiccError(f"{path}: {e}") from None
    if matcher.problems:
        listed = "; ".join(str(p) for p in matcher.problems[:MAX_LISTED])
        more = len(matcher.problems) - MAX_LISTED
        kinds = sorted({p.op_type for p in matcher.problems})
        raise PiccError(f"{path}: cannot map {len(matcher.problems)} node(s) to picc IR (op types: "
                        f"{', '.join(kinds)}): {listed}" + (f"; and {more} more" if more > 0 else ""))
    logits = [(n, v) for n, v in matcher.outputs.items() if isinstance(v, Act)]
    others = [n for n, v in matcher.outputs.items() if not isinstance(v, Act | Heads)]
    if len(logits) != 1 or others:
        raise PiccError(f"{path}: expected one logits output (and optional present key/value outputs), "
                        f"got outputs {list(matcher.outputs)}")
    name = re.sub(r"[^\w.]", "_", path.stem if path.stem != "model" else path.resolve().parent.name) or "model"
    meta = replace(sidecar_metadata(path.parent), probe_keys=matcher.probe.total)
    decoder = read_decoder(matcher.recs, logits[0][1].rec, str(path), name, meta)
    module = _build(decoder.spec, decoder.store)
    return LoadedModel(module, decoder.store, _tokenizer(path.parent), source=str(path))


def _build(spec: LlamaSpec | OptSpec, store: WeightStore) -> Module:
    if isinstance(spec, OptSpec):
        return build_opt(spec, store)
    return build_llama(spec, store)


def sidecar_metadata(directory: Path) -> Metadata:
    """arch, BOS/EOS ids, context length and sliding windows from config files next to the model:
    Hugging Face's config.json (read as the HF frontend reads it), else genai_config.json."""
    config = directory / "config.json"
    if config.is_file():
        from picc.frontend.hf import LLAMA_FAMILIES, special_ids

        cfg = HFConfig.read(directory)
        family = cfg.raw.get("model_type")
        if family in LLAMA_FAMILIES:
            rules = LLAMA_FAMILIES[str(family)]
            bos, eos = special_ids(cfg, directory, *rules.special_ids)
            return Metadata(str(family), bos, eos, cfg.integer("max_position_embeddings", rules.max_position),
                            _config_windows(cfg))
        if family == "opt":
            bos, eos = special_ids(cfg, directory, 2, 2)
            return Metadata("opt", bos, eos)
        return Metadata()
    genai = directory / "genai_config.json"
    if genai.is_file():
        try:
            raw = json.loads(genai.read_text())["model"]
            eos = raw.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            arch = raw.get("type") if raw.get("type") in ("llama", "mistral", "qwen2") else None
            return Metadata(arch, _id(raw.get("bos_token_id")), _id(eos), _id(raw.get("context_length")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PiccError(f"{genai}: not a readable genai config ({type(e).__name__}: {e})") from None
    return Metadata()


def _id(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {json.dumps(value)}")
    return value


def _config_windows(cfg: HFConfig) -> tuple[int | None, ...] | None:
    """Per-layer sliding windows as the HF frontend reads them (None: the config has none)."""
    from picc.frontend.hf import qwen2_windows

    n_layers = cfg.integer("num_hidden_layers")
    if cfg.raw["model_type"] == "mistral":
        return (cfg.opt_integer("sliding_window", 4096),) * n_layers
    if cfg.raw["model_type"] == "qwen2":
        return qwen2_windows(cfg, n_layers)
    return None


def _tokenizer(directory: Path):  # noqa: ANN202 - Tokenizer | None
    from picc.frontend.hf import TOKENIZER_FILES

    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        from picc.frontend.tokenizer import tokenizer_from_hf_dir

        return tokenizer_from_hf_dir(directory)
    return None
