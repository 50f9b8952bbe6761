"""`python -m wscompress.kernels.build`: build the kernels once (``make install`` runs it) and
say which path palettized layers will use. Never fails: without the kernels the torch path runs."""

from . import status

print(f"wscompress kernels: {status()}")
