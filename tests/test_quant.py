"""picc.quant against hand-built blocks, gguf.quants (ggml's reference in numpy)
and the real tensors of the SmolLM2 GGUF."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf import quants as reference

from picc import quant
from picc.frontend.aliases import resolve_alias

BLOCK_DTYPES = ("q4_0", "q4_1", "q8_0", "mxfp4")
GGML_TYPE = {
    "mxfp4": GGMLQuantizationType.MXFP4,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q8_0": GGMLQuantizationType.Q8_0,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of two float32 arrays (so -0.0 != 0.0 and NaN == NaN)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def awkward_rows(rng: np.random.Generator) -> np.ndarray:
    """Rows of 256 floats that exercise the corner cases of every block format."""
    n = 256
    rows = [
        rng.standard_normal(n) * 1e4,
        rng.standard_normal(n) * 1e-6,  # scale is an f16 subnormal
        rng.uniform(0.5, 1.0, n),  # all positive: q4_1 minimum > 0
        -rng.uniform(0.5, 1.0, n),  # all negative: q4_0 scale > 0
        np.zeros(n),  # zero scale must not divide by zero
        np.full(n, 3.25),  # max == min for q4_1
        np.tile([2.0, -2.0], n // 2),  # |max| tie: the first element wins
        np.tile(np.r_[127.0, np.arange(31) - 15.5], n // 32),  # q8_0 scale 1: halves
        rng.integers(-8, 8, n).astype(np.float64),
    ]
    return np.stack(rows).astype(np.float32)


@pytest.fixture(scope="module")
def random_matrix() -> np.ndarray:
    rng = np.random.default_rng(1234)
    dense = rng.standard_normal((40, 256)).astype(np.float32)
    awkward = awkward_rows(rng)
    return np.concatenate([dense, awkward])


def test_sizes_match_ggml() -> None:
    for name in BLOCK_DTYPES:
        assert (quant.BLOCK_SIZE[name], quant.BLOCK_BYTES[name]) == GGML_QUANT_SIZES[GGML_TYPE[name]]
    assert quant.raw_nbytes("q4_1", (576, 1536)) == 576 * 48 * 20
    assert quant.raw_nbytes("q8_0", (49152, 576)) == 49152 * 18 * 34
    assert quant.raw_nbytes("bf16", (3, 5)) == 30
    assert quant.raw_nbytes("f32", (3, 5)) == 60
    assert quant.raw_shape("q4_0", (7, 64)) == (7, 36)


def test_q4_0_block_layout() -> None:
    # Byte j holds element j in its low nibble and element j + 16 in its high one.
    low, high = np.arange(16, dtype=np.uint8), 15 - np.arange(16, dtype=np.uint8)
    block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), low | (high << 4)])
    values = quant.dequantize(block, "q4_0", (1, 32))
    expected = 0.5 * (np.concatenate([low, high]).astype(np.float32) - 8)
    assert same_bits(values, expected.reshape(1, 32))


def test_q4_1_block_layout() -> None:
    nibbles = np.arange(32, dtype=np.uint8) % 16
    header = np.array([2.0, -1.0], dtype=np.float16).view(np.uint8)
    block = np.concatenate([header, nibbles[:16] | (nibbles[16:] << 4)])
    values = quant.dequantize(block, "q4_1", (1, 32))
    assert same_bits(values, (2.0 * nibbles - 1.0).astype(np.float32).reshape(1, 32))


def test_q8_0_block_layout() -> None:
    quants = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.float16(0.25).reshape(1).view(np.uint8), quants.view(np.uint8)])
    values = quant.dequantize(block, "q8_0", (1, 32))
    assert same_bits(values, (0.25 * quants).astype(np.float32).reshape(1, 32))


def test_mxfp4_block_layout() -> None:
    # e first, then byte j: element j (low nibble) and element j + 16 (high), each a table value.
    low, high = np.arange(16, dtype=np.uint8), 15 - np.arange(16, dtype=np.uint8)
    table = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
    for e, scale in ((0, 2.0**-128), (1, 2.0**-127), (2, 2.0**-126), (127, 0.5), (128, 1.0), (130, 4.0),
                     (252, 2.0**124)):
        block = np.concatenate([np.array([e], np.uint8), low | (high << 4)])
        values = quant.dequantize(block, "mxfp4", (1, 32))
        expected = (table[np.concatenate([low, high])] * np.float32(scale)).astype(np.float32)
        assert same_bits(values, expected.reshape(1, 32)), e


def test_mxfp4_from_hf_matches_transformers() -> None:
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(11)
    experts, rows, nblocks = 3, 8, 4
    blocks = rng.integers(0, 256, (experts, rows, nblocks, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (experts, rows, nblocks), dtype=np.uint8)
    scales[0, 0, 0], scales[1, 2, 3] = 1, 250  # a denormal scale and a large one
    raw = quant.mxfp4_from_hf(blocks, scales)
    assert raw.shape == (experts, rows, nblocks * 17)
    ours = quant.dequantize(raw, "mxfp4", (experts, rows, 32 * nblocks))
    # transformers returns [experts, cols, rows] (x @ W); picc's rows are its columns
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    theirs = theirs.transpose(1, 2).contiguous().numpy()
    np.testing.assert_array_equal(ours, theirs)  # equal as numbers (HF's table has -0.0 where ggml's has 0)
    assert same_bits(np.abs(ours), np.abs(theirs))
    with pytest.raises(ValueError, match="blocks"):
        quant.mxfp4_from_hf(blocks, scales[..., :2])


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_quantize_matches_reference(dtype: str, random_matrix: np.ndarray) -> None:
    ours = quant.quantize(random_matrix, dtype)
    theirs = reference.quantize(random_matrix, GGML_TYPE[dtype])
    assert ours.dtype == np.uint8
    assert ours.shape == quant.raw_shape(dtype, random_matrix.shape)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_dequantize_matches_reference(dtype: str, random_matrix: np.ndarray) -> None:
    raw = reference.quantize(random_matrix, GGML_TYPE[dtype])
    # Arbitrary bytes too: every bit pattern of a block must decode identically,
    # scales included (except NaN/inf, which real files never contain).
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    if dtype != "mxfp4":  # every e8m0 exponent is finite
        noise.reshape(-1, quant.BLOCK_BYTES[dtype])[:, 1] &= 0x3F  # keep f16 scales finite
    if dtype == "q4_1":
        noise.reshape(-1, quant.BLOCK_BYTES[dtype])[:, 3] &= 0x3F
    for data in (raw, noise):
        ours = quant.dequantize(data, dtype, random_matrix.shape)
        assert same_bits(ours, reference.dequantize(data, GGML_TYPE[dtype]))


@pytest.mark.parametrize(("dtype", "tolerance"), [("q4_0", 1.01), ("q4_1", 0.55), ("q8_0", 0.035), ("mxfp4", 2.0)])
def test_round_trip_error_is_bounded(dtype: str, tolerance: float) -> None:
    # Values in [-8, 8). q4_1 and q8_0 round to the nearest step (16/15 and
    # 8/127), so they err by half a step. q4_0 spans -8d..7d with d = max/8, so
    # the end opposite the largest magnitude clips by up to a whole step of 1. mxfp4's largest
    # step (between 4 and 6 times a scale of 1/2 or more) is 2, and so is its clipping above 6 / 2.
    x = np.random.default_rng(3).uniform(-8, 8, (16, 128)).astype(np.float32)
    error = np.abs(quant.dequantize(quant.quantize(x, dtype), dtype, x.shape) - x)
    assert error.max() <= tolerance
    assert error.max() > 0  # a lossless round trip would mean nothing was quantized


def test_plain_formats_match_reference() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 48)).astype(np.float32) * 100
    x[0, :4] = [np.nan, np.inf, -0.0, 1e-40]
    for dtype in ("f16", "bf16"):
        ours = quant.quantize(x, dtype)
        theirs = reference.quantize(x, GGML_TYPE[dtype])
        assert ours.shape == x.shape
        np.testing.assert_array_equal(ours.view(np.uint8), theirs.view(np.uint8))
        assert same_bits(
            quant.dequantize(ours, dtype, x.shape),
            reference.dequantize(theirs, GGML_TYPE[dtype]).reshape(x.shape),
        )
    assert same_bits(quant.dequantize(quant.quantize(x, "f32"), "f32", x.shape), x)
    assert same_bits(quant.dequantize(x.view(np.uint8), "f32", x.shape), x)


def test_bf16_rounds_half_to_even() -> None:
    halfway_down = np.array([0x3F808000], dtype=np.uint32).view(np.float32)  # even below
    halfway_up = np.array([0x3F818000], dtype=np.uint32).view(np.float32)  # odd below
    assert quant.quantize(halfway_down, "bf16")[0] == 0x3F80
    assert quant.quantize(halfway_up, "bf16")[0] == 0x3F82


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.quantize(np.zeros((2, 48), np.float32), "q8_0")
    with pytest.raises(ValueError, match="needs 68 bytes"):
        quant.dequantize(np.zeros(34, np.uint8), "q8_0", (2, 32))
    with pytest.raises(ValueError, match="unknown dtype"):
        quant.raw_nbytes("q5_k", (1, 256))


def test_dequantize_embedding_sized_q8_0_is_fast() -> None:
    shape = (49152, 576)
    raw = np.random.default_rng(0).integers(0, 256, quant.raw_shape("q8_0", shape), dtype=np.uint8)
    raw[:, 1 :: quant.BLOCK_BYTES["q8_0"]] &= 0x3F  # finite f16 scales
    start = time.perf_counter()
    values = quant.dequantize(raw, "q8_0", shape)
    elapsed = time.perf_counter() - start
    assert values.shape == shape and np.isfinite(values).all()
    assert elapsed < 1.0


# --- the real model ----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> GGUFReader:
    return GGUFReader(resolve_alias("smollm2"))


def test_real_tensors_decode_like_reference_and_requantize_to_the_file(
    smollm2: GGUFReader,
) -> None:
    seen: set[str] = set()
    for tensor in smollm2.tensors:
        dtype = tensor.tensor_type.name.lower()
        if dtype not in quant.BLOCK_SIZE:
            continue
        # GGUF lists dims innermost first; numpy wants rows first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = quant.dequantize(tensor.data, dtype, shape)
        assert same_bits(values, reference.dequantize(tensor.data, tensor.tensor_type)), tensor.name
        # The file was written by ggml's reference quantizer, which is idempotent
        # on its own output, so re-encoding must reproduce every byte.
        np.testing.assert_array_equal(quant.quantize(values, dtype), tensor.data, tensor.name)
        seen.add(dtype)
    assert seen == {"q4_1", "q8_0"}
