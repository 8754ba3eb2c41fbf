"""Import stubs for the CPU SGLang subprocess (never imported by Relax itself).

`install(name)` turns the already created module `name` into a stub: any attribute is a
placeholder (a class that can be subclassed, called, indexed), and any submodule
`name.x.y` imports as another stub. Only modules that SGLang imports at start-up but never
uses on CPU (vision transforms, CUDA kernels, notebook display) are stubbed this way; calling
into a stub raises at once with a message naming it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_PREFIXES: set[str] = set()


class _Placeholder(type):
    """Metaclass of the placeholder classes: attribute access yields more placeholders."""

    def __getattr__(cls, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _placeholder(f"{cls.__qualname__}.{item}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__qualname__} is an import stub of Relax's CPU SGLang shims; "
                           "it cannot be used on this machine")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __bool__(cls):
        return False


def _placeholder(qualname: str):
    return _Placeholder(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "relax_stub"})


def _module_getattr(modname: str):
    def __getattr__(item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _placeholder(f"{modname}.{item}")

    return __getattr__


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []  # a package, so that deeper submodules import too
        module.__getattr__ = _module_getattr(module.__name__)
        module.__relax_stub__ = True


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if any(fullname.startswith(p + ".") for p in _PREFIXES):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


_FINDER = _StubFinder()


def install(name: str, **attrs) -> types.ModuleType:
    module = sys.modules[name]
    module.__getattr__ = _module_getattr(name)
    module.__relax_stub__ = True
    for key, val in attrs.items():
        setattr(module, key, val)
    _PREFIXES.add(name)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    return module
