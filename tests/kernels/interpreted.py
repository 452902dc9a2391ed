"""Kernel modules with their Triton kernels run by the CPU interpreter, for the CPU tests of each kernel."""

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import ds4.kernels._device  # noqa: E402


def interpreted(module, kernel_name: str, *dependencies):
    """`module` with its kernels interpreted, even if it (and the kernel modules it uses, `dependencies`, in
    import order) was imported before the interpreter was chosen, e.g. by GPU tests in the same session."""
    if isinstance(getattr(module, kernel_name), InterpretedFunction):
        return module
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.reload(ds4.kernels._device)
    for dependency in dependencies:
        importlib.reload(dependency)
    return importlib.reload(module)
