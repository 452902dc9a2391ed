"""Kernel modules with their Triton kernels run by the CPU interpreter, for the CPU tests of each kernel."""

import importlib
import os

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import ds4.kernels._device


def interpreted(module, kernel_name: str, *dependencies):
    """`module` with its kernels interpreted, even if it (and the kernel modules it uses, `dependencies`, in
    import order) was imported before the interpreter was chosen.

    Skipped where CUDA is present: the interpreter is chosen per process (TRITON_INTERPRET, read by Triton when
    a kernel is defined and by ds4 when it picks a kernel's arithmetic), so choosing it there would turn the GPU
    tests of the same session into interpreter runs; the GPU tests cover these kernels for real."""
    if torch.cuda.is_available():
        pytest.skip("interpreter tests of kernels run on machines without CUDA")
    if isinstance(getattr(module, kernel_name), InterpretedFunction):
        return module
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.reload(ds4.kernels._device)
    for dependency in dependencies:
        importlib.reload(dependency)
    return importlib.reload(module)
