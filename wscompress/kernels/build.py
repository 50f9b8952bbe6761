"""`python -m wscompress.kernels.build`: build the kernels once (``make install`` runs it) and
say which paths palettized layers, k-means and calibration will use. Never fails: without the kernels the torch path runs."""

from . import _load, calibration_status, status

print(f"wscompress kernels: {status()}; k-means: {_load('kmeans')[1]}; trellis: {_load('trellis')[1]}; calibration: {calibration_status()}")
