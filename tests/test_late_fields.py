"""relax.backends.megatron.batching.add_late_fields: a per-token field given after collation (rows still
arriving while the forward pass runs, relax.roles.step_passes) is the tensor collation would have made."""

import pytest
import torch

from relax.backends.megatron.batching import add_late_fields, make_micro_batches


def _samples(n: int):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        resp = 1 + i % 4
        out.append({"tokens": torch.randint(0, 50, (5 + resp,), generator=g), "response_length": resp,
                    "ref_logprobs": -torch.rand(resp, generator=g)})
    return out


def test_late_field_equals_the_collated_one():
    samples = _samples(10)
    collated = make_micro_batches(samples, 4)
    late_mbs = make_micro_batches([{k: v for k, v in s.items() if k != "ref_logprobs"} for s in samples], 4)
    asked = []

    def rows(lo, hi):
        asked.append((lo, hi))
        return [s["ref_logprobs"] for s in samples[lo:hi]]

    start = 0
    for want, mb in zip(collated, late_mbs):
        assert "ref_logprobs" not in mb.fields
        add_late_fields(mb, {"ref_logprobs": rows}, start)
        add_late_fields(mb, {"ref_logprobs": rows}, start)  # asked again (a recomputed loss): kept, not re-read
        assert torch.equal(mb.fields["ref_logprobs"], want.fields["ref_logprobs"])
        start += mb.size
    assert asked == [(0, 4), (4, 8), (8, 10)]


def test_a_late_row_of_another_length_is_refused():
    samples = _samples(4)
    mb = make_micro_batches([{k: v for k, v in s.items() if k != "ref_logprobs"} for s in samples], 4)[0]
    short = [s["ref_logprobs"][:-1] if i == 2 else s["ref_logprobs"] for i, s in enumerate(samples)]
    with pytest.raises(ValueError, match="'ref_logprobs' has 2 entries, response has 3"):
        add_late_fields(mb, {"ref_logprobs": lambda lo, hi: short[lo:hi]}, 0)
