"""A compressed form and a method that changes layers' shapes, added as a new one is: each form a
class (here in this file; in the package, a file of model/forms/), each method a config
and an ``apply`` (here too; in the package, a file in methods/), registered for the test, run,
loaded back through ``check_three_loads`` and unregistered after. Nothing else names them: loading
reads what a form declares from its class (constructor arguments from its type hints, its value
checks, the children a later stage may target), and a form that changes a layer's shape keeps the
dense shape of the module it replaces (the base architecture is rebuilt from one config) while its
own arguments carry the per-layer sizes. ``Int8RowsLinear`` and ``PrunedLinear`` are not in a
travelling file, so their folders load in-process only; ``Q4BlocksLinear`` is a file of its own
beside the format's, so its folders carry it (docs/architecture.md)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors.torch import load_file, save_file
from torch import nn

import wscompress
from wscompress.errors import UsageError
from wscompress.evaluation.bench import kernel_path
from wscompress.io import storage
from wscompress.methods import METHODS, register
from wscompress.model.arch import discover, get_module, replace_everywhere, set_module, target_layers
from wscompress.model.forms.wscompress_format import LAYERS, CompressedLinear, corrupt, register_layer, weight_of
from wscompress.recipe.load import load_recipe
from wscompress.recipe.schema import StageConfig, TargetedStage
from wscompress.workflow import check_structure

from conftest import tiny_model
from test_transformers import CALIBRATION, check_three_loads, logits_of, remote  # noqa: F401  (remote: a fixture)


class Int8RowsLinear(CompressedLinear):
    """W = q * scale[:, None]: int8 weights and a float16 scale per row."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("q", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight().to(x.dtype), self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]  # exact in float32: 8 significant bits times 11

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None}


class PrunedLinear(CompressedLinear):
    """The (out, in) linear it replaces with only ``kept`` of its output rows (``along="out"``) or
    input columns (``"in"``) left, in ``inner``, at the positions ``index``; the others are zero.
    It keeps the dense shape, so the base model's code around it runs as before."""

    CHILDREN = ("inner",)

    def __init__(self, in_features: int, out_features: int, kept: int, along: Literal["out", "in"]):
        super().__init__()
        self.in_features, self.out_features, self.kept, self.along = in_features, out_features, kept, along
        self.inner = nn.Linear(in_features, kept, bias=False) if along == "out" else nn.Linear(kept, out_features, bias=False)
        self.register_buffer("index", torch.empty(kept, dtype=torch.int64))
        self.bias = None

    @classmethod
    def keeping(cls, dense: nn.Module, index: torch.Tensor, along: Literal["out", "in"]) -> PrunedLinear:
        w = weight_of(dense)
        layer = cls(w.shape[1], w.shape[0], len(index), along).to(w.device, w.dtype)
        layer.inner.weight.data.copy_(w.index_select(0 if along == "out" else 1, index))
        layer.index = index.clone()
        return layer

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        full = spec["out_features"] if spec["along"] == "out" else spec["in_features"]
        if not 1 <= spec["kept"] <= full:
            return f"kept={spec['kept']} is outside 1..{full}"
        return super().check_spec(**spec)

    def check_values(self, where: str) -> None:
        full, index = self.out_features if self.along == "out" else self.in_features, self.index
        if not index.is_meta and (int(index.min()) < 0 or int(index.max()) >= full or not bool((index.diff() > 0).all())):
            raise corrupt(f"{where}.index is not increasing positions in 0..{full - 1}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.along == "in":
            return self.inner(x.index_select(-1, self.index))
        y = self.inner(x)
        return y.new_zeros(*y.shape[:-1], self.out_features).index_copy(-1, self.index, y)

    def dense_weight(self) -> torch.Tensor:
        w = weight_of(self.inner)  # ``inner`` may be compressed in turn
        return w.new_zeros(self.out_features, self.in_features).index_copy(0 if self.along == "out" else 1, self.index, w)

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "kept": self.kept, "along": self.along}


class Int8RowsConfig(TargetedStage):
    method: Literal["int8_rows"] = "int8_rows"

    def check(self, model: nn.Module) -> None:
        target_layers(model, self)


@torch.no_grad()
def int8_rows(model: nn.Module, cfg: Int8RowsConfig, ctx) -> dict:
    layers = target_layers(model, cfg)
    for module in layers.values():
        w = weight_of(module)
        layer = Int8RowsLinear(w.shape[1], w.shape[0], module.bias is not None).to(w.device)
        layer.scale = (w.abs().amax(1) / 127).clamp_min(2**-14).half()  # a row of zeros: any scale, not 0
        layer.q = (w / layer.scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        if module.bias is not None:
            layer.bias = nn.Parameter(module.bias.detach().clone())
        replace_everywhere(model, module, layer)
    return {"layers": len(layers)}


class PruneFFNConfig(StageConfig):
    method: Literal["prune_ffn"] = "prune_ffn"
    first: float = Field(0.9, gt=0, le=1, description="fraction of FFN neurons kept at the first decoder layer")
    last: float = Field(0.6, gt=0, le=1, description="at the last, the layers between linearly in between")

    def check(self, model: nn.Module) -> None:
        if not {"gate", "up", "down"} <= set(discover(model).roles()):
            raise UsageError("prune_ffn: the model's FFN has no gate, up and down projections", "use a LLaMA-like model")


@torch.no_grad()
def prune_ffn(model: nn.Module, cfg: PruneFFNConfig, ctx) -> dict:
    """Keep the neurons whose weights are largest (gate and up rows, down column)."""
    arch, kept = discover(model), []
    for i in range(arch.num_layers):
        names = arch.projections(i)
        gate, up, down = (get_module(model, names[role]) for role in ("gate", "up", "down"))
        fraction = cfg.first + (cfg.last - cfg.first) * i / max(arch.num_layers - 1, 1)
        score = weight_of(gate).norm(dim=1) * weight_of(up).norm(dim=1) * weight_of(down).norm(dim=0)
        index = score.topk(round(fraction * len(score))).indices.sort().values
        for role, module in (("gate", gate), ("up", up), ("down", down)):
            set_module(model, names[role], PrunedLinear.keeping(module, index, "in" if role == "down" else "out"))
        kept.append(len(index))
    return {"kept": kept}


@pytest.fixture
def registered():
    """Both forms and both methods, registered for one test and unregistered after it."""
    for form in (Int8RowsLinear, PrunedLinear):
        register_layer(form)
    register(Int8RowsConfig)(int8_rows)
    register(PruneFFNConfig)(prune_ffn)
    yield
    for form in (Int8RowsLinear, PrunedLinear):
        del LAYERS[form.__name__]
    for method in ("int8_rows", "prune_ffn"):
        del METHODS[method]


def test_a_form_added_from_outside_loads_back(registered, tokenizer, tmp_path, remote):
    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "int8_rows"}], tokenizer, CALIBRATION)
    layer, dense = model.model.layers[0].mlp.down_proj, tiny_model("llama").model.layers[0].mlp.down_proj.weight
    assert isinstance(layer, Int8RowsLinear) and sum(isinstance(m, Int8RowsLinear) for m in model.modules()) == 4 * 7
    assert ((layer.dense_weight() - dense).abs() <= layer.scale.float()[:, None] / 2 + 1e-7).all()  # rounding only
    storage.save(model, tokenizer, tmp_path / "int8_rows")
    check_three_loads(tmp_path / "int8_rows", logits_of(model), remote)


# A form that travels: a file of its own beside the format's (here in a temporary folder on the
# forms package's path; in the package, a file in model/forms/), importing the format relatively
Q4_BLOCKS = '''"""Q4_0-like blocks: each run of 32 weights of a row as int4 values times one float16 scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .wscompress_format import CompressedLinear, register_layer


@register_layer
class Q4BlocksLinear(CompressedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("nibbles", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scale_bits", torch.empty(out_features, in_features // 32, dtype=torch.int16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def check_spec(cls, **spec) -> str | None:
        return f"in_features={spec['in_features']} is no multiple of 32" if spec["in_features"] % 32 else None

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None) -> Q4BlocksLinear:
        layer = cls(w.shape[1], w.shape[0], bias is not None)
        blocks = w.detach().float().unflatten(1, (-1, 32))
        scale = (blocks.abs().amax(-1) / 7).clamp_min(2**-14).half()
        q = (blocks / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int64).flatten(1) + 8
        layer.nibbles, layer.scale_bits = (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8), scale.view(torch.int16)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone())
        return layer.to(w.device)

    def dense_weight(self) -> torch.Tensor:
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).flatten(1).float() - 8
        return (q.unflatten(1, (-1, 32)) * self.scale_bits.view(torch.float16).float()[..., None]).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None}
'''


class Q4BlocksConfig(TargetedStage):
    method: Literal["q4_blocks"] = "q4_blocks"

    def check(self, model: nn.Module) -> None:
        target_layers(model, self)


def test_a_form_in_a_file_of_its_own_travels_with_its_folders(tokenizer, tmp_path, remote):
    """A new form is its own file beside the format's and one method: nothing else names it, and
    its folders carry its file, so they load the three ways, trust_remote_code without wscompress too."""
    import importlib
    import sys

    from wscompress.model import forms

    (tmp_path / "forms").mkdir()
    (tmp_path / "forms" / "wscompress_q4blocks.py").write_text(Q4_BLOCKS)
    forms.__path__.append(str(tmp_path / "forms"))
    try:
        form = importlib.import_module("wscompress.model.forms.wscompress_q4blocks").Q4BlocksLinear

        @torch.no_grad()
        def q4_blocks(model: nn.Module, cfg: Q4BlocksConfig, ctx) -> dict:
            for module in target_layers(model, cfg).values():
                replace_everywhere(model, module, form.from_weight(weight_of(module), module.bias))
            return {}

        register(Q4BlocksConfig)(q4_blocks)
        model = tiny_model("llama")
        wscompress.compress(model, [{"method": "q4_blocks"}, {"method": "int8"}], tokenizer, CALIBRATION)
        assert sum(isinstance(m, form) for m in model.modules()) == 4 * 7
        storage.save(model, tokenizer, tmp_path / "q4")
        assert (tmp_path / "q4" / "wscompress_q4blocks.py").read_text() == Q4_BLOCKS
        assert "Q4BlocksLinear: torch (28 layers)" in kernel_path(model)  # a form without a kernel says so
        check_three_loads(tmp_path / "q4", logits_of(model), remote)
    finally:
        forms.__path__.remove(str(tmp_path / "forms"))
        LAYERS.pop("Q4BlocksLinear", None)
        METHODS.pop("q4_blocks", None)
        sys.modules.pop("wscompress.model.forms.wscompress_q4blocks", None)


def test_a_method_with_per_layer_shapes_loads_back_and_exports_dense(registered, tokenizer, tmp_path, remote):
    stages = [{"method": "prune_ffn", "first": 0.9, "last": 0.6},
              {"method": "kmeans", "bits": 4, "targets": [r"mlp\.(gate|up)_proj\.inner$"]}]
    recipe = load_recipe(data={"compress": stages})  # the later stage names a child PrunedLinear declares:
    check_structure(tiny_model("llama"), recipe, recipe.compress, None, {"compress"})  # the check before any work knows it
    model = tiny_model("llama")
    wscompress.compress(model, stages, tokenizer, CALIBRATION)
    kept = [layer.mlp.down_proj.kept for layer in model.model.layers]
    assert kept == [115, 102, 90, 77]  # of 128 neurons: 0.9, 0.8, 0.7, 0.6
    folder = tmp_path / "prune_ffn"
    storage.save(model, tokenizer, folder)
    check_three_loads(folder, logits_of(model), remote)
    # one base config (intermediate_size 128 everywhere); each layer's size is its form's own argument
    config = json.loads((folder / "config.json").read_text())
    modules = config["compression"]["modules"]
    assert config["base_config"]["intermediate_size"] == 128
    assert [modules[f"model.layers.{i}.mlp.down_proj"]["spec"]["kept"] for i in range(4)] == kept
    assert modules["model.layers.3.mlp.up_proj.inner"]["type"] == "PalettizedLinear"
    # exported dense: the base architecture, the pruned neurons zero, the same function
    storage.export_dense(model, tokenizer, tmp_path / "dense")
    from transformers import LlamaForCausalLM

    torch.testing.assert_close(logits_of(LlamaForCausalLM.from_pretrained(tmp_path / "dense")), logits_of(model))
    # the form's value check runs on loading: an index past the layer is refused, naming it
    tensors = load_file(folder / storage.WEIGHTS)
    tensors["model.layers.0.mlp.down_proj.index"][-1] = 128
    save_file(tensors, folder / storage.WEIGHTS, {"format": "pt"})
    with pytest.raises(UsageError, match=r"model.layers.0.mlp.down_proj.index is not increasing positions in 0..127"):
        wscompress.load(folder, device="cpu")
