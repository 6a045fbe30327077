"""Settings for the whole suite."""

from __future__ import annotations

import os

# The suite runs several llama.cpp engines at once (in this process and in child processes) on few cores, where
# llama.cpp's OpenMP threads should sleep at barriers rather than spin (meshllm/engine/llamacpp/openmp.py). What an
# operator does too; the tests of `--omp-wait auto` clear it for their own processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
