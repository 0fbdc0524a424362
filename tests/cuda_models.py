"""The kernel set of one decoder model, specialised to its layer shapes: the tests' fixed sets of
GPU kernels (a compile lowers a module's own ops instead, ``picc.codegen_cuda.lower``).

Layers of one model share shapes, so one kernel per (op, shape, format) serves every layer; the
runtime binds each layer's weights to it. ``model_kernels`` lists them for decode (seq = 1: attention both
as five launches and, where the cache fits its blocks, as one) and for a prefill chunk of ``prefill``
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from picc.codegen_cuda import dense, ffn, greedy, layers
from picc.codegen_cuda.kernel import Kernel
from picc.errors import PiccError


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What the kernels of a model depend on (see ``picc.ir.ops`` for the meaning of each)."""

    name: str
    hidden: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    form: str = "swiglu"
    eps: float = 1e-5
    norm: str = "rms"
    rope_style: str = "llama"
    rotary_dim: int | None = None
    max_ctx: int = 2048
    predictor_rank: int = 64
    prefill: int = 32
    qk_norm: bool = False  # Qwen3: each head's q and k RMS-normalised, the heads as the norm's rows

    def __post_init__(self) -> None:
        if self.norm not in ("rms", "layer"):
            raise PiccError(f"ModelShapes.norm must be 'rms' or 'layer', got {self.norm!r}")
        if self.n_heads % self.n_kv_heads:
            raise PiccError(f"ModelShapes: n_heads={self.n_heads} is not a multiple of "
                            f"n_kv_heads={self.n_kv_heads}")


def model_kernels(m: ModelShapes, fmt: str, predictor_fmt: str = "f16") -> list[Kernel]:
    """Every GPU kernel of model ``m`` with matrices in ``fmt`` (predictors in ``predictor_fmt``)."""
    p = f"{m.name}_{fmt}"
    q_width, kv_width = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    scale = m.head_dim**-0.5
    out: list[Kernel] = []
    for seq, tag in ((1, "decode"), (m.prefill, f"prefill{m.prefill}")):
        if m.norm == "rms":
            out.append(layers.rms_norm(f"{m.name}_rms_norm_{tag}", seq, m.hidden, m.eps))
        else:
            out.append(layers.layer_norm(f"{m.name}_layer_norm_{tag}", seq, m.hidden, m.eps))
        if m.qk_norm:
            out += [layers.rms_norm(f"{m.name}_q_norm_{tag}", seq * m.n_heads, m.head_dim, m.eps),
                    layers.rms_norm(f"{m.name}_k_norm_{tag}", seq * m.n_kv_heads, m.head_dim, m.eps)]
        out += [
            layers.rope(f"{m.name}_rope_q_{tag}", seq, m.n_heads, m.head_dim, m.rotary_dim, m.rope_style),
            layers.rope(f"{m.name}_rope_k_{tag}", seq, m.n_kv_heads, m.head_dim, m.rotary_dim, m.rope_style),
            layers.kv_append(f"{m.name}_kv_append_{tag}", seq, kv_width, m.max_ctx),
            layers.attention(f"{m.name}_attention_{tag}", seq, m.n_heads, m.n_kv_heads, m.head_dim,
                             m.max_ctx, scale),
        ]
        if seq == 1 and layers.attention_decode_fits(m.max_ctx):
            out.append(layers.attention_decode(f"{m.name}_attention_decode_fused", m.n_heads, m.n_kv_heads,
                                               m.head_dim, m.max_ctx, scale))
    out += [
        dense.gemv(f"{p}_gemv_q", q_width, m.hidden, fmt),
        dense.gemv(f"{p}_gemv_kv", kv_width, m.hidden, fmt),
        dense.gemv(f"{p}_gemv_o", m.hidden, q_width, fmt),
        dense.gemv(f"{p}_gemv_lm_head", m.vocab, m.hidden, fmt),
        dense.gemm(f"{p}_gemm_q_prefill{m.prefill}", m.prefill, q_width, m.hidden, fmt),
        dense.gemm(f"{p}_gemm_kv_prefill{m.prefill}", m.prefill, kv_width, m.hidden, fmt),
        dense.gemm(f"{p}_gemm_o_prefill{m.prefill}", m.prefill, m.hidden, q_width, fmt),
        dense.predictor(f"{m.name}_{predictor_fmt}_predictor", m.hidden, m.predictor_rank, m.n_ff,
                       predictor_fmt),
        dense.compact(f"{m.name}_compact", m.n_ff, ffn.padded(m.n_ff)),
        dense.compact(f"{m.name}_compact_cold", m.n_ff // 2, ffn.padded(m.n_ff // 2), m.n_ff // 2),
        ffn.sparse_ffn(f"{p}_sparse_ffn_{m.form}", m.hidden, m.n_ff, m.form, fmt),
        ffn.dense_ffn(f"{p}_dense_ffn_{m.form}", m.hidden, m.n_ff, m.form, fmt),
        ffn.bias_add(f"{m.name}_bias_add", m.hidden),
        layers.merge(f"{m.name}_merge", m.hidden, bias=False),
        layers.add(f"{m.name}_add", 1, m.hidden),
        greedy.greedy_next(f"{m.name}_greedy_next", m.vocab, m.max_ctx),
    ]
    spec = ffn.FORMS[m.form]
    if spec.gated and not spec.act_on_up:
        out.append(ffn.gate_first_ffn(f"{p}_gate_first_ffn_{m.form}", m.hidden, m.n_ff, m.form, fmt))
    return out


SMOLLM2 = ModelShapes("smollm2", hidden=576, n_ff=1536, n_heads=9, n_kv_heads=3, head_dim=64, vocab=49152,
                      form="swiglu")
"""SmolLM2-135M's shapes (30 layers share them)."""

RELU_DEMO = ModelShapes("relu_demo", hidden=320, n_ff=1280, n_heads=5, n_kv_heads=1, head_dim=64, vocab=8192,
                        form="reglu")
"""picc's ReLU-LLaMA demo model (examples/train_relu_demo.py)."""
