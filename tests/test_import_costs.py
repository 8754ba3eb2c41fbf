"""Start-up import costs: the trainer's modules and the data plane import without torch._dynamo and the inductor
(relax.lazy_jit, relax.data.tensordict_import), and Megatron's jit fuser still compiles, at
its function's first call, with the options it was given. The driver imports the controller and every role's
actor class without Megatron-core or transformers (relax.roles.megatron_rank)."""

import subprocess
import sys

from relax.lazy_jit import deferred_compile

_CHECK = """
import sys
import relax.backends.megatron.trainer, relax.data.plane
import megatron.core.fusions.fused_bias_swiglu as swiglu
from megatron.core import jit
loaded = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
print("LOADED", loaded, jit.jit_fuser.__name__, swiglu.swiglu.__name__)
"""


def test_trainer_and_data_plane_import_without_dynamo():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("LOADED")][0]
    # Megatron's fuser is the deferring torch.compile; the fused functions keep their names
    assert line == "LOADED [] compile_later swiglu", line


_DRIVER = """
import sys
import relax.entrypoints.train, relax.core.controller
import relax.roles.trainer, relax.roles.critic, relax.roles.reference, relax.roles.genrm, relax.roles.engine
import relax.roles.rollout, relax.core.checkpointing
print("LOADED", sorted(m for m in ("megatron", "transformers", "sympy") if m in sys.modules))
"""


def test_the_driver_imports_the_roles_without_megatron():
    out = subprocess.run([sys.executable, "-c", _DRIVER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("LOADED")][0]
    assert line == "LOADED []", line


def test_deferred_compile_compiles_once_at_first_call_with_its_options():
    calls = []

    def fake_compile(fn, **options):
        calls.append(options)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = deferred_compile(fake_compile)

    @compile_later
    def plain(x):
        return x + 1

    @compile_later(dynamic=True)
    def with_options(x):
        return x * 2

    assert calls == [] and plain.__name__ == "plain"  # nothing compiled at decoration
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(3) == ("compiled", 6)
    assert calls == [{}, {"dynamic": True}]  # once per function, with the decorator's options
