"""The numerics methods share: linear algebra in float64 (``linalg``), one parameter budget over
low-rank factorisations (``allocation``) and k-means (``clustering``)."""
