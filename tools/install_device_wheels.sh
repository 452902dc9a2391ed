#!/usr/bin/env bash
# On the GPU machine: install the carried wheels from .whl/ into /tmp/site and the repo itself on top.
# Source it (`. tools/install_device_wheels.sh`) so PYTHONPATH reaches the caller.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
