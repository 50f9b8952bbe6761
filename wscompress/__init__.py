"""wscompress: make HuggingFace language models smaller by weight sharing and weight clustering.

Importing it lets ``transformers.AutoModelForCausalLM.from_pretrained`` load the folders it
writes, with its compiled kernels as the compressed layers' fast paths. A program that imports
it keeps its process as it was (allocator settings, environment); the ``wscompress`` command's
own process is set up for its runs (``io.memory.setup_process``, which a program may call too).
"""

__version__ = "0.1.0"

import os as _os  # noqa: E402
import sys as _sys  # noqa: E402

from .io import memory as _memory  # noqa: E402

# The command's process (its console script: nothing loaded before this package) is set up here,
# before torch and transformers load: they, and the BLAS transformers' import loads, read the
# settings when they load, so the command's entry point would be too late.
if _os.path.basename(getattr(_sys, "argv", [""])[0]) == "wscompress":
    _memory.setup_process()

from . import kernels  # noqa: E402,F401  (registers the kernels with the compressed layers)
from .evaluation import step_cache as _step_cache  # noqa: E402,F401  (registers generate()'s cached compiled step)
from .model.forms.wscompress_format import register as _register  # noqa: E402

_register()


def load(path: str, dtype=None, device: str = "auto"):
    """Load a checkpoint written by ``wscompress compress`` (or any HF folder): (model, tokenizer),
    in ``dtype`` (a torch dtype or its name; None: as stored) on ``device`` (auto: the GPU where
    there is one, as in recipes)."""
    from .io.checkpoints import load_model
    from .recipe.schema import ModelConfig

    dtype = "auto" if dtype is None else str(dtype).removeprefix("torch.")
    return load_model(ModelConfig(path=str(path), dtype=dtype, device=device))


def compress(model, stages: list, tokenizer=None, calibration: dict | None = None) -> list[dict]:
    """Apply recipe stages (dicts like ``{"method": "svd", "ratio": 0.2}``) to a model in place."""
    from .recipe.load import load_recipe
    from .workflow import apply_stages

    recipe = load_recipe(data={"compress": stages, "calibration": calibration or {}})
    return apply_stages(model, tokenizer, recipe)


def compile_decode(model):
    """Make ``model.generate()`` decode on a static KV cache with its step compiled (torch.compile,
    the compressed layers' kernels inside the graph) from its first call, compiling in this
    process where no step is saved yet (about a minute, once a machine on CPU; without this
    call a compressed model's ``generate()`` compiles it in the background). Returns the model."""
    from .evaluation.decode import compile_decode as setup

    return setup(model)
