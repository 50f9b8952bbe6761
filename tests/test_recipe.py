"""Recipe parsing and validation: every bad input names the file, the key and the fix."""

import pytest
import yaml

from wscompress.errors import UsageError
from wscompress.recipe.load import apply_override, load_recipe


def write(tmp_path, data, name="r.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def error_of(tmp_path, data, overrides=()) -> str:
    with pytest.raises(UsageError) as exc:
        load_recipe(write(tmp_path, data), list(overrides))
    return str(exc.value)


def test_defaults_and_sections(tmp_path):
    r = load_recipe(write(tmp_path, {"model": {"path": "x"}, "output": {"dir": str(tmp_path / "o")}}))
    assert r.model.path == "x" and r.model.trust_remote_code is False
    assert r.calibration.num_samples > 0 and r.eval.context_length > 1
    assert r.out == tmp_path / "o" and r.compress == [] and r.finetune is None


def test_unknown_key_names_file_key_and_fix(tmp_path):
    msg = error_of(tmp_path, {"model": {"pth": "x"}})
    assert "r.yaml" in msg and "model.pth" in msg and "unknown key" in msg and "fix:" in msg


def test_unknown_section(tmp_path):
    msg = error_of(tmp_path, {"modle": {}})
    assert "modle" in msg and "keys of the recipe: name, seed, model" in msg


def test_wrong_type(tmp_path):
    msg = error_of(tmp_path, {"calibration": {"num_samples": "many"}})
    assert "calibration.num_samples" in msg and "'many'" in msg


def test_out_of_range(tmp_path):
    assert "calibration.seq_len" in error_of(tmp_path, {"calibration": {"seq_len": 0}})


def test_malformed_yaml(tmp_path):
    assert "not valid YAML" in error_of(tmp_path, "model: [unclosed\n")


def test_not_a_mapping(tmp_path):
    assert "mapping" in error_of(tmp_path, "- a\n- b\n")


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_unknown_method_suggests(tmp_path):
    msg = error_of(tmp_path, {"compress": [{"method": "svdd", "ratio": 0.2}]})
    assert "compress.0.method" in msg and "unknown method 'svdd'" in msg and "known methods" in msg


def test_stage_without_method(tmp_path):
    assert "'method' key" in error_of(tmp_path, {"compress": [{"ratio": 0.2}]})


def test_stage_must_be_list(tmp_path):
    assert "list of stages" in error_of(tmp_path, {"compress": {"method": "x"}})


def test_stage_options_validated_by_method(tmp_path):
    from wscompress.methods import METHODS

    name = sorted(METHODS)[0]
    msg = error_of(tmp_path, {"compress": [{"method": name, "no_such_option": 1}]})
    assert "compress.0.no_such_option" in msg and f"keys of compress.0 (method {name!r})" in msg


@pytest.mark.parametrize("override, fix", [
    ("finetune.dkm.no_such_option=1", "keys of finetune.dkm: bits, granularity"),
    ("model.offload=tape", "model.offload takes one of: 'none', 'cpu', 'disk'"),
    ("calibration.dtype=int3", "calibration.dtype takes one of: 'auto', 'float32'"),
    ("output.max_shard_size=big", "output.max_shard_size: largest weights file"),
    ("eval.max_windows=-1", "eval.max_windows: evaluate only the first N windows"),
    ("finetune.distill.kl=-2", "finetune.distill.kl: weight of KL"),
    ("compress.0.budget.size=1", "keys of compress.0.budget: bits_per_weight, bytes"),
    ("no_section=1", "keys of the recipe: name, seed, model"),
])
def test_a_nested_mistake_names_the_fix_of_its_own_section(tmp_path, override, fix):
    """The fix names the keys of the section holding an unknown key, or the values the wrong key takes."""
    msg = error_of(tmp_path, {"compress": [{"method": "kmeans", "bits": 4}]}, [override])
    assert f"fix: {fix}" in msg, msg


def test_overrides(tmp_path):
    path = write(tmp_path, {"eval": {"context_length": 128}, "compress": []})
    r = load_recipe(path, ["eval.context_length=256", "eval.tasks=[a, b]", "model.trust_remote_code=true", "output.dir=x"])
    assert r.eval.context_length == 256 and r.eval.tasks == ["a", "b"] and r.model.trust_remote_code is True


def test_override_into_stage_list():
    data = {"compress": [{"method": "svd", "ratio": 0.2}]}
    apply_override(data, "compress.0.ratio=0.3")
    assert data["compress"][0]["ratio"] == 0.3
    with pytest.raises(UsageError, match="no item 3"):
        apply_override(data, "compress.3.ratio=0.3")
    with pytest.raises(UsageError, match="no '='"):
        apply_override(data, "compress.0.ratio")


def test_override_type_error_is_reported(tmp_path):
    msg = error_of(tmp_path, {}, ["eval.batch_size=big"])
    assert "eval.batch_size" in msg


def test_shipped_configs_validate():
    from pathlib import Path

    configs = sorted(Path(__file__).resolve().parents[1].glob("configs/**/*.yaml"))
    assert configs, "configs/ has recipes"
    for path in configs:
        load_recipe(path)
