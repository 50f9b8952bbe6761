#!/usr/bin/env bash
# What a lent GPU machine needs beside the working tree to run scripts/gpu_check.py, made here
# before the call (the machine reaches no package index and no hub):
#   .gpu/whl    pydantic and its own dependencies as wheels (its image has the rest of wscompress's
#               core dependencies: torch, transformers, safetensors, numpy, accelerate, pyyaml,
#               typer, rich, ninja; docs/gpu.md)
#   .gpu/cache  a wscompress cache holding the builtin SmolLM2's config and tokenizer (no weights:
#               gpu_check builds its models from configs), which the calibration tokenizes with
# .gpu/ is ignored by git; the device call names it in `carry` and runs the command printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/cache/smollm2-135m-instruct
packages=$("$PY" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in ("pydantic", "pydantic_core", "annotated_types", "typing_inspection")))
EOF
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d .gpu/whl $packages
builtin=$("$PY" -c "from wscompress.io.checkpoints import builtin_dir; print(builtin_dir('smollm2-135m-instruct'))")
cp "$builtin"/{config.json,tokenizer.json,tokenizer_config.json} .gpu/cache/smollm2-135m-instruct/
du -sh .gpu
cat <<'EOF'
device command (carry: [".gpu"]):
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD WSCOMPRESS_CACHE=$PWD/.gpu/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 && nvidia-smi --query-gpu=name,driver_version --format=csv && python3 scripts/gpu_check.py --out $OUT 2>&1 | tee $OUT/log
EOF
