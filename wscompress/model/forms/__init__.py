"""The code a compressed folder carries: the format (``wscompress_format``: the base of every
compressed layer, the checks of a folder, the transformers classes) and one file per family of
compressed layers (``wscompress_<family>.py``). Each imports torch, transformers, numpy and its
siblings only, so a folder loads where wscompress is not installed; importing this package
imports every file here, so every form is registered by name (``LAYERS``)."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
