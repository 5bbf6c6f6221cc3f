"""Running a stock Hugging Face linear-attention module on its PyTorch path, as a reference.

transformers decorates Kimi-Linear's ``chunk_kda`` / ``fused_recurrent_kda`` (and the short
convolution) with ``use_kernel_func_from_hub_with_fallback``, which picks the implementation
once, when the modeling module is first imported: flash-linear-attention's Triton kernels
whenever ``fla`` is importable (``causal_conv1d``'s CUDA kernels for the convolution), the
module's own PyTorch functions otherwise. The Triton kernels do not run on CPU tensors, and a
reference should be the plain PyTorch math anyway. :func:`import_torch_path` imports the
modeling module while those packages are made unimportable for just that import (then puts
them back), so the module's functions bind to their PyTorch fallbacks; other code in the same
process keeps using fla. This module never imports transformers itself.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType

__all__ = ["KERNEL_PACKAGES", "import_torch_path", "routed_functions"]

KERNEL_PACKAGES = ("fla", "causal_conv1d")
"""Packages transformers routes linear-attention functions to when they are importable."""


def routed_functions(module: ModuleType) -> list[str]:
    """Names of ``module``'s functions that transformers bound to an external kernel package
    (``use_kernel_func_from_hub_with_fallback`` chose a non-PyTorch implementation)."""
    routed = []
    for name, fn in vars(module).items():
        if inspect.isfunction(fn) and hasattr(fn, "__wrapped__") and fn.__closure__:
            if inspect.getclosurevars(fn).nonlocals.get("is_new_implementation"):
                routed.append(name)
    return routed


def import_torch_path(
    module_name: str, *, blocked: tuple[str, ...] = KERNEL_PACKAGES
) -> ModuleType:
    """Import ``module_name`` (e.g. ``"transformers.models.kimi_linear.modeling_kimi_linear"``)
    with every function on its PyTorch path and return it.

    If the module is already imported on its PyTorch path it is returned as is; if it was
    imported with routed functions, a fresh copy replaces it in ``sys.modules`` (modules and
    objects made from the old copy keep their routing). The packages in ``blocked`` are
    unimportable only during the import. Raises ``RuntimeError`` if a function is still routed.
    """
    existing = sys.modules.get(module_name)
    if existing is not None and not routed_functions(existing):
        return existing
    saved = {name: sys.modules[name] for name in blocked if name in sys.modules}
    sys.modules.pop(module_name, None)
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # "import fla" now fails
    try:
        module = importlib.import_module(module_name)
    finally:
        for name in blocked:
            if name in saved:
                sys.modules[name] = saved[name]
            else:
                sys.modules.pop(name, None)
    still = routed_functions(module)
    if still:
        raise RuntimeError(f"{module_name}: {still} are still routed to an external kernel")
    return module
