"""wscompress: make HuggingFace language models smaller by weight sharing and weight clustering."""

__version__ = "0.1.0"


def load(path: str, dtype=None, device: str = "auto"):
    """Load a checkpoint written by ``wscompress compress`` (or any HF folder): (model, tokenizer),
    on ``device`` (auto: the GPU where there is one, as in recipes)."""
    from .model import load_model
    from .recipe import ModelConfig

    return load_model(ModelConfig(path=str(path), dtype="auto" if dtype is None else dtype, device=device))


def compress(model, stages: list, tokenizer=None, calibration: dict | None = None) -> list[dict]:
    """Apply recipe stages (dicts like ``{"method": "svd", "ratio": 0.2}``) to a model in place."""
    from .recipe import load_recipe
    from .workflow import apply_stages

    recipe = load_recipe(data={"compress": stages, "calibration": calibration or {}})
    return apply_stages(model, tokenizer, recipe)
