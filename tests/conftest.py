"""Test-session set-up: one intra-op thread per process (this one, the gloo ranks, and CLI subprocesses).

The test models are tiny, so a thread pool only adds synchronisation: on a busy 2-core machine, a 5-step
float64 run of the tiny config took 8-13 s with torch's default two threads and 0.2-0.3 s with one.
Set OMP_NUM_THREADS yourself to override.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 - after the variable, so that subprocesses and torch's first use see it

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels (fourfold.infer.attention_gpu) run in Triton's numpy interpreter; the
# variable must be set before anything imports triton (torchao and transformers do, through torch).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
