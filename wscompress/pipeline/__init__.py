"""The layer-by-layer machinery every method runs on: one decoder layer at a time
(``layerwise``), calibration statistics (``calibration``, kept on disk by ``stats``), refits
of compressed modules (``refit``) and what a method is handed besides the model (``context``)."""
