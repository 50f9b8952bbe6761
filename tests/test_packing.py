"""Bit-packing and Huffman coding of cluster indices: exact round trips and code quality."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from wscompress.model.forms.wscompress_palettized import (BLOCK, entropy, huffman_decode, huffman_encode, huffman_lengths, pack,
                                                          packed_nbytes, unpack)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4099])
def test_pack_round_trip_every_width(bits, n):
    values = torch.randint(0, 2 ** bits, (n,), generator=torch.Generator().manual_seed(bits * 100 + n))
    packed = pack(values, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(n, bits)
    assert torch.equal(unpack(packed, bits, n), values)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_uses_exactly_bits_per_value(bits):
    assert packed_nbytes(8000, bits) * 8 == 8000 * bits
    assert pack(torch.full((8000,), 2 ** bits - 1), bits).numel() * 8 == 8000 * bits


def test_pack_rejects_bad_width():
    with pytest.raises(ValueError):
        pack(torch.zeros(3, dtype=torch.long), 9)


def test_huffman_lengths_textbook_example():
    # counts 5,2,1,1 -> a 1-bit, b 2-bit, c and d 3-bit codes
    assert list(huffman_lengths(np.array([5, 2, 1, 1]))) == [1, 2, 3, 3]


def test_entropy_of_uniform_and_constant():
    assert entropy(np.ones(16)) == pytest.approx(4.0)
    assert entropy(np.array([0, 10, 0])) == 0.0


@pytest.mark.parametrize("k,n,alpha", [(2, 5000, 1.0), (16, 20_000, 0.3), (256, 50_000, 0.5), (8, BLOCK * 3, 2.0),
                                       (64, BLOCK + 1, 0.1)])
def test_huffman_round_trip_and_rate_within_one_bit_of_entropy(k, n, alpha):
    rng = np.random.default_rng(k + n)
    symbols = rng.choice(k, size=n, p=rng.dirichlet(np.full(k, alpha)))
    stream = huffman_encode(symbols, k)
    assert np.array_equal(huffman_decode(stream), symbols)
    h = entropy(np.bincount(symbols, minlength=k))
    assert h <= stream.bits / n < h + 1
    assert len(stream.data) == math.ceil(stream.bits / 8)


@pytest.mark.parametrize("symbols", [np.full(2500, 3), np.array([5]), np.array([], dtype=np.int64)])
def test_huffman_degenerate_streams(symbols):
    stream = huffman_encode(symbols, 8)
    assert np.array_equal(huffman_decode(stream), symbols)
    assert stream.bits == 0  # one symbol needs no bits at all


def test_huffman_skewed_counts_need_long_codes():
    fib = [1, 1]
    while len(fib) < 26:
        fib.append(fib[-1] + fib[-2])
    symbols = np.random.default_rng(0).permutation(np.repeat(np.arange(26), fib))  # Fibonacci counts: deepest tree
    stream = huffman_encode(symbols, 32)
    assert huffman_lengths(np.bincount(symbols)).max() == 25
    assert np.array_equal(huffman_decode(stream), symbols)
