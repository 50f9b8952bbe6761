"""Compressed folders outside wscompress: stock transformers loads them (``import wscompress``),
a Python without wscompress loads them (``trust_remote_code``), and no stock load ever gives
random weights in their place. Every compressed form is loaded three ways and gives the same
logits as the model that was saved: ``check_three_loads`` checks one folder, and each form of
``FORMS`` is compressed when a test first asks for it, so ``-k FORM`` checks that form alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import wscompress
from wscompress.io import storage
from wscompress.model.forms import wscompress_format
from wscompress.model.forms.wscompress_format import CompressedLayer

from conftest import REPO, kernel_tolerance, tiny_model

CALIBRATION = {"dataset": "pydoc", "num_samples": 8, "seq_len": 64, "batch_size": 4}
# every compressed form: (tiny model, stages); a new form adds its line
FORMS = {
    "low_rank": ("llama", [{"method": "svd", "ratio": 0.3}]),
    "shared_bases": ("llama", [{"method": "basis_sharing", "ratio": 0.3}]),
    "palettized_scalar": ("llama", [{"method": "kmeans", "bits": 4}]),
    "palettized_vector": ("llama", [{"method": "kmeans", "bits": 4, "cluster_dim": 2, "granularity": "per_tensor"}]),
    "palettized_grouped": ("llama", [{"method": "kmeans", "bits": 3, "granularity": "grouped", "group_size": 16}]),
    "palettized_outliers": ("llama", [{"method": "kmeans", "bits": 2, "outliers": 0.02}]),
    "palettized_row_scales": ("llama", [{"method": "kmeans", "bits": 4, "cluster_dim": 2, "granularity": "grouped",
                                         "group_size": 16, "row_scale": True, "outliers": 0.01}]),
    "palettized_huffman": ("llama", [{"method": "kmeans", "bits": 4, "entropy_coding": True}]),
    "palettized_embeddings": ("llama", [{"method": "kmeans", "bits": 4, "targets": ["lm_head"], "outliers": 0.01}]),  # tied: one table
    "int8_embeddings": ("llama", [{"method": "kmeans", "bits": 4}, {"method": "int8"}]),  # the shipped recipes' head
    "soft_share_deltas": ("llama", [{"method": "soft_share", "window": 2, "rank": 4, "starts": [1]}]),
    "cross_layer": ("llama", [{"method": "cross_layer", "what": "ffn", "group_size": 2}]),
    "merged_layers": ("llama", [{"method": "merge", "n": 2}]),
    "dropped_layers": ("llama", [{"method": "merge_drop", "n": 2}]),
    "gqa": ("llama_mha", [{"method": "gqa", "groups": 2}]),
    "factorized_embeddings": ("llama", [{"method": "factorize_embeddings", "rank": 16}]),
    "tied_embeddings": ("llama_mha", [{"method": "tie_embeddings"}]),
    "basis_sharing_then_kmeans": ("llama", [{"method": "basis_sharing", "ratio": 0.3}, {"method": "kmeans", "bits": 4}]),
    "rotated_palettized": ("llama", [{"method": "rotate", "block": 32}, {"method": "kmeans", "bits": 3}]),
    "rotated_trellis": ("llama", [{"method": "rotate", "block": 32}, {"method": "trellis", "bits": 2, "state_bits": 8}]),
    "gpt2_low_rank_palettized": ("gpt2", [{"method": "svd", "ratio": 0.3}, {"method": "kmeans", "bits": 4, "outliers": 0.01}]),
}
STRUCTURAL = ("cross_layer", "merged_layers", "dropped_layers", "gqa", "tied_embeddings")  # no compressed layer type
INPUT = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))

# Runs in a fresh interpreter where importing wscompress fails, as in a virtual environment
# that has only torch, transformers and safetensors: each folder loads through the code it carries.
WITHOUT_WSCOMPRESS = textwrap.dedent("""
    import importlib.abc, importlib.util, json, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.partition(".")[0] == "wscompress":
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NotInstalled())
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folders, ids, out = json.loads(sys.argv[1]), load_file(sys.argv[2])["ids"], sys.argv[3]
    logits = {}
    for name, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        with torch.no_grad():
            logits[name] = model(ids).logits.contiguous()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    try:
        importlib.util.find_spec("wscompress")
        raise SystemExit("wscompress was importable")
    except ModuleNotFoundError:
        pass
    assert not [m for m in sys.modules if m.partition(".")[0] == "wscompress"]
    save_file(logits, out)
""")


# The same Python, kept running: it loads each folder named on a line of its stdin and answers
# with one line, "@logits FILE" or "@error ..." (transformers may print lines of its own)
SERVE = WITHOUT_WSCOMPRESS.split("folders, ids, out")[0] + textwrap.dedent("""
    import os, traceback

    ids = load_file(sys.argv[1])["ids"]
    for n, line in enumerate(sys.stdin):
        try:
            model = AutoModelForCausalLM.from_pretrained(json.loads(line), trust_remote_code=True)
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            assert not [m for m in sys.modules if m.partition(".")[0] == "wscompress"]
            with torch.no_grad():
                save_file({"logits": model(ids).logits.contiguous()}, f"{n}.safetensors")
            print("@logits", os.path.abspath(f"{n}.safetensors"), flush=True)
        except Exception:  # noqa: BLE001 - the test that sent the folder reports it
            print("@error", traceback.format_exc().replace("\\n", " | "), flush=True)
""")


def bare_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a Python without wscompress: no PYTHONPATH, its own remote-code cache, offline."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1")
    return env


def run_without_wscompress(script: str, *args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, env=bare_environment(tmp_path),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT).logits


class RemoteLoads:
    """Loads through ``trust_remote_code`` in a Python where wscompress cannot be imported
    (``SERVE``), started on the first folder and kept: its start (seconds) is paid once, however
    many forms the tests check."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.process = tmp, None

    def logits(self, folder: Path) -> torch.Tensor:
        if self.process is None:
            save_file({"ids": INPUT}, self.tmp / "ids.safetensors")
            self.stderr = open(self.tmp / "stderr.txt", "w")  # a file: a full pipe would stall it
            self.process = subprocess.Popen([sys.executable, "-c", SERVE, str(self.tmp / "ids.safetensors")],
                                            cwd=self.tmp, env=bare_environment(self.tmp), stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.process.stdin.write(json.dumps(str(folder)) + "\n")
        self.process.stdin.flush()
        watchdog = threading.Timer(600, self.process.kill)  # a hung load ends the process, and so this read
        watchdog.start()
        answer = next((line for line in self.process.stdout if line.startswith("@")), "@ended")
        watchdog.cancel()
        kind, _, rest = answer.strip().partition(" ")
        assert kind == "@logits", f"{folder}: {rest or 'the process ended'}\n{(self.tmp / 'stderr.txt').read_text()[-3000:]}"
        return load_file(rest)["logits"]

    def close(self) -> None:
        if self.process is not None:  # every answer is in: its orderly exit (torch's, seconds) adds nothing
            self.process.kill()
            self.process.wait()
            self.stderr.close()


class Folders(dict):
    """form -> (folder, the saved model's logits), each form of ``FORMS`` compressed and saved
    when a test first asks for it."""

    def __init__(self, root: Path, tokenizer) -> None:
        super().__init__()
        self.root, self.tokenizer = root, tokenizer

    def __missing__(self, form: str) -> tuple[Path, torch.Tensor]:
        kind, stages = FORMS[form]
        model = tiny_model(kind)
        wscompress.compress(model, stages, self.tokenizer, CALIBRATION)
        storage.save(model, self.tokenizer, self.root / form)
        self[form] = self.root / form, logits_of(model)
        return self[form]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer) -> Folders:
    return Folders(tmp_path_factory.mktemp("forms"), tokenizer)


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    loads = RemoteLoads(tmp_path_factory.mktemp("remote"))
    yield loads
    loads.close()


def check_three_loads(folder: Path, saved: torch.Tensor, remote: RemoteLoads) -> torch.nn.Module:
    """``folder`` loads through ``wscompress.load``, through ``from_pretrained`` after ``import
    wscompress`` and, where its layers' classes are those of the travelling file, through
    ``trust_remote_code`` without wscompress, each to the ``saved`` logits; the two in-process
    loads hold the same tensors and sharing (nothing dense built), each compressed layer the
    children its class declares. A form defined elsewhere (a test's) does not travel: there
    trust_remote_code refuses the folder, naming the type (test_crafted_folders). Returns the
    ``from_pretrained`` model."""
    from transformers import AutoModelForCausalLM

    ours, _ = wscompress.load(folder, device="cpu")
    stock = AutoModelForCausalLM.from_pretrained(folder)
    assert type(stock).__mro__[1] is wscompress_format.WSCompressForCausalLM
    for got in (logits_of(ours), logits_of(stock)):
        torch.testing.assert_close(got, saved, rtol=1e-5, atol=1e-5)
    layers = [m for m in stock.modules() if isinstance(m, CompressedLayer)]
    if all(wscompress_format.travels(type(m)) for m in layers):  # no kernels there
        torch.testing.assert_close(remote.logits(folder), saved, rtol=1e-5, atol=kernel_tolerance(stock))
    assert storage.stats(stock) == storage.stats(ours)
    assert wscompress_format.module_aliases(stock) == wscompress_format.module_aliases(ours)
    for layer in layers:
        assert {n for n, _ in layer.named_children()} == set(type(layer).CHILDREN), type(layer).__name__
    return stock


@pytest.mark.parametrize("form", sorted(FORMS))
def test_three_loads_give_the_saved_logits(form, folders, remote):
    stock = check_three_loads(*folders[form], remote)
    assert any(isinstance(m, CompressedLayer) for m in stock.modules()) or form in STRUCTURAL


def test_folder_holds_the_compressed_weights_and_its_code(folders):
    folder, _ = folders["basis_sharing_then_kmeans"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "wscompress" and config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_wscompress.")
    assert config["base_config"]["model_type"] == "llama"
    keys = load_file(folder / storage.WEIGHTS).keys()
    assert not any(k.endswith("q_proj.weight") for k in keys)  # no dense projection in the file
    assert sum(k.endswith("q_proj.basis.codebook") for k in keys) == 2  # 4 layers in groups of 2: each basis once


TRAVELLING = sorted(p.name for p in (REPO / "wscompress" / "model" / "forms").glob("wscompress_*.py"))


def test_a_folder_carries_the_files_of_the_forms_it_uses(folders):
    """A folder holds the format's file, the file of each family of forms its layers use (byte for
    byte the package's) and none other, and the entry file importing them relatively, as
    transformers' remote code needs to copy them beside it."""
    from transformers.dynamic_module_utils import get_relative_import_files

    for form, families in (("basis_sharing_then_kmeans", {"lowrank", "palettized"}), ("int8_embeddings",
                           {"palettized", "narrow", "embeddings"}), ("cross_layer", set())):
        folder = folders[form][0]
        carried = {p.name for p in folder.glob("*.py")}
        assert carried == {"modeling_wscompress.py", "wscompress_format.py", *(f"wscompress_{f}.py" for f in families)}
        for name in carried - {"modeling_wscompress.py"}:
            assert (folder / name).read_bytes() == (REPO / "wscompress" / "model" / "forms" / name).read_bytes(), name
        imported = {Path(f).name for f in get_relative_import_files(folder / "modeling_wscompress.py")}
        assert imported == carried - {"modeling_wscompress.py"}


@pytest.mark.parametrize("name", TRAVELLING)
def test_the_travelling_code_imports_nothing_of_wscompress(name):
    """transformers checks a remote module's imports before running it: only torch, transformers, numpy."""
    from transformers.dynamic_module_utils import get_imports

    packages = set(get_imports(REPO / "wscompress" / "model" / "forms" / name)) - set(sys.stdlib_module_names)
    assert packages <= {"torch", "transformers", "numpy"} and "torch" in packages


def test_kernels_are_in_use_after_import(folders):
    from transformers import AutoModelForCausalLM

    from wscompress import kernels

    assert wscompress_format.KERNELS["palettized"] is kernels.palettized_linear
    stock = AutoModelForCausalLM.from_pretrained(folders["palettized_scalar"][0])
    layer = stock.model.layers[0].mlp.down_proj
    if kernels.lut() is None:
        pytest.skip(f"no compiled LUT kernel here: {kernels.status()}")
    with torch.no_grad():
        assert layer.lut_forward(torch.randn(1, layer.in_features)) is not None


def test_dtype_device_map_generate_and_pipeline(folders, tokenizer):
    from transformers import AutoModelForCausalLM, pipeline

    folder, _ = folders["basis_sharing_then_kmeans"]
    half, _ = wscompress.load(folder, dtype=torch.bfloat16, device="cpu")
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    coeff = stock.model.layers[0].mlp.down_proj.coeff
    assert coeff.codebook.dtype == torch.float16 and coeff.dtype_probe.dtype == torch.bfloat16  # held as stored
    assert stock.dtype == half.dtype == torch.bfloat16  # the first floating parameter's: not a codebook's
    assert stock.model.layers[0].mlp.down_proj.coeff.indices.dtype == torch.uint8
    torch.testing.assert_close(logits_of(stock), logits_of(half))

    placed = AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    torch.testing.assert_close(logits_of(placed), folders["basis_sharing_then_kmeans"][1], rtol=1e-5, atol=1e-5)

    ours, _ = wscompress.load(folder, device="cpu")
    prompt = INPUT[:1, :5]
    want = ours.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(placed.generate(prompt, max_new_tokens=8, do_sample=False), want)
    generator = pipeline("text-generation", model=str(folder))
    text = generator("def f(x):", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    assert text == tokenizer.decode(ours.generate(ids, max_new_tokens=8, do_sample=False)[0], skip_special_tokens=True)


def test_save_pretrained_round_trip_keeps_the_compression(folders, tmp_path):
    from transformers import AutoModelForCausalLM

    for form in ("basis_sharing_then_kmeans", "palettized_huffman", "cross_layer", "factorized_embeddings"):
        folder, saved = folders[form]
        stock = AutoModelForCausalLM.from_pretrained(folder)
        stock.save_pretrained(tmp_path / form)
        again = AutoModelForCausalLM.from_pretrained(tmp_path / form)
        torch.testing.assert_close(logits_of(again), saved, rtol=1e-5, atol=1e-5)
        assert (tmp_path / form / "modeling_wscompress.py").is_file()
        assert storage.file_size(tmp_path / form) <= 1.05 * storage.file_size(folder)  # still the compressed size
        reread, _ = wscompress.load(tmp_path / form, device="cpu")
        torch.testing.assert_close(logits_of(reread), saved, rtol=1e-5, atol=1e-5)


def test_a_model_compressed_in_memory_saves_as_a_compressed_folder(tmp_path, tokenizer):
    """``wscompress.compress`` makes the model a compressed-model class: transformers' own
    ``save_pretrained`` then writes a folder that loads back (not a base config over compressed weights)."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    wscompress.compress(model, [{"method": "svd", "ratio": 0.3}, {"method": "kmeans", "bits": 4}], tokenizer, CALIBRATION)
    assert isinstance(model, wscompress_format.WSCompressForCausalLM) and model.config.model_type == "wscompress"
    model.save_pretrained(tmp_path / "m")
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "m")), logits_of(model))


def test_peft_lora_on_compressed_layers(folders, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    folder, saved = folders["basis_sharing_then_kmeans"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    torch.testing.assert_close(logits_of(model), saved, rtol=1e-5, atol=1e-5)  # LoRA starts at zero
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # codebooks and bases stay frozen
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = model(INPUT, labels=INPUT).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tuned = logits_of(model)
    assert not torch.allclose(tuned, saved)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter")
    torch.testing.assert_close(logits_of(reloaded), tuned, rtol=1e-5, atol=1e-5)


def test_stock_loads_never_give_random_weights(folders, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    folder, _ = folders["low_rank"]
    # a stock class named directly: the weights are a variant only wscompress's classes ask for
    with pytest.raises(OSError, match="no file named model.safetensors"):
        LlamaForCausalLM.from_pretrained(folder)
    # a Python without wscompress and without trust_remote_code: transformers refuses the unknown type
    script = WITHOUT_WSCOMPRESS.split("import torch")[0] + textwrap.dedent("""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained(sys.argv[1])
        except ValueError as err:
            print("refused:", err)
        else:
            raise SystemExit("loaded")
    """)
    done = run_without_wscompress(script, str(folder), tmp_path=tmp_path)
    assert done.returncode == 0 and "trust_remote_code=True" in done.stdout, done.stdout + done.stderr[-2000:]
    # weight files that do not match config.json: an error, not random weights
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / storage.WEIGHTS)
    del tensors[next(k for k in tensors if k.endswith("coeff.weight"))]
    save_file(tensors, broken / storage.WEIGHTS, {"format": "pt"})
    with pytest.raises(ValueError, match="damaged"):
        AutoModelForCausalLM.from_pretrained(broken)
    # a layer type this code does not know (a newer wscompress wrote it): an error naming the fix
    config = json.loads((broken / "config.json").read_text())
    next(iter(config["compression"]["modules"].values()))["type"] = "FutureLinear"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="newer wscompress"):
        AutoModelForCausalLM.from_pretrained(broken)


# Tools that read a folder's config.json or card with stock classes, in a Python without wscompress
# (AutoConfig without trust_remote_code asks on stdin whether to run the folder's code: the test
# answers with an empty stdin, as a batch job does)
READERS = WITHOUT_WSCOMPRESS.split("import torch")[0] + textwrap.dedent("""
    from huggingface_hub import ModelCard
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM, PretrainedConfig

    folder = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print("@tokenizer:", tokenizer.decode(tokenizer("def f(x):").input_ids))
    plain = PretrainedConfig.from_pretrained(folder)
    print("@plain config:", plain.model_type, plain.dtype)
    try:
        AutoConfig.from_pretrained(folder)
    except ValueError as err:
        print("@AutoConfig refused:", "trust_remote_code=True" in str(err))
    remote = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    print("@remote config:", remote.base_model_type, remote.hidden_size, remote.dtype, bool(remote.compression["modules"]))
    card = ModelCard.load(folder + "/README.md")
    print("@card:", card.data.library_name, card.data.tags)
    try:
        LlamaForCausalLM.from_pretrained(folder)
    except OSError as err:
        print("@stock class refused:", "model.safetensors" in str(err))
    else:
        raise SystemExit("a stock class loaded the folder")
""")


def test_readers_of_config_json_work_without_wscompress(tmp_path, tiny_dir):
    """config.json is a valid config for tools that only read it (AutoTokenizer's probe, hub
    tooling), with wscompress absent, while a stock model class still refuses the folder; the
    card loads as a hub card. It records which wscompress and transformers wrote it."""
    import transformers
    import yaml
    from typer.testing import CliRunner

    from wscompress.cli import app

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_dir("llama"))}, "output": {"dir": str(tmp_path / "out")},
        "compress": [{"method": "kmeans", "bits": 4, "outliers": 0.01}],
        "calibration": {"dataset": "pydoc", "num_samples": 4, "seq_len": 32, "batch_size": 2}}))
    assert CliRunner().invoke(app, ["compress", str(recipe), "-q"]).exit_code == 0
    folder = tmp_path / "out" / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == config["base_config"]["dtype"] == "float32"
    assert config["wscompress_version"] == wscompress.__version__ and config["transformers_version"] == transformers.__version__
    done = run_without_wscompress(READERS, str(folder), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = dict(re.findall(r"@([^:]+): (.*)", done.stdout))  # transformers' trust_remote_code prompt shares stdout
    assert lines["tokenizer"] == "def f(x):"
    assert lines["plain config"] == "wscompress torch.float32"
    assert lines["AutoConfig refused"] == "True"
    assert lines["remote config"] == "llama 64 torch.float32 True"
    assert lines["card"] == "transformers ['wscompress', 'kmeans']"
    assert lines["stock class refused"] == "True"


def test_folders_of_format_2_still_load(folders, tmp_path):
    """A folder written before the weights became a variant (format 2: model.safetensors, a
    sentence in config.json's dtype, a GGUF source's quantization_config kept) loads as before,
    and re-saving it writes the current format."""
    from transformers import AutoModelForCausalLM

    folder, saved = folders["palettized_huffman"]
    old = tmp_path / "old"
    old.mkdir()
    for f in folder.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    (old / storage.WEIGHTS).rename(old / "model.safetensors")
    config = json.loads((old / "config.json").read_text())
    sentence = "a wscompress-compressed model: load it with ..."
    config.update(dtype=sentence, torch_dtype="float32")
    config["base_config"].update(dtype=sentence, quantization_config={"quant_method": "gguf"})
    config["compression"]["version"] = 2
    (old / "config.json").write_text(json.dumps(config))
    for model in (AutoModelForCausalLM.from_pretrained(old), wscompress.load(old, device="cpu")[0]):
        torch.testing.assert_close(logits_of(model), saved, rtol=1e-5, atol=1e-5)
        assert getattr(model, "hf_quantizer", None) is None and model.config.dtype == torch.float32
    AutoModelForCausalLM.from_pretrained(old).save_pretrained(tmp_path / "new")
    assert (tmp_path / "new" / storage.WEIGHTS).is_file()
    assert "quantization_config" not in json.loads((tmp_path / "new" / "config.json").read_text())["base_config"]
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "new")), saved, rtol=1e-5, atol=1e-5)


# The optional extras (pyproject.toml) a user who only loads folders does not install, by the
# names of their site-packages entries (modules, their .libs, their dist-info)
EXTRAS = ("scipy", "datasets", "lm_eval", "peft", "matplotlib", "mpl_toolkits", "rouge_score", "gguf", "sklearn",
          "scikit_learn")

# Runs in an interpreter whose site-packages lack the extras: wscompress loads folders there
# (both ways), and a step that needs an extra says which to install
WITHOUT_EXTRAS = textwrap.dedent("""
    import importlib.util, json, sys

    extras = json.loads(sys.argv[4])
    assert [m for m in extras if importlib.util.find_spec(m) is not None] == []
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    import wscompress

    folders, ids, out = json.loads(sys.argv[1]), load_file(sys.argv[2])["ids"], sys.argv[3]
    logits = {}
    with torch.no_grad():
        for name, folder in folders.items():
            logits[name + "/load"] = wscompress.load(folder, device="cpu")[0](ids).logits.contiguous()
            logits[name + "/auto"] = AutoModelForCausalLM.from_pretrained(folder)(ids).logits.contiguous()
    save_file(logits, out)
    from wscompress.cli import main
    sys.argv = ["wscompress", "check", sys.argv[5]]
    try:
        main()
    except SystemExit as done:
        print("@check exit", done.code)
    assert not [m for m in sys.modules if m.partition(".")[0] in extras]
""")


def test_folders_load_without_the_extras(folders, tmp_path, tiny_dir):
    """wscompress installed without its extras (no scipy, datasets, lm-eval, peft, matplotlib,
    rouge-score, gguf): folders load through wscompress.load and AutoModelForCausalLM with the
    saved logits, and a recipe that compresses is refused with the extra that installs what it
    needs, before any work."""
    import site

    import yaml

    bare = tmp_path / "site-packages"  # the environment's packages, the extras left out
    bare.mkdir()
    for root in site.getsitepackages():
        for entry in os.scandir(root):
            if not entry.name.lower().replace("-", "_").startswith(EXTRAS) and not (bare / entry.name).exists():
                (bare / entry.name).symlink_to(entry.path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(tiny_dir("llama"))}, "output": {"dir": str(tmp_path / "out")},
                                      "compress": [{"method": "svd", "ratio": 0.3}], "calibration": {"dataset": "pydoc"}}))
    save_file({"ids": INPUT}, tmp_path / "ids.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # WSCOMPRESS_KERNELS=0: the kernels' build names torch's headers by path, here this folder's, so
    # they would be built again (a minute), and again for the suite after; they load alike (test_kernels)
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{bare}", HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1",
               WSCOMPRESS_KERNELS="0")
    forms = {n: folders[n] for n in ("low_rank", "shared_bases", "palettized_row_scales", "soft_share_deltas",
                                     "gpt2_low_rank_palettized")}  # one of each kind of layer: the rest load alike
    done = subprocess.run([sys.executable, "-S", "-c", WITHOUT_EXTRAS, json.dumps({n: str(f) for n, (f, _) in forms.items()}),
                           str(tmp_path / "ids.safetensors"), str(tmp_path / "logits.safetensors"), json.dumps(EXTRAS),
                           str(recipe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    logits = load_file(tmp_path / "logits.safetensors")
    for name, (folder, saved) in forms.items():  # the torch path there (kernels off), to the kernels' logits
        atol = kernel_tolerance(wscompress.load(folder, device="cpu")[0])
        for way in ("load", "auto"):
            torch.testing.assert_close(logits[f"{name}/{way}"], saved, rtol=1e-5, atol=atol)
    assert "@check exit 2" in done.stdout
    assert "calibration and compression needs scipy" in done.stderr and "pip install 'wscompress[compress]'" in done.stderr
    assert not (tmp_path / "out").exists()
