"""A stand-in `triton` package for SGLang on CPU (installed by sitecustomize when Triton is absent).

SGLang imports Triton in hundreds of modules to *define* GPU kernels (`@triton.jit`,
`@triton.autotune(configs=[triton.Config(...)])`, `tl.constexpr` annotations, `tl.float16` in
tables) but never launches one on CPU; the real Triton wheel is 1 GB. SGLang itself uses the same
idea on Apple Silicon (`sglang/_platform_stubs.py`). Here:

- every `triton.*` module exists and is a `_Mock`: any attribute is another mock (CamelCase names
  are subclassable classes), calling it acts as a pass-through decorator (`@triton.jit`,
  `@triton.jit(...)`, `@triton.autotune(...)`), `in`/`len`/`bool`/iteration say "empty";
- the few things used as values are real: `cdiv`, `next_power_of_2`, `Config`, `tl.constexpr`,
  and the classes/exceptions torch imports (`JITFunction`, `OutOfResources`, `PTXASError`, ...);
- runtime probes such as `triton.runtime.driver.active.get_current_target().backend` fail with
  AttributeError, which SGLang and torch read as "no Triton device" (`triton.backends.backends` is
  empty, so torch's `has_triton()` is False).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

VERSION = "3.0.0"


class _StubBase:
    """Base of the placeholder classes (`class K(triton.runtime.KernelInterface)` must work)."""


class _Mock(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__package__ = name
        self.__spec__ = importlib.machinery.ModuleSpec(name, _LOADER, is_package=True)
        self.__relax_stub__ = True

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            value = sys.modules[full]
        elif name[:1].isupper():
            value = type(name, (_StubBase,), {"__module__": self.__name__})
        else:
            value = _mock(full)
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return lambda fn: fn  # @triton.jit(...), @triton.autotune(...), @triton.heuristics(...)

    def __contains__(self, item):
        return False

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<relax triton stand-in {self.__name__!r}>"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return sys.modules.get(spec.name) or _mock(spec.name)

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "triton" or fullname.startswith("triton."):
            return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=True)
        return None


_LOADER = _Loader()


def _mock(name: str) -> _Mock:
    mod = sys.modules.get(name)
    if not isinstance(mod, _Mock):
        mod = _Mock(name)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
    return mod


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


class Config:
    """`triton.Config(kwargs, num_warps=..., num_stages=..., ...)`: kept, never used."""

    def __init__(self, kwargs=None, num_warps=4, num_stages=2, **extra):
        self.kwargs = dict(kwargs or {})
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.extra = extra


class constexpr:
    """`tl.constexpr`: an annotation and a value wrapper."""

    def __init__(self, value=None):
        self.value = value

    def __repr__(self):
        return f"constexpr({self.value!r})"


def install() -> types.ModuleType:
    """Register the stand-in as `triton` (and every `triton.*`); return the top module."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    triton = _mock("triton")
    triton.__version__ = VERSION
    triton.cdiv = cdiv
    triton.next_power_of_2 = next_power_of_2
    triton.Config = Config
    _mock("triton.language").constexpr = constexpr
    jit = _mock("triton.runtime.jit")
    jit.JITFunction = type("JITFunction", (), {"__module__": "triton.runtime.jit"})
    jit.KernelInterface = type("KernelInterface", (_StubBase,), {"__module__": "triton.runtime.jit"})
    autotuner = _mock("triton.runtime.autotuner")
    autotuner.Autotuner = type("Autotuner", (), {"__module__": "triton.runtime.autotuner"})
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {"__module__": "triton.runtime.autotuner"})
    autotuner.PTXASError = type("PTXASError", (Exception,), {"__module__": "triton.runtime.autotuner"})
    _mock("triton.runtime.cache").triton_key = lambda: "relax-triton-stand-in"
    _mock("triton.compiler.compiler").triton_key = lambda: "relax-triton-stand-in"
    _mock("triton.backends").backends = {}
    return triton
