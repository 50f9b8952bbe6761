"""The CUDA paths, where they differ from the CPU ones: float64 statistics and SVD on the GPU,
mixed-precision fine-tuning, CUDA-event timing, the Triton LUT kernel and the low-rank layers on
a real GPU, and files written from a GPU model. Skipped where no GPU is present (CI)."""

from __future__ import annotations

import copy

import pytest
import torch

from wscompress import compress, kernels, load
from wscompress.io import data, storage
from wscompress.pipeline.calibration import collect_grams
from wscompress.recipe.load import load_recipe
from wscompress.recovery.finetune import finetune

from conftest import WIKI_TRAIN, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
PLAIN = {"sensitivity": "none", "error_feedback": False, "refit": False, "outliers": 0}  # data-free k-means
CALIBRATION = {"dataset": WIKI_TRAIN, "num_samples": 8, "seq_len": 64, "batch_size": 4, "dtype": "float32"}


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x.to(next(model.parameters()).device)).logits.float().cpu()


def test_grams_are_float64_and_equal_the_cpu_ones(tokenizer):
    model = tiny_model("llama")
    batches = data.calibration_batches(tokenizer, WIKI_TRAIN, 4, 64, 2, seed=0)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj"]
    on_cpu = collect_grams(model, batches, names)
    on_gpu = collect_grams(copy.deepcopy(model).to(CUDA), [b.to(CUDA) for b in batches], names)
    for name in names:  # summed in float64 from float32 activations, which GPU and CPU round differently
        assert on_gpu[name].dtype == torch.float64
        scale = on_cpu[name].abs().max().item()
        torch.testing.assert_close(on_gpu[name].cpu(), on_cpu[name].cpu(), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("stage", [
    {"method": "svd", "ratio": 0.4, "whitening": True, "allocation": "uniform"},
    {"method": "svd", "ratio": 0.4, "whitening": True},  # fisher allocation: gradients on the GPU
    {"method": "basis_sharing", "ratio": 0.4, "group_size": 2, "refit": True},
])
def test_calibrated_low_rank_on_the_gpu_equals_the_cpu_result(tokenizer, stage):
    """Whitening (Cholesky), the SVDs and the refit's solves run in float64 on the GPU: the
    compressed model must be the CPU's, up to float32 rounding of the activations."""
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    cpu, gpu = tiny_model("llama"), tiny_model("llama").to(CUDA)
    rows_cpu = compress(cpu, [stage], tokenizer, CALIBRATION)
    rows_gpu = compress(gpu, [stage], tokenizer, CALIBRATION)
    assert rows_gpu[0]["params_after"] == rows_cpu[0]["params_after"] < rows_cpu[0]["params_before"]
    assert all(p.is_cuda for p in gpu.parameters())
    torch.testing.assert_close(logits(gpu, x), logits(cpu, x), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("bits,granularity", [(4, "per_channel"), (3, "per_channel"), (4, "grouped")])
def test_palettized_model_decodes_with_the_triton_kernel(tokenizer, bits, granularity):
    """On a GPU, decoding goes through the Triton LUT kernel (not the weight torch decodes), in
    float16 and float32, and gives the reference path's logits and greedy tokens."""
    from wscompress.model.forms.wscompress_palettized import PalettizedLinear

    model = tiny_model("llama")
    grouped = {"group_size": 16} if granularity == "grouped" else {}
    compress(model, [{"method": "kmeans", "bits": bits, "granularity": granularity, **grouped, **PLAIN}])
    layers = [m for m in model.modules() if isinstance(m, PalettizedLinear)]
    assert layers
    prompt = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(2))
    for dtype, tol in [(torch.float32, 1e-4), (torch.float16, 2e-2)]:
        gpu = copy.deepcopy(model).to(CUDA, dtype)
        x = torch.randn(1, layers[0].in_features, device=CUDA, dtype=dtype)
        with torch.no_grad():
            assert gpu.get_submodule(next(n for n, m in model.named_modules() if m is layers[0])).lut_forward(x) is not None
        assert kernels._gpu_failure is None
        with torch.no_grad():  # the reference: each layer's dense weight, decoded by torch
            reference = copy.deepcopy(gpu)
            for name, m in list(reference.named_modules()):
                if isinstance(m, PalettizedLinear):
                    dense = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=CUDA, dtype=dtype)
                    dense.weight.copy_(m.dense_weight())
                    if m.bias is not None:
                        dense.bias.copy_(m.bias)
                    reference.set_submodule(name, dense)
        torch.testing.assert_close(logits(gpu, prompt[:, :1]), logits(reference, prompt[:, :1]), rtol=tol, atol=tol)
        if dtype == torch.float32:
            assert torch.equal(gpu.generate(prompt.to(CUDA), max_new_tokens=8, do_sample=False),
                               reference.generate(prompt.to(CUDA), max_new_tokens=8, do_sample=False))


def test_low_rank_layers_on_the_gpu_equal_the_cpu(tokenizer):
    model = tiny_model("llama")
    compress(model, [{"method": "basis_sharing", "ratio": 0.3, "group_size": 2, "allocation": "uniform"}], tokenizer, CALIBRATION)
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    gpu = copy.deepcopy(model).to(CUDA)
    torch.testing.assert_close(logits(gpu, x), logits(model, x), rtol=1e-4, atol=1e-4)
    for rows in (1, 8):  # decode-sized inputs too
        torch.testing.assert_close(logits(gpu, x[:1, :rows]), logits(model, x[:1, :rows]), rtol=1e-4, atol=1e-4)


def test_a_model_saved_from_the_gpu_reloads_on_the_cpu(tmp_path, tokenizer):
    model = tiny_model("llama")
    compress(model, [{"method": "basis_sharing", "ratio": 0.3, "group_size": 2, "allocation": "uniform"},
                     {"method": "kmeans", "bits": 4, **PLAIN}], tokenizer, CALIBRATION)
    gpu = model.to(CUDA)
    saved = storage.save(gpu, tokenizer, tmp_path / "model")
    reloaded, _ = load(str(tmp_path / "model"), device="cpu")
    assert saved["params"] == storage.stats(reloaded)["params"]
    assert reloaded.get_input_embeddings().weight.data_ptr() == reloaded.get_output_embeddings().weight.data_ptr()
    x = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(logits(reloaded, x), logits(gpu, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_finetuning_learns_and_keeps_float32_weights(tmp_path, tokenizer, precision):
    text = tmp_path / "train.txt"
    text.write_text(data.load_text(WIKI_TRAIN)[:60_000])
    r = load_recipe(data={"model": {"device": "cuda"}, "finetune": {
        "dataset": str(text), "seq_len": 32, "batch_size": 4, "steps": 12, "lr": 3e-3, "eval_windows": 2,
        "mode": "full", "mixed_precision": precision}, "eval": {"perplexity": [str(text)]}, "output": {"dir": str(tmp_path / "run")}})
    model, result = finetune(tiny_model("llama").to(CUDA), tokenizer, r)
    losses = [h["loss"] for h in result["history"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())


def test_bench_times_with_cuda_events_and_reports_gpu_memory(tmp_path, tiny_dir):
    from wscompress.evaluation import bench

    original = tiny_dir()
    r = load_recipe(data={"model": {"path": str(original), "device": "cuda"}, "output": {"dir": str(tmp_path / "run")},
                          "bench": {"batch_sizes": [1], "seq_lens": [16], "decode_tokens": 2, "warmup": 1, "repeats": 2}})
    model = tiny_model("llama")
    compress(model, [{"method": "svd", "ratio": 0.5, "whitening": False}])
    storage.save(model, None, tmp_path / "run" / "model")
    out = bench.step_bench(r)
    assert out["timing"] == "cuda events"
    rows = {row["measure"]: row for row in out["table"]}
    assert 0 < rows["peak memory MB"]["original"] < 1024  # CUDA allocations of a tiny model, not this process's RSS
    assert rows["decode tok/s b1 s16"]["compressed"] > 0
    graphed = bench.step_bench(r.model_copy(update={"bench": r.bench.model_copy(update={"cuda_graph": True})}))
    assert graphed["timing"] == "cuda events, decode steps replayed as CUDA graphs"
    assert all(row["decode tok/s b1 s16"][m] > 0 for row in [{r["measure"]: r for r in graphed["table"]}]
               for m in ("original", "compressed"))


@pytest.mark.parametrize("width,outliers,d", [(4, 0, 1), (4, 40, 1), (8, 0, 1), (8, 40, 2), (8, 0, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 8])
def test_every_triton_launch_gives_the_reference_product(width, outliers, d, dtype, group):
    """Each blocking, input split and table access the kernel may pick on a GPU (the
    interpreter runs a few), on a 7B-sized down projection's input width, with and without
    outliers folded in, for scalar tables and vectors of 2 and 4 weights (read as one integer
    where they fit one), a table per row or per 8 rows (gathered from by a program's rows), with row scales."""
    from wscompress.kernels import lut_triton
    from wscompress.model.forms.wscompress_palettized import SparseRows

    gen = torch.Generator().manual_seed(6)
    out_f, in_f, levels = 1000, 4096 + 128, 16 if width == 4 else 256
    idx = torch.randint(0, levels, (out_f, in_f // d), generator=gen)
    tables = torch.randn(out_f // group, levels, d, generator=gen).to(dtype)
    weight = tables.float().repeat_interleave(group, 0).gather(1, idx[..., None].expand(-1, -1, d)).flatten(1)
    sparse = None
    if outliers:
        pos = torch.randperm(out_f * in_f, generator=gen)[:outliers * out_f]  # ~1 % of each row
        delta = torch.randn(len(pos), generator=gen)
        weight.view(-1)[pos] += delta
        sparse = SparseRows.from_positions(pos, delta, (out_f, in_f))
        sparse = SparseRows(*(t.to(CUDA) for t in sparse))
    scale = torch.rand(out_f, generator=gen) + 0.5
    packed = (idx[:, 0::2] | idx[:, 1::2] << 4) if width == 4 else idx
    packed = packed.to(torch.uint8).to(CUDA)
    tables = (tables[..., 0] if d == 1 else tables).to(CUDA)
    for rows in (1, 5):
        x = torch.randn(rows, in_f, generator=gen).to(dtype)
        expected = (x.double() @ weight.double().T) * scale.double()
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        for launch in lut_triton.launches(width, tables, group):
            y = lut_triton._run(launch, x.to(CUDA), packed, width, tables, group, out_f, sparse, scale.to(CUDA, dtype))
            torch.testing.assert_close(y.cpu().double(), expected, rtol=tol, atol=tol * 10, msg=str(launch))


@pytest.mark.parametrize("outliers", [0, 0.01])
def test_cuda_graph_decoding_replays_the_eager_tokens(outliers):
    """The captured decode step (bench's cuda_graph) decodes what the same steps do eagerly,
    for a dense and a palettized model (Triton kernel, outliers folded in), in float16."""
    from wscompress.evaluation.decode import StaticDecoder

    model = tiny_model("llama")
    compress(model, [{"method": "kmeans", "bits": 4, **PLAIN, "outliers": outliers}])
    model = model.to(CUDA, torch.float16)
    prompt = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(7)).to(CUDA)
    with torch.no_grad():
        eager = StaticDecoder(model, prompt, max_new_tokens=8)
        graph = StaticDecoder(model, prompt, max_new_tokens=8, graph=True)
        assert graph.graph is not None
        for _ in range(8):
            assert torch.equal(graph.step(), eager.step())
