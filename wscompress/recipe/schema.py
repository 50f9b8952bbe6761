"""The typed sections of a recipe: ``model``, ``calibration``, ``compress`` (an ordered list of
stages), ``finetune``, ``eval``, ``bench`` and ``output``. Every class here rejects unknown
keys and checks types and ranges; each stage is validated by its method's own config class, a
``StageConfig`` subclass (see ``load``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

from ..errors import UsageError
from ..model.forms.wscompress_palettized import CodebookDtype

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
Init = Literal["kmeans++", "linear", "density"]  # how k-means places its first centroids (maths.clustering)


class Strict(BaseModel):
    """Base for all config sections: unknown keys are errors, values are type-checked."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# keys a recipe may still name from before they moved: the error says where they went
MOVED = {"finetune.lora_rank": "finetune.lora.rank", "finetune.lora_alpha": "finetune.lora.alpha",
         "finetune.lora_targets": "finetune.lora.targets"}


def error_lines(err: ValidationError, where: str, prefix: str = "") -> str:
    """A validation error as one line per problem: the file, the key, what is wrong."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown key (it moved to {MOVED[key]})" if key in MOVED else "unknown key"
        if "input" in e and e["type"] != "extra_forbidden" and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        lines.append(f"{where}: {key}: {msg}")
    return "\n".join(lines)


def known_keys(cls: type[BaseModel]) -> str:
    return ", ".join(cls.model_fields)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds (``X``, ``X | None``), or None for a plain value."""
    for hint in (annotation, *get_args(annotation)):
        if isinstance(hint, type) and issubclass(hint, BaseModel):
            return hint
    return None


def error_fix(err: ValidationError, cls: type[BaseModel], name: str, prefix: str = "") -> str:
    """The fix of a validation error's first problem, named where the mistake is: the keys of the
    section holding an unknown key, the values a key takes (its choices, or what its description
    says); ``cls`` is the outermost section (called ``name``) and ``prefix`` its key path."""
    first = err.errors()[0]
    section, path = cls, [prefix] if prefix else []
    for part in first["loc"][:-1]:  # down to the section holding the key named last
        field = section.model_fields.get(str(part))
        inner = _section(field.annotation) if field is not None else None
        if inner is None:
            break
        section, path = inner, [*path, str(part)]
    where = ".".join(path) if section is not cls else f"{prefix} ({name})" if prefix else name
    leaf = str(first["loc"][-1]) if first["loc"] else ""
    field = section.model_fields.get(leaf)
    if first["type"] == "extra_forbidden" or field is None:
        return f"keys of {where}: {known_keys(section)}; see docs/recipes.md"
    choices = [a for a in get_args(field.annotation) if get_origin(a) is Literal]
    if get_origin(field.annotation) is Literal:
        choices = [field.annotation]
    key = ".".join([*path, leaf])
    if choices:
        return f"{key} takes one of: {', '.join(repr(v) for c in choices for v in get_args(c))}"
    return f"{key}: {field.description}" if field.description else f"set {key} as its error says (docs/recipes.md has its range)"


class ModelConfig(Strict):
    path: str = Field(DEFAULT_MODEL, description="hub id, local directory, .gguf file or builtin:NAME")
    gguf_file: str | None = Field(None, description="GGUF file inside `path` (hub repo or directory)")
    revision: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "float32"
    device: str = Field("auto", description="auto (cuda when present, else cpu), cpu, cuda, cuda:N")
    device_map: str | None = Field(None, description="'auto' spreads a large model over GPUs and CPU")
    offload: Literal["none", "cpu", "disk"] = Field("none", description="where decoder layers wait while unused: "
                                                    "none (on the device), cpu (in RAM, moved to the device one group "
                                                    "at a time) or disk (read from safetensors files when used)")
    offload_folder: str | None = Field(None, description="disk offload: where changed layers are spilled "
                                                         "(default: a temporary folder in the cache)")
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_placement(self):
        if self.device_map is not None and self.offload != "none":
            raise ValueError("give either device_map or offload, not both")
        return self


BOS_HELP = ("auto: a BOS opens every window/sample when the tokenizer adds one; window: always; "
            "stream: one BOS opens the whole text (the LLaMA papers' WikiText-2 protocol); none")


class CalibrationConfig(Strict):
    dataset: str = Field("builtin:wiki.train", description="file path, builtin:NAME, or wikitext2/ptb/c4/pydoc")
    num_samples: int = Field(32, gt=0)
    seq_len: int = Field(512, gt=1)
    batch_size: int = Field(4, gt=0)
    seed: int = 0
    sampling: Literal["uniform", "gptq"] = Field("uniform", description="uniform (torch generator) or gptq (the "
                                                 "GPTQ/SVD-LLM scripts' random.randint sampler, reproducible across tools)")
    bos: Literal["auto", "window", "stream", "none"] = Field("auto", description=BOS_HELP)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="what the calibration passes compute in (statistics are summed in float64 whatever it "
                            "is): auto = bfloat16 for a float32 model where the device multiplies it natively, else "
                            "the model's dtype")


class StageConfig(Strict):
    """Fields every compression stage has; each method subclasses this with its options."""

    method: str

    def check(self, model) -> None:
        """Refuse options this model cannot take (raise a UsageError naming the fix), from its
        structure alone: it runs on the meta device before any work, and again before the stage."""


Target = Literal["function", "layer", "model"]
WEIGHT_RIDGE = 0.1  # a whole weight matrix fitted on a small calibration set overfits without it (k-means chose it)


class Refit(Strict):
    """The refit options (``pipeline/refit.py``) of every stage that refits what it made: named
    here once, mixed into each method's config."""

    refit: bool = Field(True, description="re-solve what the stage made, layer by layer, on the inputs the "
                                          "compressed model itself feeds it (error compensation, see pipeline/refit.py)")
    refit_samples: int | None = Field(None, gt=0, description="refit: the first N calibration sequences it fits on "
                                                              "(default: all)")
    ridge: float = Field(WEIGHT_RIDGE, ge=0, description="refit: ridge toward the unrefit weights, relative to the mean "
                                                         "diagonal of their inputs' Gram matrix")


class LayerRefit(Refit):
    """A refit whose modules' outputs can be fitted to three targets (``pipeline.refit``)."""

    refit_target: Target = Field("layer", description="refit: what each module's output is fitted to: the original "
                                 "layer's, fed the same layer input (layer; it won at every ratio of the protocol), "
                                 "the original module on its compressed inputs (function) or the original model's (model)")


class Budget(Strict):
    """A size the compressed targets of a stage must fit, everything counted: ``bits_per_weight``
    (over the targets' weights) or ``bytes`` (e.g. 60MB)."""

    bits_per_weight: float | None = Field(None, gt=0, le=32)
    bytes: ByteSize | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one(self) -> Budget:
        if (self.bits_per_weight is None) == (self.bytes is None):
            raise ValueError("give one of bits_per_weight or bytes")
        return self

    def bytes_for(self, weights: int) -> int:
        """The budget in bytes for ``weights`` target weights."""
        return int(self.bytes) if self.bytes is not None else int(self.bits_per_weight * weights // 8)

    def check(self, who: str, budget: int, weights: int, least: int, smallest: str, dense: int) -> None:
        """Refuse a budget of ``budget`` bytes (for ``weights`` weights) below ``least``, the bytes of
        the stage's ``smallest`` choices, or no smaller than the ``dense`` targets' bytes."""
        if budget < least:
            raise UsageError(f"{who} budget: {budget} bytes ({8 * budget / weights:.3f} bits a weight) is below the "
                             f"{smallest}, {least} bytes ({8 * least / weights:.3f} bits a weight)",
                             "raise the budget or add a smaller choice to menu")
        if budget >= dense:
            raise UsageError(f"{who} budget: {budget} bytes is no smaller than the dense targets' {dense} bytes",
                             "lower the budget (bits_per_weight below the weights' own bits)")


class TargetedStage(StageConfig):
    """A stage that compresses the modules its ``targets`` name (each method has its default)."""

    targets: list[str] = Field(default_factory=list, description="regexes (re.search) over module names")
    ignore: list[str] = Field(default_factory=list, description="regexes of modules to leave alone")


class DistillConfig(Strict):
    """Knowledge distillation from the original model (the recipe's ``model``) as teacher."""

    kl: float = Field(1.0, ge=0, description="weight of KL(teacher || student) on the logits, x temperature^2")
    temperature: float = Field(1.0, gt=0)
    lm: float = Field(0.0, ge=0, description="weight of the language-model loss on the text")
    hidden: float = Field(0.0, ge=0, description="weight of the decoder layers' output MSE (relative to the teacher's)")
    teacher_device: Literal["same", "cpu"] = Field("same", description="where the teacher runs")
    layerwise_steps: int = Field(0, ge=0, description="first, Adam steps per decoder layer of local distillation "
                                                      "(each layer fits the teacher's layer on its own inputs)")
    layerwise_lr: float = Field(1e-5, gt=0)
    layerwise_samples: int = Field(32, gt=0, description="training sequences the layer-wise pass runs on")
    layerwise_share: float = Field(0.25, gt=0, le=1, description="with finetune.max_minutes, the most of the budget "
                                                                 "the layer-wise phase may use (spread evenly over "
                                                                 "the layers; the rest trains the global loss)")
    cache_topk: int = Field(0, ge=0, description="keep the teacher's top-k next-token log-probabilities of every "
                                                 "training batch on disk (KL on those k): later runs and epochs read "
                                                 "them and need no teacher (0: run the teacher every step)")

    @model_validator(mode="after")
    def _some_loss(self):
        if self.kl == self.lm == self.hidden == 0:
            raise ValueError("every loss weight is 0 (set kl, lm or hidden)")
        if self.cache_topk and self.hidden:
            raise ValueError("cache_topk keeps logits only: the hidden-state loss needs the teacher (set hidden: 0)")
        return self


class LoraConfig(Strict):
    """``finetune.lora``: peft LoRA adapters on plain linears, merged into them after training
    (the compressed structure stays as it was)."""

    rank: int = Field(8, gt=0)
    alpha: float = 16.0
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], description="regexes of plain linears")


class DKMConfig(Strict):
    """``finetune.dkm``: differentiable k-means while training (the clustering options mean what
    they mean for the ``kmeans`` stage; see ``recovery/dkm.py``)."""

    bits: int = Field(4, ge=1, le=8)
    granularity: Literal["per_tensor", "per_channel", "grouped"] = "per_channel"
    group_size: int | None = Field(None, gt=0)
    cluster_dim: int = Field(1, ge=1)
    init: Init = "kmeans++"
    temperature: float = Field(0.2, gt=0, description="softness, relative to the squared centroid spacing")
    iterations: int = Field(5, ge=1, description="most centroid updates per forward pass")
    tolerance: float = Field(1e-4, ge=0, description="stop updating once no centroid moves more than this, "
                                                     "relative to the centroid spacing")
    chunk_size: int = Field(1 << 22, gt=0, description="attention entries computed at once")
    entropy_coding: bool = False
    codebook_dtype: CodebookDtype = "float16"
    targets: list[str] = Field(default_factory=list)
    ignore: list[str] = Field(default_factory=list)
    seed: int = 0


class FinetuneConfig(Strict):
    """Recovery fine-tuning. ``mode`` picks what trains: ``method`` the compressed layers' own
    parameters, ``full`` everything, ``lora`` adapters (options in ``lora``), ``dkm`` weights
    through differentiable k-means (options in ``dkm``); the other keys apply to every mode."""

    enabled: bool = True
    mode: Literal["lora", "method", "full", "dkm"] = "method"
    dataset: str = "builtin:wiki.train"
    seq_len: int = Field(256, gt=1)
    batch_size: int = Field(4, gt=0)
    grad_accum: int = Field(1, gt=0)
    steps: int = Field(100, gt=0)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    eval_every: int = Field(0, ge=0, description="steps between evaluations (0: only at the end)")
    eval_windows: int = Field(8, gt=0)
    save_every: int = Field(0, ge=0, description="steps between resumable checkpoints (0: never)")
    max_minutes: float | None = Field(None, gt=0, description="time budget: training (layer-wise phase included, "
                                      "evaluations excluded) stops when it is spent and the schedule decays over "
                                      "it; steps becomes an upper bound")
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    penalty: float = Field(0.0, ge=0, description="Frobenius penalty on low-rank deltas (soft_share)")
    norms: bool = Field(False, description="mode method: the normalisation layers' gains train too (stored "
                        "uncompressed anyway; a gain before a projection rescales its input columns, which a "
                        "codebook cannot)")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    dkm: DKMConfig = Field(default_factory=DKMConfig)
    bos: Literal["auto", "window", "stream", "none"] = Field("auto", description=BOS_HELP)
    distill: DistillConfig | None = Field(None, description="distil from the original model instead of the LM loss alone")
    seed: int = 0

    @model_validator(mode="after")
    def _norms_with_method(self):
        if self.norms and self.mode != "method":
            raise ValueError(f"norms applies to mode: method (mode {self.mode} "
                             + ("trains them already)" if self.mode == "full" else "does not train them)"))
        return self


class EvalConfig(Strict):
    perplexity: list[str] = Field(default_factory=lambda: ["builtin:wiki.test"])
    context_length: int = Field(512, gt=1)
    stride: int | None = Field(None, gt=0, description="window step; < context_length scores only the new tokens")
    batch_size: int = Field(4, gt=0)
    max_windows: int | None = Field(None, gt=0, description="evaluate only the first N windows")
    bos: Literal["auto", "window", "stream", "none"] = Field("auto", description=BOS_HELP)
    tasks: list[str] = Field(default_factory=list, description="lm-eval task names or local task YAML files")
    task_data: dict[str, str] = Field(default_factory=dict, description="local task name -> its data file (overrides the YAML's)")
    limit: int | None = Field(None, gt=0, description="lm-eval: examples per task")
    prompts: list[str] = Field(default_factory=list)
    max_new_tokens: int = Field(32, gt=0)


class BenchConfig(Strict):
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8])
    seq_lens: list[int] = Field(default_factory=lambda: [128])
    decode_tokens: int = Field(16, ge=0)
    warmup: int = Field(1, ge=0)
    repeats: int = Field(3, gt=0)
    cuda_graph: bool = Field(False, description="on CUDA, decode on a static KV cache with each step replayed as "
                             "one captured CUDA graph, as serving stacks do (eager decoding of a small model times "
                             "Python's kernel launches, not the layers); no effect on CPU")
    compile: bool = Field(False, description="decode on a static KV cache with the step compiled (torch.compile; "
                          "about a minute once per model on 2 CPU cores): the framework's per-token cost left out")
    breakdown: bool = Field(True, description="also report where a decoded token's time goes at batch 1 (linears "
                            "by layout, attention, norms, embedding, head, the rest) with the bytes each part reads")


class OutputConfig(Strict):
    dir: str = "outputs/run"
    max_shard_size: ByteSize = Field(ByteSize(10**9), gt=0, description="largest weights file (e.g. 1GB, 500MB): the "
                                     "model is written shard by shard, never held whole")


class Recipe(Strict):
    name: str = "run"
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    compress: list[StageConfig] = Field(default_factory=list)
    finetune: FinetuneConfig | None = None
    eval: EvalConfig = Field(default_factory=EvalConfig)
    bench: BenchConfig | None = None
    output: OutputConfig = Field(default_factory=OutputConfig)
    source: str | None = Field(None, exclude=True, description="file the recipe came from")

    @property
    def out(self) -> Path:
        return Path(self.output.dir)


