"""`python -m wscompress.kernels.build`: build the kernels once (``make install`` runs it) and
say which paths palettized layers and calibration will use. Never fails: without the kernels the torch path runs."""

from . import calibration_status, status

print(f"wscompress kernels: {status()}; calibration: {calibration_status()}")
