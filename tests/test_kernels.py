"""The LUT kernels (wscompress/kernels): built where a compiler exists, and the same results
as the reference path (materialise the weight, then F.linear)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

import wscompress
from wscompress import kernels
from wscompress.maths.clustering import cluster
from wscompress.model.forms.wscompress_format import DECODE_ROWS, KERNELS
from wscompress.model.forms.wscompress_palettized import PalettizedLinear, dequantize

from conftest import tiny_model

CALIB = {"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2}


@pytest.fixture
def float_activations(monkeypatch):
    """Decoding multiplies float activations and prefill keeps float32 off AMX tiles (the tests
    that compare with the reference path to float rounding); the 8-bit and bfloat16 paths have
    tests of their own below."""
    monkeypatch.setattr(kernels, "_q8", {4: False, 6: False, 8: False})
    monkeypatch.setenv("WSCOMPRESS_AMX", "0")


def test_kernels_build_where_a_compiler_exists():
    if shutil.which("c++") or shutil.which("g++"):
        assert kernels.lut() is not None, kernels.status()
    assert kernels.status()


def layer(bits: int, group_size: int, out: int = 48, inp: int = 72, outliers: int = 0, seed: int = 0,
          d: int = 1, scaled: bool = False, codebook_dtype: str = "float32") -> PalettizedLinear:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen)
    codebook, idx = cluster(w.reshape(out // group_size, -1, d), bits)
    kept = None
    if outliers:
        pos = torch.randperm(out * inp, generator=gen)[:outliers].sort().values
        kept = (pos, w.flatten()[pos])
    scale = torch.rand(out, generator=gen) + 0.5 if scaled else None
    return PalettizedLinear.from_clusters(codebook, idx.reshape(out, inp // d), torch.randn(out, generator=gen),
                                          codebook_dtype=codebook_dtype, outliers=kept, scale=scale)


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
def test_outliers_are_read_at_their_stored_positions():
    """The kernels read the kept-aside weights' stored flat positions themselves (no column copy,
    so no 16-bit limit on a row's width) and their corrections in float16 where the layer stores
    its values so; a folder written with the positions unsorted is sorted in place once, the
    layer computing the same."""
    lin = layer(4, 2, out=2, inp=(1 << 16) + 64, outliers=3, codebook_dtype="float16")
    x = torch.randn(1, lin.in_features)
    x[0, lin.outlier_index.long() % lin.in_features] = 100.0  # the outliers' corrections weigh in the sums
    layout = lin.kernel_layout()
    assert layout.outliers.pos.data_ptr() == lin.outlier_index.data_ptr() and layout.outliers.delta.dtype == torch.float16
    with torch.no_grad():
        ref = q8_reference(lin, x) if kernels.q8(layout.width) else F.linear(x, lin.dense_weight(), lin.bias)
        terms = x.abs() @ lin.dense_weight().abs().T
        assert ((lin(x) - ref).abs() <= 1e-4 * terms).all()
    shuffled = layer(4, 2, out=8, inp=64, outliers=12)
    expected = shuffled.dense_weight()
    order = torch.randperm(12)
    with torch.no_grad():
        shuffled.outlier_index.copy_(shuffled.outlier_index[order])
        shuffled.outlier_value.copy_(shuffled.outlier_value[order])
    assert shuffled.kernel_layout().outliers.pos.data_ptr() == shuffled.outlier_index.data_ptr()
    assert bool((shuffled.outlier_index.diff() > 0).all())
    torch.testing.assert_close(shuffled.dense_weight(), expected, rtol=0, atol=0)


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
@pytest.mark.parametrize("bits, group_size, outliers", [(4, 1, 0), (4, 16, 5), (4, 48, 0), (3, 1, 7), (2, 8, 0),
                                                        (1, 1, 0), (5, 1, 3), (8, 4, 0), (6, 48, 0)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_lut_matmul_equals_the_reference_path(bits, group_size, outliers, rows, float_activations):
    lin = layer(bits, group_size, outliers=outliers)
    x = torch.randn(rows, 72)
    ref = F.linear(x, lin.dense_weight(), lin.bias)
    with torch.no_grad():
        assert lin.lut_forward(x) is not None  # the kernel ran
        torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(x.view(1, rows, 72)), ref.view(1, rows, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
@pytest.mark.parametrize("d, bits, group_size, outliers", [(2, 4, 1, 0), (2, 4, 16, 6), (2, 3, 48, 0), (2, 6, 8, 4),
                                                           (2, 8, 48, 0), (4, 8, 48, 5), (4, 4, 16, 0), (4, 2, 1, 0)])
@pytest.mark.parametrize("rows, inp", [(1, 72), (2, 64), (5, 72), (40, 72)])
def test_vector_codebooks_equal_the_reference_path(d, bits, group_size, outliers, rows, inp, float_activations):
    """Vector codebooks (a centroid for every d weights in a row) decode through the kernel too:
    nibble and byte indices, tables held in registers or gathered, a row's tail past the last
    whole block, outliers, and prefill (more than DECODE_ROWS rows)."""
    lin = layer(bits, group_size, inp=inp, outliers=outliers, d=d)
    x = torch.randn(rows, inp)
    with torch.no_grad():
        assert lin.lut_forward(x) is not None
        torch.testing.assert_close(lin(x), F.linear(x, lin.dense_weight(), lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
def test_pairs_of_6_bit_indices_are_held_once_where_byte_products_read_them():
    """The 3-bit recipe's layout (pairs of weights, 6-bit indices): where the byte products
    spread them (builds with AVX2 or AVX-512 VBMI), the kernel layout is the stored tensor
    itself; elsewhere a byte a pair beside it, which the AVX2 float path reads faster."""
    lin = layer(6, 8, inp=64, outliers=4, d=2)
    with torch.no_grad():
        lin(torch.randn(1, 64))
    layout = lin.kernel_layout()
    if kernels.six_bit_pairs():
        assert layout.width == 6 and layout.indices.data_ptr() == lin.indices.data_ptr()
    else:
        assert layout.width == 8 and layout.indices.numel() == lin.out_features * 32  # a byte a pair


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
@pytest.mark.parametrize("rows, inp", [(1, 64), (3, 96), (DECODE_ROWS + 1, 160)])
def test_the_6_bit_operators_equal_the_byte_ones(rows, inp):
    """Every operator reads pairs' 6-bit indices as stored (four in three bytes) exactly as it
    reads the same indices a byte each: float products, dense decodes (float and int8) and,
    where the build has them, byte products."""
    from wscompress.model.forms.wscompress_palettized import pack, round_tables

    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 64, (48, inp // 2), generator=gen)
    tables = torch.randn(6, 64, 2, generator=gen)
    six, byte = pack(idx, 6), idx.to(torch.uint8).flatten()
    none = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.uint16), torch.empty(0)
    x = torch.randn(rows, inp, generator=gen)
    ops = torch.ops.wscompress
    for width, indices in ((6, six), (8, byte)):
        y = ops.lut_linear(x, indices, tables, width, 8, 48, *none)
        dense = ops.lut_dense(indices, tables, width, 8, 48, inp, *none)
        i8 = ops.lut_dense_q8(indices, *round_tables(tables, width), width, 8, 48, inp)
        q8 = ops.lut_linear_q8(x[:8], indices, *round_tables(tables, width), width, 8, 48, *none) \
            if kernels.q8(6) and kernels.q8(8) else None
        if width == 6:
            first = y, dense, i8, q8
    assert torch.equal(first[0], y) and torch.equal(first[1], dense) and torch.equal(first[2], i8)
    assert first[3] is None or torch.equal(first[3], q8)


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
def test_outlier_corrections_follow_a_trained_codebook(float_activations):
    """The kernel's outlier corrections (exact weight minus codebook value) are prepared once;
    a codebook changed in place (a fine-tuning step) or outliers given out of order still give
    the reference result."""
    lin = layer(4, 16, outliers=9)

    def check():
        for rows in (1, DECODE_ROWS + 1):
            x = torch.randn(rows, 72)
            torch.testing.assert_close(lin(x), F.linear(x, lin.dense_weight(), lin.bias), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        check()
        lin.codebook.mul_(1.5)
        check()
        lin.outlier_index.copy_(lin.outlier_index.flip(0))
        lin.outlier_value.copy_(lin.outlier_value.flip(0))
        check()


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
@pytest.mark.parametrize("d, bits, group_size, outliers", [(1, 4, 16, 5), (2, 8, 48, 6), (4, 8, 16, 0)])
def test_row_scales_decode_through_the_kernel(d, bits, group_size, outliers, float_activations):
    """Row scales multiply the kernel's output; the outliers' corrections (exact over scale,
    minus the codebook value) follow a scale changed in place, as a fine-tuning step does."""
    lin = layer(bits, group_size, outliers=outliers, d=d, scaled=True)

    def check():
        for rows in (1, DECODE_ROWS + 1):
            x = torch.randn(rows, 72)
            assert lin.lut_forward(x) is not None
            torch.testing.assert_close(lin(x), F.linear(x, lin.dense_weight(), lin.bias), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        check()
        lin.scale.mul_(torch.linspace(0.5, 2, 48))
        check()
        if outliers:  # kept-aside weights are exact, whatever the scale
            pos = lin.outlier_index.long()
            torch.testing.assert_close(lin.dense_weight().flatten()[pos], lin.outlier_value)
        torch.testing.assert_close(lin.rows(torch.tensor([0, 47, 5])), lin.dense_weight()[[0, 47, 5]])


def rounded_weights(lin: PalettizedLinear) -> list[torch.Tensor]:
    """The weight the byte products multiply, from the rounded tables (12-bit values 16·hi + lo;
    4-d vectors: 16-bit, 256·hi + lo), outliers not applied, and its hi part alone (unit·hi)."""
    values, scales = lin.kernel_layout().rounded
    groups, d = values.shape[0], lin.cluster_dim
    wide = d == 4  # 16-bit tables: 256·hi + lo, a lo byte a component
    k = values.shape[1] // (2 * d if wide else d + (d + 1) // 2)
    hi = values[:, : d * k].float().reshape(groups, d, k)
    lo = values[:, d * k:].view(torch.uint8).int().reshape(groups, -1, k)
    if not wide:  # two components a byte
        lo = torch.stack([lo[:, c // 2] >> 4 * (c % 2) & 15 for c in range(d)], 1)
    unit = 256 if wide else 16
    return [dequantize((t * scales[:, None, None]).transpose(1, 2).contiguous(), lin.index_matrix(), lin.group_size)
            for t in (unit * hi + lo, unit * hi)]


def outlier_products(lin: PalettizedLinear, x: torch.Tensor) -> torch.Tensor:
    """x times the outliers' float corrections (exact weight minus codebook value), by output."""
    layout = lin.kernel_layout()
    if layout.outliers is None:
        return torch.zeros(x.shape[0], lin.out_features, dtype=x.dtype)
    row_ptr, pos, delta = layout.outliers
    rows = torch.repeat_interleave(torch.arange(lin.out_features), row_ptr.diff())
    return x[:, pos.long() % lin.in_features] * delta.to(x.dtype) @ F.one_hot(rows, lin.out_features).to(x.dtype)


def q8_reference(lin: PalettizedLinear, x: torch.Tensor) -> torch.Tensor:
    """What the byte-product path computes, in torch: the weight from the rounded tables
    (``rounded_weights``), each input row as s (q1 + q2 / 256) with s the largest magnitude / 127
    of the row (AVX-512 builds, whose sums stay integers to the row's end: ``lut_q8(8)``) or of
    each block of 32 (AVX2) and q1, q2 signed bytes, their products but lo·q2, the outliers'
    float corrections, then the row scales and the bias."""
    weight = rounded_weights(lin)
    blocks = x.reshape(x.shape[0], -1, x.shape[1] if torch.ops.wscompress.lut_q8(8) else 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    v = blocks * torch.where(amax > 0, 127 / amax, 0)
    q1 = v.round()
    q2 = ((v - q1) * 256).round().clamp(-127, 127) / 256
    y = sum((q * amax / 127).reshape_as(x) @ w.T for q, w in zip((q1, q2), weight))  # lo q2 left out
    y += outlier_products(lin, x)
    if lin.scale is not None:
        y = y * lin.scale
    return y + lin.bias


@pytest.mark.skipif(kernels.lut() is None or not kernels.q8(4), reason="no 8-bit path here")
@pytest.mark.parametrize("d, bits, group_size, outliers, scaled", [(1, 4, 16, 0, False), (1, 3, 6, 7, True),
                                                                   (1, 4, 48, 5, False), (2, 8, 48, 0, False),
                                                                   (2, 6, 6, 9, True), (2, 8, 16, 4, True),
                                                                   (1, 8, 16, 3, True), (1, 6, 48, 0, False),
                                                                   (4, 8, 48, 6, True), (4, 8, 16, 0, False)])
@pytest.mark.parametrize("rows, inp", [(1, 64), (2, 96), (5, 160), (8, 64)])
def test_decoding_on_8_bit_activations_computes_its_rounding(d, bits, group_size, outliers, scaled, rows, inp):
    """Decoding multiplies 8-bit activations by the 8-bit tables (nibbles of single weights,
    bytes of single weights, of pairs and of 4-d vectors): exactly the rounding ``q8_reference`` spells out, to float summation order,
    on rows of 2 to 5 blocks (a partial last step), groups of rows that a block of 4 straddles,
    outliers and row scales; within 0.1 % of the float product."""
    lin = layer(bits, group_size, out=48, inp=inp, outliers=outliers, d=d, scaled=scaled)
    if not kernels.q8(lin.kernel_layout().width):
        pytest.skip("this CPU's build has no 8-bit path for byte indices")
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows * inp))  # not the order tests ran in
    x[0, :32] = 0  # a block of zeros rounds to zeros (no division by its scale)
    with torch.no_grad():
        y = lin(x)
        ref = q8_reference(lin, x)  # float sums in another order: they differ by float32's grain times the
        terms = x.abs() @ lin.dense_weight().abs().T  # size of the terms summed (not of the sum, which may cancel)
        assert ((y - ref).abs() <= 3e-5 * terms + 1e-6).all(), ((y - ref).abs() / terms).max()  # n eps, n <= 160
        exact = F.linear(x, lin.dense_weight(), lin.bias)
        assert (y - exact).norm() / exact.norm() < 1e-3
        torch.testing.assert_close(lin(x.view(1, rows, inp)), y.view(1, rows, -1))


def integer_reference(lin: PalettizedLinear, x: torch.Tensor) -> torch.Tensor:
    """What prefill's integer product computes, spelled out in float64: the weight the byte
    products multiply (``rounded_weights``) times each activation row in integers, the weights
    kept aside corrected exactly, the row scales after. Where the build has 16-bit products
    (AVX-512 VNNI, as ``lut_q8(8)`` tells) and the tables 12 bits, the row is rounded to 14 bits
    (x ≈ s·q, s = its largest magnitude / 8191, in float32 as the kernel rounds it) and
    multiplied whole; else it is split into two 8-bit parts (x ≈ s·a + s/254·b) and every
    product but b·lo is made."""
    full, hi = (w.double() for w in rounded_weights(lin))
    amax = x.abs().amax(1, keepdim=True)
    if torch.ops.wscompress.lut_q8(8) and lin.cluster_dim != 4:
        inv = torch.where(amax > 0, 8191 / amax, 0)  # float32, as the kernel computes it
        y = (x * inv).round().double() * (amax.double() / 8191) @ full.T
    else:
        s = amax.double().clamp_min(1e-300) / 127
        a = (x.double() / s).round()
        b = (x.double() / s - a).mul(254).round()
        y = a * s @ full.T + b * s / 254 @ hi.T
    y = y + outlier_products(lin, x.double())
    return y * lin.scale.double() if lin.scaled else y


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
@pytest.mark.parametrize("d, bits, group_size, outliers, scaled", [(1, 4, 16, 0, False), (1, 3, 6, 7, True),
                                                                   (2, 8, 48, 0, False), (2, 6, 6, 9, True),
                                                                   (2, 8, 16, 4, True), (4, 8, 16, 3, False),
                                                                   (1, 8, 16, 2, False)])
@pytest.mark.parametrize("rows, out, inp", [(DECODE_ROWS + 5, 48, 96), (77, 52, 320)])
def test_prefill_multiplies_integers(d, bits, group_size, outliers, scaled, rows, out, inp, monkeypatch):
    """With WSCOMPRESS_INT8_PREFILL=1, prefill (more than DECODE_ROWS rows) multiplies integers
    on the weight decoding multiplies: exactly the rounding ``integer_reference`` spells out, to
    float summation order; within 0.1 % of the float product; with 0, the float product. The
    second shape leaves partial tiles of input and weight rows (its groups: a divisor of 52) and
    sums over several spans of inputs."""
    lin = layer(bits, math.gcd(group_size, out), out=out, inp=inp, outliers=outliers, d=d, scaled=scaled)
    monkeypatch.setenv("WSCOMPRESS_INT8_PREFILL", "1")
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(bits * group_size + d))  # not the order tests ran in
    x[0] = 0  # a row of zeros stays zeros (no division by its scale)
    with torch.no_grad():
        y = lin(x) - lin.bias
        ref = integer_reference(lin, x)
        assert ((y.double() - ref).abs() <= 1e-5 * (x.abs() @ lin.dense_weight().abs().T).double() + 1e-6).all()
        exact = F.linear(x, lin.dense_weight())
        assert 1e-6 < (y - exact).norm() / exact.norm() < 1e-3
        monkeypatch.setenv("WSCOMPRESS_INT8_PREFILL", "0")
        torch.testing.assert_close(lin(x) - lin.bias, exact, rtol=1e-5, atol=1e-5 * inp / 96)  # float sums of inp terms


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
@pytest.mark.parametrize("d, bits, inp", [(1, 4, 576), (1, 3, 1088), (1, 8, 608), (2, 8, 576), (2, 6, 1088),
                                          (4, 8, 1088), (4, 8, 2048)])
def test_the_integer_weight_is_the_one_decoding_multiplies(d, bits, inp):
    """lut_dense_q8's hi and lo planes hold exactly the rounded tables' values (whole steps of 64
    indices and a last part one, every layout the byte products read)."""
    lin = layer(bits, 8, out=16, inp=inp, d=d)
    layout = lin.kernel_layout()
    values, scales = layout.rounded
    planes = torch.ops.wscompress.lut_dense_q8(layout.indices, values, scales, layout.width, 8, 16, inp).double()
    unit, offset = (256, 128) if d == 4 else (16, 0)
    weight = (unit * planes[:16] + planes[16:] + offset) * scales.double().repeat_interleave(8)[:, None]
    torch.testing.assert_close(weight, rounded_weights(lin)[0].double(), rtol=1e-6, atol=0)


def test_integer_prefill_by_default_where_it_pays(monkeypatch):
    """Unset, WSCOMPRESS_INT8_PREFILL leaves the choice to the layer's size: integers from
    INTEGER_PREFILL_WEIGHTS weights on, where the build decodes their weight vectorised; never
    for nibble vectors, which have no rounded tables' decode."""
    monkeypatch.delenv("WSCOMPRESS_INT8_PREFILL", raising=False)
    pairs, vectors, nibble_pairs = torch.zeros(1, 256, 2), torch.zeros(1, 256, 4), torch.zeros(1, 16, 2)
    big = kernels.INTEGER_PREFILL_WEIGHTS
    assert kernels.integer_prefill(8, pairs, big // 1024, 1024) == kernels.q8(8)
    assert kernels.integer_prefill(8, vectors, big // 1024, 1024) == kernels.q8(8)
    assert not kernels.integer_prefill(8, pairs, big // 1024 - 1, 1024)
    assert not kernels.integer_prefill(4, nibble_pairs, big, 1024)
    monkeypatch.setenv("WSCOMPRESS_INT8_PREFILL", "1")
    assert kernels.integer_prefill(8, vectors, 48, 96) and not kernels.integer_prefill(4, nibble_pairs, 48, 96)
    monkeypatch.setenv("WSCOMPRESS_INT8_PREFILL", "0")
    assert not kernels.integer_prefill(8, pairs, big, 1024)


AMX = kernels.lut() is not None and bool(torch.ops.wscompress.lut_amx())


@pytest.mark.skipif(not AMX, reason="no AMX tiles here (amx_bf16) or kernels not built")
@pytest.mark.parametrize("d, bits, group_size, outliers, scaled", [(1, 4, 16, 0, False), (1, 3, 6, 7, True),
                                                                   (2, 8, 48, 0, False), (2, 6, 6, 9, True),
                                                                   (2, 8, 16, 4, True), (4, 8, 16, 3, False),
                                                                   (1, 8, 16, 2, False)])
@pytest.mark.parametrize("rows, out, inp", [(DECODE_ROWS + 5, 48, 96), (300, 130, 320)])
def test_prefill_on_amx_tiles_multiplies_the_rounded_weight_in_bfloat16(d, bits, group_size, outliers, scaled,
                                                                          rows, out, inp, monkeypatch):
    """Where the CPU has AMX, prefill multiplies the weight decoding multiplies (``rounded_weights``,
    outliers added), rounded to bfloat16, by the input rounded to bfloat16, with float32 sums:
    that product to float summation order (and a few weights rounded the other way at a tie's
    edge), within 0.5 % of the float product. The second shape leaves a last block of weight rows
    short of 64 (groups: a divisor of 130) and runs the input past one block of 256 rows."""
    lin = layer(bits, math.gcd(group_size, out), out=out, inp=inp, outliers=outliers, d=d, scaled=scaled)
    monkeypatch.delenv("WSCOMPRESS_INT8_PREFILL", raising=False)
    monkeypatch.delenv("WSCOMPRESS_AMX", raising=False)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(bits * group_size + d))
    w = rounded_weights(lin)[0].float()
    if outliers:
        row_ptr, pos, delta = lin.kernel_layout().outliers
        w.view(-1)[pos.long()] += delta.float()
    ref = x.bfloat16().double() @ w.bfloat16().double().T
    ref = ref * lin.scale.double() if lin.scaled else ref
    with torch.no_grad():
        y = (lin(x) - lin.bias).double()
        assert (y - ref).norm() / ref.norm() < 1e-4
        exact = F.linear(x, lin.dense_weight()).double()
        assert 1e-4 < (y - exact).norm() / exact.norm() < 5e-3
        monkeypatch.setenv("WSCOMPRESS_AMX", "0")  # the path off: the integers' or float32's product
        assert (lin(x) - lin.bias - exact).norm() / exact.norm() < 1e-3


@pytest.mark.skipif(not AMX, reason="no AMX tiles here (amx_bf16) or kernels not built")
def test_a_model_prefills_on_amx_tiles_where_the_cpu_has_them(tokenizer, monkeypatch):
    """Unset (as outside the suite), WSCOMPRESS_AMX leaves a compressed model's prefill and
    evaluation on AMX tiles: its logits within bfloat16's rounding of the float32 path's, its
    decoding (one row) unchanged."""
    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "kmeans", "bits": 8, "cluster_dim": 2}], tokenizer, CALIB)  # the 4-bit recipe's
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        float32, step = model(input_ids=ids).logits, model(input_ids=ids[:1, :1]).logits
        monkeypatch.delenv("WSCOMPRESS_AMX")
        tiles = model(input_ids=ids).logits
        assert 1e-5 < (tiles - float32).norm() / float32.norm() < 1e-2
        torch.testing.assert_close(model(input_ids=ids[:1, :1]).logits, step)


def test_a_layout_off_the_cpu_has_no_8_bit_tables():
    """The 8-bit tables are for the CPU's kernels only: a layer on another device (a GPU; meta
    here) prepares its layout without them (their rounding mixed the devices and crashed on an H200)."""
    for lin in (layer(4, 16, inp=64), layer(8, 16, inp=64, d=2)):
        assert lin.kernel_layout().rounded is not None
        assert lin.to("meta").kernel_layout().rounded is None


@pytest.mark.cross_build
def test_the_avx2_build_decodes_nibbles_on_8_bit_activations():
    """The AVX2 build (``WSCOMPRESS_MARCH=haswell``, what a CPU without AVX-512 compiles) runs
    the 8-bit path for nibble tables and 6-bit pairs, the float path for bytes of pairs, with the same
    results as its rounding and the reference path, float16 weights (F16C) and the integer
    prefill's scalar decode: the checking machines have no AVX-512."""
    import subprocess
    import sys
    from pathlib import Path

    from wscompress.io.hardware import cpu_flags

    if "avx2" not in cpu_flags() or not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no AVX2 or no compiler here")
    if "avx512f" not in cpu_flags():
        pytest.skip("this CPU's own build is the AVX2 one, which the other tests run")
    here = Path(__file__).parent
    env = {**__import__("os").environ, "WSCOMPRESS_MARCH": "haswell"}
    check = ("from wscompress import kernels; assert 'haswell' in kernels.status() and kernels.q8(4) and kernels.q8(6) "
             "and not kernels.q8(8) and kernels.six_bit_pairs(), kernels.status()")
    assert subprocess.run([sys.executable, "-c", check], env=env).returncode == 0
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_kernels.py"),
                          "-k", "8_bit_activations_computes or lut_matmul_equals or vector_codebooks_equal or half_weights or int8_blocks "
                          "or 6_bit or integer"],
                         env=env, cwd=here.parent, capture_output=True, text=True)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:]


def test_gradients_and_odd_rows_take_the_reference_path():
    lin = layer(4, 1)
    x = torch.randn(2, 72)
    assert lin.lut_forward(x) is not None  # held values: the kernel
    lin.train_values()
    assert lin.lut_forward(x) is None  # the codebook trains: autograd needs the torch path
    lin(x).sum().backward()
    assert lin.codebook.grad is not None
    for d, inp in ((3, 72), (2, 70)):  # 3-vectors; 35 nibble indices a row, not whole bytes
        odd = layer(3, 48, inp=inp, d=d)
        with torch.no_grad():
            assert odd.lut_forward(torch.randn(1, inp)) is None
            torch.testing.assert_close(odd(x := torch.randn(1, inp)), F.linear(x, odd.dense_weight(), odd.bias))


@pytest.mark.skipif(kernels.lut() is None, reason="kernels not built here")
def test_whole_model_logits_match_the_reference_path(tokenizer, monkeypatch, float_activations):
    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "kmeans", "bits": 3}], tokenizer, CALIB)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        fast = model(input_ids=ids).logits
        step = model(input_ids=ids[:1, :1]).logits
        monkeypatch.setitem(KERNELS, "palettized", lambda *a, **k: None)
        torch.testing.assert_close(model(input_ids=ids).logits, fast, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(input_ids=ids[:1, :1]).logits, step, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [3, 4])
def test_resident_bytes_stay_packed(bits):
    """What a palettized layer holds in memory after running: the packed indices (4-bit: the
    stored bytes themselves; 3-bit: re-packed as nibbles for the kernel, its 8-entry table padded
    to 16) and the codebook."""
    from wscompress.io.storage import resident_bytes

    lin = layer(bits, 48, out=48, inp=64)
    with torch.no_grad():
        lin(torch.randn(1, 64))
    repacked = bits < 4 and kernels.lut() is not None
    indices = 48 * 64 * (bits + 4 if repacked else bits) // 8  # + the nibble copy
    padded = 16 if repacked else 0  # the one group's table as the kernel reads it
    rounded = 2 * 16 + 4  # and rounded for the 8-bit path (hi and lo bytes), with its scale
    assert resident_bytes(lin) == indices + 4 * (lin.codebook.numel() + 48 + padded) + rounded  # + codebook and bias


def test_lowrank_kernel_builds_where_a_compiler_exists():
    if shutil.which("c++") or shutil.which("g++"):
        assert kernels.lowrank() is not None, kernels.status()


@pytest.mark.skipif(kernels.lut() is None or kernels.lowrank() is None, reason="kernels not built here")
@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_nearest_centroid_kernel_equals_the_distance_matrix(d, monkeypatch):
    """The compiled search (no distance matrix) finds the centroid the torch path finds, at the
    same squared distance; k-means and error feedback built on it then cluster alike."""
    from wscompress.maths import clustering

    if kernels.kmeans() is None:
        pytest.skip("kernels unavailable here: " + kernels.status())
    gen = torch.Generator().manual_seed(d)
    points, centroids = torch.randn(5, 333, d, generator=gen), torch.randn(5, 37, d, generator=gen)
    dist, idx = clustering._nearest(points, centroids, distances=True)
    monkeypatch.setattr(kernels, "kmeans", lambda: None)
    ref_dist, ref_idx = clustering._nearest(points, centroids, distances=True)
    torch.testing.assert_close(dist, ref_dist, atol=1e-5, rtol=1e-5)
    full = torch.cdist(points.double(), centroids.double()).pow(2).sort(-1).values
    clear = full[..., 1] - full[..., 0] > 1e-4  # rounding may break an exact tie either way
    assert clear.float().mean() > 0.95 and torch.equal(idx[clear], ref_idx[clear])


def test_kmeans_pp_kernel_draws_as_the_inverse_cdf():
    """The compiled k-means++ seeding picks, at given uniforms, the points the torch inverse CDF
    (cumsum, searchsorted) picks, exactly on integer data (no rounding to differ), never a point
    of weight zero, and the same points as the torch path of ``_kmeans_pp`` from the same seed."""
    from wscompress.maths import clustering

    if kernels.kmeans() is None:
        pytest.skip("kernels unavailable here: " + kernels.status())
    gen = torch.Generator().manual_seed(0)
    points = torch.randint(-20, 20, (6, 300, 3), generator=gen).float()
    weights = torch.randint(0, 4, (6, 300), generator=gen).float()  # a quarter of the points weigh nothing
    u = torch.rand(6, 24, generator=gen)

    def draw(mass: torch.Tensor, ui: torch.Tensor) -> int:
        cdf = mass.cumsum(0)
        return min(int(torch.searchsorted(cdf, (ui * cdf[-1]).reshape(1), right=True)), mass.numel() - 1)

    expected = []
    for p, w, ub in zip(points, weights, u):
        picks = [draw(w, ub[0])]
        d2 = ((p - p[picks[0]]) ** 2).sum(-1)
        for s in range(1, u.shape[1]):
            picks.append(draw(d2 * w, ub[s]))
            d2 = torch.minimum(d2, ((p - p[picks[-1]]) ** 2).sum(-1))
        assert all(w[i] > 0 for i in picks)
        expected.append(p[picks])
    assert torch.equal(kernels.kmeans().kmeans_pp(points, weights, u), torch.stack(expected))

    # the torch path takes the same draws: both seed k-means with the same points
    fast = clustering._kmeans_pp(points, weights, 24, torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "kmeans", lambda: None)
        slow = clustering._kmeans_pp(points, weights, 24, torch.Generator().manual_seed(1))
    assert torch.equal(fast, slow)


def test_another_checkout_reuses_the_built_kernels(tmp_path):
    """A second copy of the package (a CI clone beside a working copy, an install beside an
    editable one) loads the libraries this one built instead of rebuilding them (~27 s each),
    and this copy then still finds them current."""
    import subprocess
    import sys
    from pathlib import Path

    from wscompress.io.files import cache_dir

    libraries = sorted((cache_dir() / "kernels" / kernels._build_folder()).rglob("*.so"))
    built = [p.stat().st_mtime_ns for p in libraries]
    shutil.copytree(Path(wscompress.__file__).parent, tmp_path / "wscompress",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = "import wscompress, sys; from wscompress import kernels\n" \
           "assert wscompress.__file__.startswith(sys.argv[1]) and kernels.lut() and kernels.lowrank()"
    for where in (tmp_path, Path(wscompress.__file__).parent.parent):
        assert subprocess.run([sys.executable, "-c", code, str(where)], cwd=where).returncode == 0
    assert len(libraries) >= 2 and [p.stat().st_mtime_ns for p in libraries] == built


@pytest.mark.kernel_build
@pytest.mark.skipif(kernels.lowrank() is None, reason="kernels not built here")
def test_a_build_killed_midway_does_not_hang_the_next_run(tmp_path):
    """A build killed while it compiles (SIGKILL: no handler runs) leaves torch's lock file
    behind; the next process removes it and builds, where it used to wait on it forever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "WSCOMPRESS_CACHE": str(tmp_path)}
    code = "from wscompress import kernels; assert kernels.lowrank() is not None, kernels.status()"
    first = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("kernels/*/lowrank/lock")) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the build ended before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert list(tmp_path.glob("kernels/*/lowrank/lock"))  # what a killed build leaves
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=600).returncode == 0
    assert not list(tmp_path.glob("kernels/*/lowrank/lock"))


def test_an_environment_reaching_torch_through_a_symlink_keys_its_own_build(tmp_path):
    """The build folder is keyed by the path the compile command names torch's headers by. Keyed
    by the resolved path, an environment that imports torch through a symlink shared the folder
    with one that imports it directly, and each rebuilt the other's libraries (ninja saw
    another command)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    site = Path(torch.__file__).parent.parent
    (tmp_path / "site").symlink_to(site, target_is_directory=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch\n"
            "from torch.utils.cpp_extension import include_paths\n"
            "from wscompress import kernels\n"
            "assert torch.__file__.startswith(sys.argv[1]), torch.__file__\n"
            "assert include_paths()[0].startswith(kernels.torch_folder())\n"
            "print(kernels._build_folder())")
    env = {**os.environ, "WSCOMPRESS_KERNELS": "0"}
    linked = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], env=env, capture_output=True, text=True)
    direct = subprocess.run([sys.executable, "-c", code, str(site)], env=env, capture_output=True, text=True)
    assert linked.returncode == 0 and direct.returncode == 0, linked.stderr + direct.stderr
    assert linked.stdout != direct.stdout


def test_each_cpu_builds_its_own_kernels(monkeypatch):
    """The libraries are compiled for the CPU at hand (-march=native): a CPU with other flags
    (another node sharing the home folder) gets its own build folder, never one whose
    instructions it lacks; the same CPU always finds the same folder (clock readings aside)."""
    from wscompress.io import hardware

    here = kernels._build_folder()
    hardware.cpu_flags.cache_clear()  # read the file again: the same folder
    assert here == kernels._build_folder() and not {"MHz", "processor", ":"} & hardware.cpu_flags()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"fpu", "sse2", "avx2"}))
    plain = kernels._build_folder()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}))
    assert len({here, plain, kernels._build_folder()}) == 3


@pytest.mark.skipif(kernels.lowrank() is None, reason="kernels not built here")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_lowrank_kernel_equals_the_two_matmuls(rows, bias):
    """Odd sizes (rank 13, in 70, out 37) exercise the vector loops' tails and the row remainders."""
    from wscompress.model.forms.wscompress_lowrank import LowRankLinear

    torch.manual_seed(rows)
    lin = LowRankLinear(70, 37, 13, bias=bias)
    x = torch.randn(rows, 70)
    ref = lin.coeff(lin.basis(x)).detach()
    with torch.no_grad():
        fused = kernels.low_rank_linear(x, lin.basis.weight, lin.coeff.weight, lin.coeff.bias)
        assert (fused is None) == (rows > DECODE_ROWS)  # decoding runs the kernel, prefill the BLAS
        torch.testing.assert_close(lin(x.view(1, rows, 70)), ref.view(1, rows, 37), rtol=1e-5, atol=1e-5)
    assert kernels.low_rank_linear(x, lin.basis.weight, lin.coeff.weight, lin.coeff.bias) is None  # training: torch
    lin(x).sum().backward()
    assert lin.basis.weight.grad is not None


@pytest.mark.skipif(kernels.lowrank() is None, reason="kernels not built here")
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize("inp", [64, 70, 1152])
def test_half_weights_multiply_into_float32_sums(rows, inp):
    """A float16 weight (HalfLinear) times float32 rows: the product of the float16 values in
    float32, for decoding (up to 8 rows; 70 leaves a tail, 1152 float16 columns are a row of
    more than a page, which skips the prefetches); longer inputs and gradients take the layer's
    torch path."""
    from wscompress.model.forms.wscompress_narrow import HalfLinear

    torch.manual_seed(rows)
    w, bias, x = torch.randn(37, inp), torch.randn(37), torch.randn(rows, inp)
    lin = HalfLinear.from_weight(w, bias)
    exact = F.linear(x, w.half().float(), bias)
    with torch.no_grad():
        y = kernels.half_linear(x, lin.weight16, lin.bias)
        assert (y is None) == (rows > DECODE_ROWS)
        if y is not None:
            torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4)  # sums in another order
        torch.testing.assert_close(lin(x.view(1, rows, inp)), exact.view(1, rows, 37), rtol=1e-4, atol=1e-4)
    assert kernels.half_linear(x.requires_grad_(), lin.weight16, lin.bias) is None  # training: torch
    lin(x).sum().backward()
    assert x.grad is not None and lin.bias.grad is not None


@pytest.mark.skipif(kernels.lowrank() is None, reason="kernels not built here")
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize("inp", [32, 576, 4096])
def test_int8_blocks_multiply_into_float32_sums(rows, inp):
    """Int8 weights with a float16 scale per 32 (Int8Linear) times float32 rows: the product of the
    stored values in float32, for decoding (up to 8 rows; 37 rows leave a remainder of the kernel's
    4-row step; 4096 columns skip the prefetches); longer inputs and gradients take the torch path."""
    from wscompress.model.forms.wscompress_narrow import Int8Linear

    torch.manual_seed(rows)
    w, bias, x = torch.randn(37, inp), torch.randn(37), torch.randn(rows, inp)
    w[3] = 0  # an all-zero row: scale 0, values 0
    lin = Int8Linear.from_weight(w, bias)
    exact = F.linear(x, lin.dense_weight(), bias)
    assert (lin.dense_weight() - w).abs().max() <= w.abs().max() / 254 * 1.01  # half a step of the largest block
    with torch.no_grad():
        y = kernels.int8_linear(x, lin.q, lin.scale16, lin.bias)
        assert (y is None) == (rows > DECODE_ROWS)
        if y is not None:
            torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4)  # sums in another order
        torch.testing.assert_close(lin(x.view(1, rows, inp)), exact.view(1, rows, 37), rtol=1e-4, atol=1e-4)
    assert kernels.int8_linear(x.requires_grad_(), lin.q, lin.scale16, lin.bias) is None  # training: torch
    lin(x).sum().backward()
    assert x.grad is not None and lin.bias.grad is not None


@pytest.mark.skipif(kernels.lut() is None or kernels.lowrank() is None, reason="kernels not built here")
def test_kernels_are_pytorch_operators_with_shape_rules():
    """The kernels are torch.ops.wscompress operators (a compiled graph calls them like aten's):
    opcheck tests the schema, the shape rule torch.compile traces with and the dispatch."""
    lin = layer(8, 4, outliers=5, d=2, inp=64)
    indices, width, sparse, tables, rounded = lin.kernel_layout()
    x = torch.randn(3, 64)
    torch.library.opcheck(torch.ops.wscompress.lut_linear.default,
                          (x, indices, tables.float().contiguous(), width, 4, 48, *sparse))
    torch.library.opcheck(torch.ops.wscompress.lut_dense.default,
                          (indices, tables.float().contiguous(), width, 4, 48, 64, *sparse))
    if kernels.q8(width):
        q8 = torch.ops.wscompress.lut_linear_q8.default
        torch.library.opcheck(q8, (x, indices, *rounded, width, 4, 48, *sparse))
        unscaled, scale = q8(x, indices, *rounded, width, 4, 48, *sparse), torch.rand(48) + 0.5
        for s in (scale, scale.half()):  # the row scales as a layer holds them, applied as each row ends
            torch.library.opcheck(q8, (x, indices, *rounded, width, 4, 48, *sparse, s))
            torch.testing.assert_close(q8(x, indices, *rounded, width, 4, 48, *sparse, s), unscaled * s.float(), rtol=0, atol=0)
    basis, coeff = torch.randn(13, 70), torch.randn(37, 13)
    torch.library.opcheck(torch.ops.wscompress.lowrank_linear.default, (torch.randn(2, 70), basis, coeff, None))
    torch.library.opcheck(torch.ops.wscompress.lowrank_linear.default, (torch.randn(1, 1, 70), basis, coeff, torch.randn(37)))
    torch.library.opcheck(torch.ops.wscompress.half_linear.default, (torch.randn(1, 1, 70), basis.half(), None))
    q, s = torch.randint(-127, 128, (37, 64), dtype=torch.int8), torch.rand(37, 2).half()
    torch.library.opcheck(torch.ops.wscompress.int8_linear.default, (torch.randn(1, 2, 64), q, s, torch.randn(37)))


@pytest.mark.skipif(kernels.lowrank() is None, reason="kernels not built here")
@pytest.mark.parametrize("method", ["svd", "basis_sharing"])
def test_low_rank_model_decodes_like_the_reference_path(tokenizer, monkeypatch, method):
    model = tiny_model("llama")
    wscompress.compress(model, [{"method": method, "ratio": 0.4}], tokenizer, CALIB)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        step = model(input_ids=ids[:, :1] + 1, past_key_values=out.past_key_values).logits
        monkeypatch.setitem(KERNELS, "low_rank", lambda *a, **k: None)
        out = model(input_ids=ids, use_cache=True)
        torch.testing.assert_close(model(input_ids=ids[:, :1] + 1, past_key_values=out.past_key_values).logits, step,
                                   rtol=1e-4, atol=1e-4)



INTERPRETED = """
import copy
import sys
import torch
import torch.nn.functional as F
from test_kernels import layer
from wscompress import kernels
from wscompress.kernels import lut_triton
from wscompress.model.forms import wscompress_palettized
from wscompress.model.forms.wscompress_format import DECODE_ROWS

import triton
import triton.language as tl


@triton.jit
def count(y, n):
    acc = 0.0
    for _ in range(0, n, 4):
        acc += 1.0
    tl.store(y, acc)


try:  # Triton 3.6's interpreter under NumPy 2 cannot run a loop with runtime bounds (Triton 3.9's can)
    count[(1,)](torch.zeros(1), 8)
except Exception as err:
    print(f"skip: Triton {triton.__version__}'s interpreter cannot run runtime-bounded loops ({err!r:.80})")
    sys.exit()
kernels._triton_path = lambda x: True  # route layers to the Triton kernel on CPU tensors
kernels._load_triton = lambda: (lut_triton, "interpreted")
wscompress_palettized.SIX_BIT_PAIRS = ()  # and lay them out as for a GPU
for bits, group_size, outliers, d, scaled in [(4, 1, 0, 1, False), (4, 16, 5, 1, True), (3, 1, 7, 1, False),
                                              (2, 8, 0, 1, False), (5, 1, 3, 1, False), (8, 4, 0, 1, True),
                                              (6, 48, 0, 1, False), (8, 16, 6, 2, True), (6, 8, 0, 2, False),
                                              (8, 48, 4, 4, True)]:  # the shipped recipes: vectors of 2 and 4
    for dtype, tol in [(torch.float32, 1e-4), (torch.float16, 2e-2)]:  # float16: output rounding
        lin = layer(bits, group_size, inp=600, outliers=outliers, d=d, scaled=scaled).to(dtype)
        # the reference from the same values in float32: the layer's own float16 dense weight rounds
        # each codebook value times its row scale, 2^-11 of a weight, and over 600 of them that
        # sometimes passed the tolerance kept for the output's rounding
        exact = copy.deepcopy(lin).float()
        for rows in (1, 3, DECODE_ROWS):
            x = torch.randn(rows, 600).to(dtype)
            ref = F.linear(x.float(), exact.dense_weight(), exact.bias)
            with torch.no_grad():
                assert lin.lut_forward(x) is not None, kernels._gpu_failure  # the kernel ran
                y = lin(x.view(1, rows, 600))
            assert y.dtype == dtype
            torch.testing.assert_close(y.float(), ref.view(1, rows, -1), rtol=tol, atol=tol)
        with torch.no_grad():  # prefill: cuBLAS on the decoded weight
            assert lin.lut_forward(torch.randn(DECODE_ROWS + 1, 600).to(dtype)) is None
print("ok")
"""


def test_triton_lut_kernel_equals_the_reference_path():
    """The CUDA kernel, run by Triton's interpreter on CPU tensors (no GPU here; the
    interpreter must be chosen before Triton loads, hence a fresh process). Widths 4 and 8,
    grouped tables, vectors of 2 and 4 weights (read as one integer: float32 pairs, float16
    pairs and fours; float32 fours by component), row scales, outliers and bias through whole layers, inputs that are not a multiple of
    the block (600), rows that are not a multiple of the row block (48), float32 and float16."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env)
    if run.stdout.startswith("skip: "):
        pytest.skip(run.stdout.strip().removeprefix("skip: "))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_a_triton_kernel_that_fails_hands_over_to_the_torch_path(monkeypatch):
    module = pytest.importorskip("wscompress.kernels.lut_triton")

    def broken(*_args):
        raise RuntimeError("PTX version not supported")

    monkeypatch.setattr(module, "lut_linear", broken)
    monkeypatch.setattr(kernels, "_load_triton", lambda: (module, "lut_triton.py"))
    monkeypatch.setattr(kernels, "_triton_path", lambda x: True)  # as on a GPU
    monkeypatch.setattr(kernels, "_gpu_failure", None)
    lin = layer(4, 1)
    x = torch.randn(2, 72)
    with torch.no_grad(), pytest.warns(UserWarning, match="PTX version"):
        y = lin(x)
    torch.testing.assert_close(y, F.linear(x, lin.dense_weight(), lin.bias))
    assert kernels.lut_gpu() is None and "PTX version" in kernels._gpu_failure


def test_products_kernel_builds_where_the_cpu_has_avx512_bf16():
    from wscompress.io.hardware import cpu_flags

    if (shutil.which("c++") or shutil.which("g++")) and "avx512_bf16" in cpu_flags():
        assert kernels.products() is not None, kernels.calibration_status()
    assert kernels.calibration_status()


@pytest.mark.skipif(kernels.products() is None, reason="no AVX-512 BF16 products here")
@pytest.mark.parametrize("tokens, dx, dy", [(4096, 576, 1536), (513, 77, 13), (7, 40, 33), (1, 8, 8)])
def test_bfloat16_products_equal_the_blas_on_any_shape(monkeypatch, tokens, dx, dy):
    """The kernel's Gram matrix (lower triangle) and cross product equal the BLAS's on the
    batch cast to float32 to float32 rounding, for odd token counts (a half-empty last pair)
    and widths that are no multiple of the 32-column blocks or 8-row tiles."""
    from wscompress.maths import linalg

    gen = torch.Generator().manual_seed(tokens)
    x, y = (torch.randn(tokens, dx, generator=gen) + 0.5).bfloat16(), torch.randn(tokens, dy, generator=gen).bfloat16()
    calls = []
    real = kernels.products()
    monkeypatch.setattr(kernels, "products", lambda: calls.append(1) or real)
    fast = linalg.symmetrize(linalg.add_gram(None, x)), linalg.add_product(None, x, y)
    assert len(calls) == 2  # both ran the kernel
    monkeypatch.setattr(kernels, "products", lambda: None)
    blas = linalg.symmetrize(linalg.add_gram(None, x)), linalg.add_product(None, x, y)
    for a, b, exact in zip(fast, blas, (x.double().T @ x.double(), x.double().T @ y.double())):
        scale = exact.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=4e-6 * scale)
        torch.testing.assert_close(a, exact, rtol=0, atol=4e-6 * scale)


@pytest.mark.skipif(kernels.norms() is None, reason="no AVX-512 BF16 RMSNorm here")
def test_bfloat16_layer_passes_normalise_in_one_pass_as_the_model_does(monkeypatch):
    """Inside ``computing_in(layer, bfloat16)`` a LLaMA RMSNorm runs the kernel: its outputs
    equal the module's own to bfloat16 rounding (the sum of squares' order is all that
    differs), the layer's output stays within bfloat16 noise, gradients take the module's own
    path, and the module has its own forward back after the block."""
    from wscompress.pipeline.layerwise import computing_in

    model = tiny_model("llama")
    layer, norm = model.model.layers[0], model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = 3 * torch.randn(2, 16, model.config.hidden_size)
    calls = []
    real = kernels.norms()
    monkeypatch.setattr(kernels, "norms", lambda: calls.append(1) or real)
    with torch.no_grad(), computing_in(layer, torch.bfloat16):
        own = type(norm).forward(norm, x.bfloat16())
        fused = [norm(x.bfloat16()) for _ in range(2)][1]  # the first call checks the class, the second trusts it
    assert calls and fused.dtype == torch.bfloat16
    assert (fused == own).float().mean() > 0.999
    torch.testing.assert_close(fused.float(), own.float(), rtol=2**-6, atol=0)
    assert "forward" not in norm.__dict__ and not any("forward" in m.__dict__ for m in layer.modules())
    with computing_in(layer, torch.bfloat16):  # with gradients: the module's own graph
        xg = x.bfloat16().requires_grad_()
        norm(xg).float().sum().backward()
    assert xg.grad is not None


@pytest.mark.skipif(kernels.norms() is None, reason="no AVX-512 BF16 RMSNorm here")
def test_an_rmsnorm_of_another_formula_keeps_its_own_forward():
    """Gemma's RMSNorm is named like LLaMA's but scales by ``1 + weight``: the first call's
    comparison catches it and the class runs its own forward from then on."""
    from wscompress.pipeline.layerwise import computing_in

    layer = tiny_model("gemma3").model.layers[0]
    norm = layer.input_layernorm
    x = torch.randn(3, norm.weight.numel()).bfloat16()
    with torch.no_grad(), computing_in(layer, torch.bfloat16):
        outs = [norm(x) for _ in range(2)]
        own = type(norm).forward(norm, x)
    assert kernels._norm_verdicts[type(norm)] is False
    for out in outs:
        assert torch.equal(out, own)
