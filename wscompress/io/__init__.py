"""Getting things in and out: checkpoints (``checkpoints``), compressed folders (``storage``),
texts (``data``), where decoder layers wait (``offload``), files, memory, processes, the
machine (``hardware``) and the console (``ui``)."""
