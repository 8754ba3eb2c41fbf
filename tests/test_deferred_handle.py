"""relax.wire.handles.DeferredHandle: an actor handle that another actor receives without loading the actor's class
until it uses the handle (the rollout manager's weight source: trainer rank 0, whose class imports Megatron)."""

from __future__ import annotations

import pickle
import sys

import ray

from relax.wire.handles import DeferredHandle

TARGET_MODULE = "deferred_target"


@ray.remote(num_cpus=0)
class Receiver:
    def __init__(self, source):
        self.source = source
        self.loaded_at_receipt = TARGET_MODULE in sys.modules

    def use(self):
        return self.loaded_at_receipt, self.source.ping.remote(1), TARGET_MODULE in sys.modules


def test_the_receiver_loads_the_class_at_the_first_use_only(ray_session):
    from deferred_target import Target

    target = Target.remote()
    receiver = Receiver.remote(DeferredHandle(target))
    loaded_at_receipt, answer, loaded_after = ray.get(receiver.use.remote())
    assert not loaded_at_receipt and loaded_after
    assert ray.get(answer) == 2
    for actor in (receiver, target):
        ray.kill(actor)


def test_pickling_carries_the_reference_alone(ray_session):
    from deferred_target import Target

    target = Target.remote()
    deferred = DeferredHandle(target)
    assert ray.get(deferred.ping.remote(2)) == 3  # resolved here
    again = pickle.loads(pickle.dumps(deferred))
    assert again._handle is None and ray.get(again.ping.remote(4)) == 5
    ray.kill(target)
