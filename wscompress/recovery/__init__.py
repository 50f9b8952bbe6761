"""Getting quality back after compression: fine-tuning (``finetune``), distillation from the
original model (``distill``) and differentiable k-means (``dkm``)."""
