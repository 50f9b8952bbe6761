"""What a method may ask for besides the model: calibration data, statistics, the compute dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UsageError
from ..io import data, ui
from ..recipe.schema import CalibrationConfig
from . import calibration, layerwise
from .stats import INDEX, Stats, fingerprint, scratch_folder


class Context:
    """What a method may ask for besides the model: calibration data and statistics, per the
    recipe's ``calibration`` section. ``saved``: the folder where ``wscompress calibrate`` keeps
    statistics for the run (``<output>/calibration``); ``workdir``: where a stage's own go."""

    def __init__(self, settings: CalibrationConfig, tokenizer, workdir: str | Path | None = None,
                 saved: Path | None = None):
        self.settings, self.tokenizer, self.saved = settings, tokenizer, saved
        self.workdir = workdir  # where statistics computed for one stage go (default: the system's temp folder)
        self._batches: list[torch.Tensor] | None = None
        self._dtype: torch.dtype | None = None
        self.stages_done = 0  # saved statistics describe the model before the first stage only

    def calibration(self) -> list[torch.Tensor]:
        """Calibration batches (token ids), sampled once per run."""
        if self._batches is None:
            c = self.settings
            if self.tokenizer is None:
                raise UsageError("this method needs calibration data but no tokenizer was given",
                                 "pass tokenizer= to wscompress.compress or load the model with its tokenizer")
            self._batches = data.calibration_batches(self.tokenizer, c.dataset, c.num_samples, c.seq_len, c.batch_size,
                                                     c.seed, c.bos, c.sampling)
        return self._batches

    def describe(self) -> dict | None:
        """The calibration data as used (for reports), or None when no stage asked for it."""
        if self._batches is None:
            return None
        c = self.settings
        return {"dataset": c.dataset, "num_samples": c.num_samples, "seq_len": c.seq_len, "sampling": c.sampling,
                "bos": data.resolve_bos(self.tokenizer, c.bos), "dtype": self._dtype and _name(self._dtype)}

    def dtype(self, model: nn.Module) -> torch.dtype:
        """What the calibration passes compute in (``calibration.dtype`` resolved for this model,
        once: a stage that changes the model does not change it)."""
        if self._dtype is None:
            self._dtype = layerwise.compute_dtype(self.settings.dtype, model)
        return self._dtype

    def stats_meta(self, model: nn.Module) -> dict:
        c = self.settings
        return {"model": fingerprint(model), "dataset": c.dataset, "num_samples": c.num_samples,
                "seq_len": c.seq_len, "seed": c.seed, "sampling": c.sampling,
                "dtype": _name(self.dtype(model)),
                "bos": data.resolve_bos(self.tokenizer, c.bos) if self.tokenizer is not None else c.bos}

    def stats(self, model: nn.Module, names: list[str], sensitivity_samples: int = 0) -> Stats:
        """Input Gram matrices of the named linears and, with ``sensitivity_samples``, their output
        sensitivities on that many calibration sequences (see ``calibration``): from ``saved``
        when `wscompress calibrate` wrote it for this model and data (sensitivities
        for another sample count are recomputed), else computed now (always after an earlier
        stage of this run changed the model)."""
        folder = self.saved
        if folder is not None and (folder / INDEX).is_file() and self.stages_done == 0:
            stats = Stats(folder, self.stats_meta(model))
            if all(n in stats.owner for n in names):
                if sensitivity_samples and (stats.meta.get("sensitivity_samples") != sensitivity_samples
                                            or not all(n in stats.sensitivity for n in names)):
                    stats.sensitivity = calibration.output_sensitivity(model, names, self.calibration(), sensitivity_samples,
                                                                     self.dtype(model))
                return stats
            ui.log(f"[yellow]{folder} lacks some targets; recomputing statistics[/]")
        return calibration.collect_grams(model, self.calibration(), names, scratch_folder(self.workdir),
                                       sensitivity_samples=sensitivity_samples, scratch=True, dtype=self.dtype(model))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
