"""What a model is made of: its architecture as methods see it (``arch``) and the compressed
layers with the transformers classes that load them (``forms``: one file for the format, one per
family of forms, those a folder uses copied into it)."""
