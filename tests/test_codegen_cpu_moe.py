"""The mixture-of-experts kernel (``picc_moe_*``) against a float64 reference of the interpreter's
arithmetic: every weight format, with float x and (4-bit rows) int16 x, its ungated forms, 1-3
threads, renormalised or not, ties, and the routers of gpt-oss, Qwen2-MoE, ERNIE 4.5, DeepSeek
V2 and V3 and GLM-4.5."""

from __future__ import annotations

import numpy as np
import pytest
from cpu_kernels import act64, run, weights

from picc import quant
from picc.codegen_cpu import build_ir, compile_kernels
from picc.codegen_cpu.compiler import CpuModule, effective_simd
from picc.codegen_cpu.kernels_moe import moe, moe_chunk, moe_chunk_scratch_bytes, moe_scratch_bytes
from picc.codegen_cpu.rows8 import to_rows8
from picc.errors import PiccError
from picc.ir.ops import FFN_FORMS
from picc.kernel_names import MoeVariant

E, N, HIDDEN = 8, 64, 96  # experts, an expert's neurons, the hidden size (multiples of 32: block formats)
CASES = ([("swiglu", dt, "f32", False) for dt in ("f32", "f16", "q8_0", "q4_0", "q4_1", "mxfp4")]
         + [("swiglu", dt, "i16", False) for dt in ("q4_0", "q4_1")] + [("relu", "q4_1", "i16", False)]
         + [("geglu_tanh", "f16", "f32", False)]
         + [("swiglu", dt, "i16", True) for dt in ("q4_0", "q4_1")]  # the experts in the rows8 layout
         + [("swiglu", "q4_1/q8_0", "i16", True)]  # a Q4_K_M file's: q8_0 down rows one at a time
         + [("swiglu", "mxfp4", "i16", False), ("swiglu", "mxfp4/q8_0", "f32", False)])  # gpt-oss's experts
# gpt-oss's: the four biases and the clamped SwiGLU (alpha 1.702, limit 7), float, rows8 and mxfp4 experts
OAI_CASES = [("swiglu", "f32", "f32", False), ("swiglu", "q4_0", "i16", True), ("swiglu", "mxfp4", "i16", False)]
ALPHA, LIMIT = 1.702, 7.0
OAI = MoeVariant("rugd", clamped=True)
# Qwen2-MoE's: two shared experts stacked after the eight routed ones, weighted by 1 or by the
# sigmoid of the router's ninth row; float and rows8 experts
SHARED, SHARED_CASES = 2, [("swiglu", "f32", "f32", False), ("swiglu", "q4_0", "i16", True)]
KERNELS = [make(form, "f32", dt.split("/")[0], dt.split("/")[0] if FFN_FORMS[form].gated else None,
                dt.split("/")[-1], x, rows8) for form, dt, x, rows8 in CASES for make in (moe, moe_chunk)]
KERNELS += [make(form, "f32", dt, dt, dt, x, rows8, OAI) for form, dt, x, rows8 in OAI_CASES
            for make in (moe, moe_chunk)]
KERNELS += [make(form, "f32", dt, dt, dt, x, rows8, MoeVariant(shared=kind)) for form, dt, x, rows8 in SHARED_CASES
            for kind in ("plain", "gated") for make in (moe, moe_chunk)]
# ERNIE 4.5's: the experts ranked by probability plus a bias, two plain shared experts
ERNIE = MoeVariant(shared="plain", choice_bias=True)
KERNELS += [make(form, "f32", dt, dt, dt, x, rows8, ERNIE) for form, dt, x, rows8 in SHARED_CASES
            for make in (moe, moe_chunk)]
# DeepSeek V2's (softmax, groups scored by their largest probability), V3's (sigmoids plus a
# correction bias, groups scored by their two largest) and GLM-4.5's (V3's without groups), each
# with two plain shared experts and its routed weights scaled. The groups (n_group, topk_group)
# by their score: V2's two of four groups of two, V3's one of two groups of four (a sum of the
# two largest of four); four experts eligible either way.
GROUPS, ROUTED_SCALE = {"max": (4, 2), "top2": (2, 1)}, 2.5
ROUTERS = {"deepseek-v2": MoeVariant(shared="plain", groups="max", scaled=True),
           "deepseek-v3": MoeVariant(shared="plain", choice_bias=True, scoring="sigmoid", groups="top2", scaled=True),
           "glm-4.5": MoeVariant(shared="plain", choice_bias=True, scoring="sigmoid", scaled=True)}
KERNELS += [make(form, "f32", dt, dt, dt, x, rows8, variant) for form, dt, x, rows8 in SHARED_CASES
            for variant in ROUTERS.values() for make in (moe, moe_chunk)]


@pytest.fixture(scope="module")
def host():
    return compile_kernels(KERNELS, simd="host")


class Experts:
    """Random router and experts for ``form`` in ``dtype``, and the float values they decode to."""

    def __init__(self, form: str, dtype: str, seed: int, x_format: str = "f32", rows8: bool = False,
                 oai: bool = False, shared: str = "", choice_bias: bool = False,
                 router: MoeVariant | None = None) -> None:
        """``dtype``: the experts' format, or ``"up-gate/down"``'s two; ``oai``: gpt-oss's biases
        and clamped SwiGLU; ``shared``: :data:`SHARED` shared experts, ``"plain"`` or ``"gated"``;
        ``choice_bias``: ERNIE 4.5's bias on the probabilities that rank the experts; ``router``:
        one of :data:`ROUTERS` (its shared experts and choice bias in place of the two before)."""
        if router is not None:
            shared, choice_bias = router.shared, router.choice_bias
        self.variant = router or (OAI if oai else MoeVariant(shared=shared, choice_bias=choice_bias))
        dtype, down = dtype.split("/")[0], dtype.split("/")[-1]
        self.dtype, self.down_dtype = dtype, down
        rng = np.random.default_rng(seed)
        self.form, self.spec, self.x_format = form, FFN_FORMS[form], x_format
        self.shared, self.n_shared = shared, SHARED if shared else 0
        total, routers = E + self.n_shared, E + (shared == "gated")
        # logits ~N(0, 1): no one wins all
        self.router = rng.normal(0, HIDDEN**-0.5, size=(routers, HIDDEN)).astype(np.float32)
        self.up_raw, self.up = weights(rng, (total * N, HIDDEN), dtype, HIDDEN**-0.5)
        self.gate_raw, self.gate = (weights(rng, (total * N, HIDDEN), dtype, HIDDEN**-0.5) if self.spec.gated
                                    else (None, None))
        self.down_raw, self.down = weights(rng, (total * HIDDEN, N), down, N**-0.5)
        if rows8:  # the kernel reads the stacked matrices eight rows to a group
            self.up_raw = to_rows8(self.up_raw, dtype, (total * N, HIDDEN))
            self.gate_raw = to_rows8(self.gate_raw, dtype, (total * N, HIDDEN)) if self.spec.gated else None
            if down in quant.BLOCK_SIZE and down != "q8_0":
                self.down_raw = to_rows8(self.down_raw, down, (total * HIDDEN, N))
        # gpt-oss: biases of a few units (its up and gate projections reach past the clamp at 7)
        self.oai = oai
        self.biases = [rng.normal(0, scale, size=n).astype(np.float32)
                       for n, scale in ((E, 1.0), (E * N, 4.0), (E * N, 4.0), (E * HIDDEN, 1.0))] if oai else []
        # a bias of the probabilities' size (1/8 each on average): it reorders the ranking
        self.choice_bias = rng.normal(0, 0.1, size=E).astype(np.float32) if choice_bias else None
        self.kernel = moe(form, "f32", dtype, dtype if self.spec.gated else None, down, x_format, rows8, self.variant)
        self.chunk = moe_chunk(form, "f32", dtype, dtype if self.spec.gated else None, down, x_format, rows8,
                               self.variant)

    @property
    def extras(self) -> tuple:
        """The variants' trailing arguments: gpt-oss's, or the count of shared experts, the choice
        bias, the groups' counts and the routed weights' scale where the variant has them."""
        if self.oai:
            return (*self.biases, ALPHA, LIMIT)
        variant = self.variant
        return ((self.n_shared,) if self.shared else ()) + (() if self.choice_bias is None else (self.choice_bias,)) \
            + (GROUPS[variant.groups] if variant.groups else ()) + ((ROUTED_SCALE,) if variant.scaled else ())

    def rounded(self, v: np.ndarray, dtype: str) -> np.ndarray:
        """``v`` as rows of ``dtype`` are dotted with it: rounded to int16 per block (4-bit rows)."""
        four_bit = self.x_format != "f32" and dtype in ("q4_0", "q4_1", "mxfp4")
        return quant.round_x_blocks(v.astype(np.float32), self.x_format) if four_bit else v

    def choice(self, logits: np.ndarray, k: int, norm: bool, groups: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The interpreter's top k of the routed ``logits`` in float64 (the lower index first among
        equals) and their weights: by logit, or by probability (softmax or sigmoid) plus the
        choice bias, from the best groups only where the router has them (scored as ``groups``
        says where given, ``""``: no groups), renormalised where ``norm``, scaled where the
        router is."""
        variant = self.variant
        score_groups = variant.groups if groups is None or not variant.groups else groups
        if variant.scoring == "sigmoid":
            probs = 1 / (1 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
        scores = probs + (0.0 if self.choice_bias is None else self.choice_bias)
        rank = scores if variant.ranks_by_probability else logits
        if score_groups:
            n_group, topk_group = GROUPS[variant.groups]
            members = np.sort(scores.reshape(n_group, -1), axis=1)
            score = members[:, -1] + (members[:, -2] if score_groups == "top2" else 0.0)
            best = np.argsort(-score, kind="stable")[:topk_group]
            rank = np.where(np.isin(np.arange(E) // (E // n_group), best), rank, -np.inf)
        chosen = np.argsort(-rank, kind="stable")[:k]
        w = probs[chosen] / (probs[chosen].sum() if norm else 1.0)
        return chosen, w * (ROUTED_SCALE if variant.scaled else 1.0)

    def reference(self, x: np.ndarray, k: int, norm: bool) -> np.ndarray:
        """The interpreter's mixture in float64: the top k (:meth:`choice`), then the shared
        experts; x and h rounded as the kernel reads them."""
        rb, ub, gb, db = (b.astype(np.float64) for b in self.biases) if self.oai else (0.0,) * 4
        all_logits = self.router.astype(np.float64) @ x + rb
        chosen, w = self.choice(all_logits[:E], k, norm)
        shared_w = 1 / (1 + np.exp(-all_logits[E])) if self.shared == "gated" else 1.0
        chosen = np.concatenate([chosen, np.arange(E, E + self.n_shared)])
        w = np.concatenate([w, np.full(self.n_shared, shared_w)])
        y, xr = np.zeros(HIDDEN), self.rounded(x, self.dtype).astype(np.float64)
        for e, we in zip(chosen, w, strict=True):
            rows, out = slice(e * N, (e + 1) * N), slice(e * HIDDEN, (e + 1) * HIDDEN)
            up = self.up[rows].astype(np.float64) @ xr + (ub[rows] if self.oai else 0.0)
            if self.oai:
                g = np.minimum(self.gate[rows].astype(np.float64) @ xr + gb[rows], LIMIT)
                h = g / (1 + np.exp(-ALPHA * g)) * (np.clip(up, -LIMIT, LIMIT) + 1)
            elif self.spec.gated:
                h = act64(self.spec.act, self.gate[rows].astype(np.float64) @ xr) * up
            else:
                h = act64(self.spec.act, up)
            y += we * (self.down[out].astype(np.float64) @ self.rounded(h, self.down_dtype) + (db[out] if self.oai else 0))
        return y

    def run(self, module, team, x: np.ndarray, k: int, norm: bool) -> np.ndarray:  # noqa: ANN001
        y = np.full(HIDDEN, np.nan, np.float32)  # every element written
        scratch = np.zeros(moe_scratch_bytes(E + (self.shared == "gated"), k + self.n_shared, N) // 4, np.float32)
        run(module, team, self.kernel, x, self.router, self.up_raw, self.gate_raw, self.down_raw, y, scratch, E, k, N,
            HIDDEN, int(norm), *self.extras)
        return y


@pytest.mark.parametrize("form, dtype, x_format, rows8", CASES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_mixture_is_the_interpreters(host, teams, form, dtype, x_format, rows8, threads):
    # The router's top k experts of the token, their softmax weights (renormalised or not), each
    # expert's FFN from its own rows of the stacked matrices. Float32 sums in another order than
    # float64's: 1e-5 of the output's largest element (the formats' rounding is in the reference's
    # weights: they are the decoded values; int16 x's in its x and h, rounded as the kernel does).
    experts, rng = Experts(form, dtype, 31, x_format, rows8), np.random.default_rng(32)
    outs = []
    for k, norm in ((2, True), (3, False), (E, True), (1, False)):
        x = rng.normal(size=HIDDEN).astype(np.float32)
        y, want = experts.run(host, teams[threads], x, k, norm), experts.reference(x, k, norm)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (k, norm)
        outs.append(y)
    assert np.abs(outs[0] - experts.run(host, teams[threads], x, 2, True)).max() > 0  # the choice follows x


@pytest.mark.parametrize("form, dtype, x_format, rows8", [CASES[i] for i in (1, 6, 8, 12, 5, 13)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_chunk_of_tokens_gets_each_tokens_bits(host, teams, form, dtype, x_format, rows8, threads):
    # The prefill's kernel takes the experts in turn for all the chunk's tokens (their rows read
    # once): each token's output is the one-token kernel's, bit for bit, its rows strided as the
    # chunk's buffers are, and nothing past a row's hidden floats is written.
    experts, rng = Experts(form, dtype, 35, x_format, rows8), np.random.default_rng(36)
    chunk = experts.chunk
    for seq, k, norm in ((5, 2, True), (1, 3, False), (7, E, True)):
        x = np.zeros((seq, HIDDEN + 32), np.float32)  # rows 32 floats longer than a token's x
        x[:, :HIDDEN] = rng.normal(size=(seq, HIDDEN))
        want = np.stack([experts.run(host, teams[threads], np.ascontiguousarray(row[:HIDDEN]), k, norm) for row in x])
        y = np.full((seq, HIDDEN + 16), np.nan, np.float32)
        scratch = np.zeros(moe_chunk_scratch_bytes(E, k, N, HIDDEN, seq) // 4, np.float32)
        run(host, teams[threads], chunk, x, experts.router, experts.up_raw, experts.gate_raw, experts.down_raw, y,
            scratch, E, k, N, HIDDEN, int(norm), seq, x.strides[0], y.strides[0])
        assert np.array_equal(y[:, :HIDDEN].view(np.uint32), want.view(np.uint32)), (seq, k)
        assert np.isnan(y[:, HIDDEN:]).all()


@pytest.mark.parametrize("form, dtype, x_format, rows8", OAI_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_gpt_oss_biases_and_clamped_swiglu(host, teams, form, dtype, x_format, rows8, threads):
    # gpt-oss's experts: the router's bias moves the choice, each chosen expert's up, gate and
    # down biases are its own slices, and h is the clamped SwiGLU; the biases are large enough
    # that some up and gate values pass the clamp (checked). Tolerance as above; a chunk of
    # tokens gets each token's bits.
    experts, rng = Experts(form, dtype, 37, x_format, rows8, oai=True), np.random.default_rng(38)
    clamped = 0
    for k, norm in ((4, True), (2, False)):
        x = rng.normal(size=HIDDEN).astype(np.float32)
        y, want = experts.run(host, teams[threads], x, k, norm), experts.reference(x, k, norm)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (k, norm)
        clamped += int((np.abs(experts.up.astype(np.float64) @ x + experts.biases[1]) > LIMIT).sum())
    assert clamped > 0
    seq, k = 5, 4
    x = rng.normal(size=(seq, HIDDEN)).astype(np.float32)
    y = np.full((seq, HIDDEN), np.nan, np.float32)
    scratch = np.zeros(moe_chunk_scratch_bytes(E, k, N, HIDDEN, seq) // 4, np.float32)
    run(host, teams[threads], experts.chunk, x, experts.router, experts.up_raw, experts.gate_raw, experts.down_raw, y,
        scratch, E, k, N, HIDDEN, 1, *experts.extras, seq, x.strides[0], y.strides[0])
    want = np.stack([experts.run(host, teams[threads], row, k, True) for row in x])
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("form, dtype, x_format, rows8", SHARED_CASES)
@pytest.mark.parametrize("shared", ["plain", "gated"])
@pytest.mark.parametrize("threads", [1, 2])
def test_shared_experts_follow_every_tokens_top_k(host, teams, form, dtype, x_format, rows8, shared, threads):
    # Qwen2-MoE's shared expert, cut into two expert-wide pieces stacked after the routed experts:
    # every token takes them after its top k, weighted by 1 or by the sigmoid of the router's
    # extra row (not part of the softmax, nor of the renormalisation). Tolerance as above; a
    # chunk of tokens gets each token's bits.
    experts, rng = Experts(form, dtype, 39, x_format, rows8, shared=shared), np.random.default_rng(40)
    for k, norm in ((2, True), (1, False)):
        x = rng.normal(size=HIDDEN).astype(np.float32)
        y, want = experts.run(host, teams[threads], x, k, norm), experts.reference(x, k, norm)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (k, norm)
    _chunk_gives_each_tokens_bits(host, teams[threads], experts, rng, 5, 2, E + (shared == "gated"))


def _chunk_gives_each_tokens_bits(host, team, experts, rng, seq: int, k: int, router_rows: int = E) -> None:
    """``seq`` random tokens through ``experts``' chunk kernel, ``k`` a token (renormalised;
    ``router_rows``: the router's, a gated shared expert's included): each token's output is the
    one-token kernel's, bit for bit."""
    x = rng.normal(size=(seq, HIDDEN)).astype(np.float32)
    y = np.full((seq, HIDDEN), np.nan, np.float32)
    scratch = np.zeros(moe_chunk_scratch_bytes(router_rows, k + SHARED, N, HIDDEN, seq) // 4, np.float32)
    run(host, team, experts.chunk, x, experts.router, experts.up_raw, experts.gate_raw, experts.down_raw, y,
        scratch, E, k, N, HIDDEN, 1, *experts.extras, seq, x.strides[0], y.strides[0])
    want = np.stack([experts.run(host, team, row, k, True) for row in x])
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("form, dtype, x_format, rows8", SHARED_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_choice_bias_ranks_the_experts_but_does_not_weight_them(host, teams, form, dtype, x_format, rows8, threads):
    # ERNIE 4.5: the top k by probability plus the bias, weighted by the probability (renormalised),
    # then the shared experts. The bias changes some token's choice (checked), the kernel follows
    # the reference in every case; a chunk of tokens gets each token's bits.
    experts, rng = Experts(form, dtype, 41, x_format, rows8, shared="plain", choice_bias=True), np.random.default_rng(42)
    reordered = 0
    for _ in range(6):
        x = rng.normal(size=HIDDEN).astype(np.float32)
        y, want = experts.run(host, teams[threads], x, 2, True), experts.reference(x, 2, True)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
        logits = experts.router.astype(np.float64) @ x
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        reordered += set(np.argsort(-logits)[:2]) != set(np.argsort(-(probs + experts.choice_bias))[:2])
    assert reordered > 0
    _chunk_gives_each_tokens_bits(host, teams[threads], experts, rng, 5, 2)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("form, dtype, x_format, rows8", SHARED_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_deepseeks_and_glms_routers(host, teams, router, form, dtype, x_format, rows8, threads):
    # DeepSeek V2's softmax, V3's and GLM-4.5's sigmoids ranked with a correction bias, the top k
    # taken from the best groups (V2: two of four by their largest probability, V3: one of two by
    # the sum of its two largest ranks), renormalised or not, the routed weights times 2.5, then
    # the shared experts. The groups change some token's choice, and V3's group score another
    # token's than the largest rank would (checked); tolerance as above; a chunk of tokens gets
    # each token's bits.
    variant = ROUTERS[router]
    experts, rng = Experts(form, dtype, 43, x_format, rows8, router=variant), np.random.default_rng(48)
    regrouped = rescored = 0
    for i in range(12):
        k, norm = (4, True) if i % 2 else (3, False)  # at most the four experts eligible
        x = rng.normal(size=HIDDEN).astype(np.float32)
        y, want = experts.run(host, teams[threads], x, k, norm), experts.reference(x, k, norm)
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (i, k, norm)
        logits = experts.router.astype(np.float64) @ x
        chosen = set(experts.choice(logits, k, norm)[0])
        regrouped += chosen != set(experts.choice(logits, k, norm, "")[0])
        rescored += chosen != set(experts.choice(logits, k, norm, "max")[0])
    assert (regrouped > 0) == bool(variant.groups) and (rescored > 0) == (variant.groups == "top2")
    _chunk_gives_each_tokens_bits(host, teams[threads], experts, rng, 7, 4)


@pytest.mark.parametrize("router", ["deepseek-v2", "deepseek-v3"])
def test_equal_groups_choose_the_lower_group(host, teams, router):
    # One group more than are taken (V2: groups 1-3 of two experts, V3: groups 0-1 of four) have
    # the same router rows and biases, and the largest ranks: the lower groups are taken (the
    # lower first among equals, as the interpreter's stable sort chooses), with k = 4 all four of
    # their experts. The first of them made smaller, the others are taken: the output moves.
    variant = ROUTERS[router]
    (n_group, topk_group), size = GROUPS[variant.groups], E // GROUPS[variant.groups][0]
    experts = Experts("swiglu", "f32", 45, router=variant)
    x = np.abs(np.random.default_rng(46).normal(size=HIDDEN)).astype(np.float32)
    tied = [list(range(g * size, (g + 1) * size)) for g in range(n_group - topk_group - 1, n_group)]
    experts.router[tied[0]] = np.abs(experts.router[tied[0]]) + 0.05
    for group in tied[1:]:
        experts.router[group] = experts.router[tied[0]]
        if experts.choice_bias is not None:
            experts.choice_bias[group] = experts.choice_bias[tied[0]]
    assert sorted(experts.choice(experts.router.astype(np.float64) @ x, 4, True)[0]) == sum(tied[:-1], [])
    y = experts.run(host, teams[2], x, 4, True)
    want = experts.reference(x, 4, True)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    experts.router[tied[0]] *= 0.5
    assert sorted(experts.choice(experts.router.astype(np.float64) @ x, 4, True)[0]) == sum(tied[1:], [])
    assert np.abs(experts.run(host, teams[2], x, 4, True) - y).max() > 1e-3


def test_equal_logits_choose_the_lower_expert(host, teams):
    # Experts 2, 5 and 6 have one router row: with k = 2 the first two of them are chosen, as the
    # interpreter's stable sort chooses, and the output is theirs (not expert 6's).
    experts = Experts("swiglu", "f32", 33)
    x = np.abs(np.random.default_rng(34).normal(size=HIDDEN)).astype(np.float32)
    experts.router[2] = np.abs(experts.router[2]) + 1  # the largest logit, three times
    experts.router[[5, 6]] = experts.router[2]
    y = experts.run(host, teams[2], x, 2, True)
    want = experts.reference(x, 2, True)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    experts.router[5] *= 0.5  # now 2 and 6
    assert np.abs(experts.run(host, teams[2], x, 2, True) - y).max() > 1e-3


@pytest.mark.parametrize("x_format", ["f32", "i16"])
def test_the_interpreter_computes_the_mxfp4_mixture_of_the_kernel(host, teams, x_format):
    # gpt-oss's experts through the MoE op's interpreter path (its weights' mxfp4 blocks decoded
    # by picc.quant, x and h rounded where the op says i16) and through the kernel: float rounding
    # apart (1e-5 of the output's largest element, as for the other formats), and ten times closer
    # than to the op with the other x (measured: 168x for float x, 18x for int16 x).
    from dataclasses import replace

    from picc.interpreter import Interpreter
    from picc.ir import ops as O
    from picc.ir.builder import FunctionBuilder
    from picc.ir.module import Module, WeightDecl
    from picc.ir.types import DType, f32
    from picc.ir.weights import Tensor, WeightStore

    experts = Experts("swiglu", "mxfp4", 37, x_format)
    store = WeightStore({"router": Tensor(DType.F32, (E, HIDDEN), experts.router),
                         **{m: Tensor(DType.MXFP4, shape, raw) for m, shape, raw in (
                             ("up", (E * N, HIDDEN), experts.up_raw), ("gate", (E * N, HIDDEN), experts.gate_raw),
                             ("down", (E * HIDDEN, N), experts.down_raw))}})
    types = {name: store[name].type for name in store}
    b = FunctionBuilder("forward", types)
    b.op(O.MoE, "y", x=b.arg("x", f32("seq", HIDDEN)), router="router", up="up", gate="gate", down="down",
         n_experts=E, top_k=3, form="swiglu", norm_topk=True, x_format=x_format)
    func = b.finish("y")
    module = Module("m", (), tuple(WeightDecl(n, t) for n, t in types.items()), (func,))
    op = func.ops[0]
    other = replace(op, x_format="i16" if x_format == "f32" else "f32")
    xs = np.random.default_rng(38).normal(size=(4, HIDDEN)).astype(np.float32)
    interpreter = Interpreter(module, store)
    want, away = interpreter.moe(op, xs), interpreter.moe(other, xs)
    y = np.stack([experts.run(host, teams[2], x, 3, True) for x in xs])
    scale = np.abs(want).max()
    assert np.abs(y - want).max() <= 1e-5 * scale
    assert np.abs(y - away).max() > 10 * np.abs(y - want).max()


@pytest.mark.parametrize("router", ROUTERS)
def test_the_interpreter_routes_as_the_kernel(host, teams, router):
    # DeepSeek's and GLM-4.5's mixtures through the moe op's attributes (scoring, n_group,
    # topk_group, group_score, routed_scale) in the interpreter and through the kernel (whose
    # chunks are its tokens' bits: above): float rounding apart (1e-5 of the output's largest
    # element, as above), over many random tokens, each one's top k decided alike.
    from picc.interpreter import Interpreter
    from picc.ir import ops as O
    from picc.ir.builder import FunctionBuilder
    from picc.ir.module import Module, WeightDecl
    from picc.ir.types import f32
    from picc.ir.weights import Tensor, WeightStore

    variant = ROUTERS[router]
    experts = Experts("swiglu", "f32", 47, router=variant)
    store = WeightStore({name: Tensor.from_f32(w) for name, w in (
        ("router", experts.router), ("up", experts.up_raw), ("gate", experts.gate_raw), ("down", experts.down_raw),
        ("choice_bias", experts.choice_bias)) if w is not None})
    types = {name: store[name].type for name in store}
    b = FunctionBuilder("forward", types)
    b.op(O.MoE, "y", x=b.arg("x", f32("seq", HIDDEN)), router="router", up="up", gate="gate", down="down",
         n_experts=E, top_k=4, form="swiglu", norm_topk=True, n_shared=SHARED,
         choice_bias="choice_bias" if variant.choice_bias else None, scoring=variant.scoring,
         **(dict(n_group=GROUPS[variant.groups][0], topk_group=GROUPS[variant.groups][1]) if variant.groups else {}),
         group_score=variant.groups or "max", routed_scale=ROUTED_SCALE)
    func = b.finish("y")
    module = Module("m", (), tuple(WeightDecl(n, t) for n, t in types.items()), (func,))
    op = func.ops[0]
    assert op.variant == variant
    xs = np.random.default_rng(48).normal(size=(64, HIDDEN)).astype(np.float32)
    want = Interpreter(module, store).moe(op, xs)
    y = np.stack([experts.run(host, teams[2], x, 4, True) for x in xs])
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


def test_every_router_has_its_own_kernel_name():
    # Kernels are cached and linked by name: each routing the code computes differently (the
    # scoring, the groups and their score, a scale, a choice bias) must be named apart.
    from itertools import product

    variants = [MoeVariant(shared="plain", choice_bias=cb, scoring=scoring, groups=groups, scaled=scaled)
                for cb, scoring, groups, scaled in product((False, True), ("softmax", "sigmoid"), ("", "max", "top2"),
                                                           (False, True))]
    assert len({moe("swiglu", "f32", "f32", "f32", "f32", "f32", False, v).symbol for v in variants}) == len(variants)
    with pytest.raises(PiccError, match="softmax or sigmoid"):
        moe("swiglu", "f32", "f32", "f32", "f32", "f32", False, MoeVariant(scoring="tanh"))


def test_rows8_experts_dot_rounded_x():
    # the rows8 layout's experts (mxfp4's too: tests/test_codegen_cpu_rows8_mxfp4.py) dot int16 x
    with pytest.raises(PiccError, match="rows8"):
        moe("swiglu", "f32", "mxfp4", "mxfp4", "mxfp4", "f32", True)


def test_a_gate_is_given_exactly_when_the_form_has_one():
    with pytest.raises(PiccError, match="needs gate weights"):
        moe("swiglu", "f32", "q4_1", None, "q4_1")
    with pytest.raises(PiccError, match="takes no gate weights"):
        moe("relu", "f32", "q4_1", "q4_1", "q4_1")


@pytest.mark.parametrize("simd", [level for level in ("avx2", "avx512", "avx512-vnni") if level != effective_simd("host")])
def test_the_other_simd_levels_compile(simd):
    asm = CpuModule(build_ir(KERNELS, (), simd), simd).emit_assembly()
    for kernel in KERNELS:
        assert f"{kernel.symbol}:" in asm, kernel.symbol
    if simd == "avx2":
        assert "zmm" not in asm
