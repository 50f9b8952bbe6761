"""GPTQ with groups as llm-compressor runs it, for scripts/bench_lowbit.py. It runs in an
environment of its own (llm-compressor pins its transformers), never imports wscompress, and
hands back the de-quantized weight of every linear it quantized (what the model computes with).

Usage: PYTHON scripts/peers_gptq.py MODEL_DIR CALIBRATION.safetensors OUT.safetensors --bits 3 --group 64
CALIBRATION holds ``input_ids`` (samples, tokens): the windows wscompress calibrates on.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("calibration")
    ap.add_argument("out")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    args = ap.parse_args()
    ids = load_file(args.calibration)["input_ids"]
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    scheme = {"targets": ["Linear"], "weights": {"num_bits": args.bits, "type": "int", "symmetric": False,
                                                 "strategy": "group", "group_size": args.group}}
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], actorder="static")
    oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=len(ids))
    weights = {name: module.weight.detach().float().contiguous() for name, module in model.named_modules()
               if getattr(module, "quantization_scheme", None) is not None}
    save_file(weights, args.out)


if __name__ == "__main__":
    main()
