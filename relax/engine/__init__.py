"""Stable dotted paths named by the configuration reference (hook defaults and examples).

`relax.engine.*` keeps the public hook paths users put in launch scripts; the implementations live
in the architecture packages (`relax.rollout`, ...).
"""
