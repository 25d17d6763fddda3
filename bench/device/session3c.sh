#!/usr/bin/env bash
# H200 session 3, call C: part one of the SmolLM2 GGUF onto a fresh machine (the tree may carry
# at most 64 MiB per call; the GGUF is 98 MB). Call D follows at once.
set -u
mkdir -p /tmp/smol && cp .smol1/part_aa /tmp/smol/ && ls -la /tmp/smol
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
