"""The recipe: what a run does. ``schema`` holds the typed sections, ``load`` reads a YAML file
(with ``--set`` overrides) into them."""
