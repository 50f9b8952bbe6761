"""What a model is made of: its architecture as methods see it (``arch``) and the compressed
layers with the transformers classes that load them (``modeling_wscompress``, copied into
every model folder)."""
