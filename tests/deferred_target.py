"""The actor class of tests/test_deferred_handle.py whose module the receiving actor must not import before it uses
the handle (kept out of the test module, which the receiver imports for its own class). Ray pickles an actor's
class by value, its base classes by reference: `Base` is what makes loading `Target` import this module, as
`MegatronRank` makes loading `TrainerWorker` import Megatron."""

import ray


class Base:
    def ping(self, x):
        return x + 1


@ray.remote(num_cpus=0)
class Target(Base):
    pass
