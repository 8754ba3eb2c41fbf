"""TransferQueue sampler that hands out samples in ``Sample.index`` order, optionally in
whole prompt groups.

Why: TransferQueue recycles released global indexes (FIFO over an unordered set), so after
any ``clear`` the global-index order of a new partition no longer follows the order in
which samples were written, and the default ``SequentialSampler`` (global-index order) then
returns an arbitrary subset and can split a prompt group across batches (measured).
``DataPlane.put`` records ``{"index": Sample.index, "group": Sample.group_index}`` as
TransferQueue custom_meta before the data becomes visible; this sampler, running inside the
controller actor, orders the ready samples by it.
"""

from __future__ import annotations

from typing import Any

from relax.data import tensordict_import

tensordict_import.install()  # tensordict without torch._dynamo (see the module)

from transfer_queue.sampler import BaseSampler  # noqa: E402


class IndexOrderSampler(BaseSampler):
    """Consume ready samples in ascending ``Sample.index``.

    With ``sampling_config={"group_size": n}`` only complete groups (``n`` ready samples
    sharing ``group_index``) are handed out, whole, lowest index first, and only when they
    fill ``batch_size`` exactly; otherwise nothing (the caller polls again).
    """

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        *args: Any,
        partition: Any = None,
        group_size: int | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        custom = getattr(partition, "custom_meta", None) or {}

        def key(g: int) -> tuple[int, int]:
            m = custom.get(g)
            return (0, m["index"]) if m and "index" in m else (1, g)

        ordered = sorted(ready_indexes, key=key)
        if not group_size:
            chosen = ordered[:batch_size]
            return chosen, chosen

        groups: dict[Any, list[int]] = {}
        for g in ordered:
            m = custom.get(g) or {}
            groups.setdefault(m.get("group", ("ungrouped", g)), []).append(g)
        chosen: list[int] = []
        for members in groups.values():
            if len(members) < group_size:
                continue  # group not complete yet
            if len(chosen) + len(members) > batch_size:
                break
            chosen.extend(members)
            if len(chosen) == batch_size:
                break
        if len(chosen) != batch_size:
            return [], []
        return chosen, chosen
