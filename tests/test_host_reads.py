"""A decode step reads nothing back from the device: on a GPU each read (``.item()``, ``int(t)``,
``bool(t)``: aten's ``_local_scalar_dense``) waits for every kernel queued before it, and a
captured step can hold none. Evicting one token per step or a batch at once (slack), the steps
that rank and those that only write read nothing."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvevict
from conftest import tiny_model


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket is torch.ops.aten._local_scalar_dense
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "spec",
    [
        "h2o@12",
        "h2o/int8+int4@12",  # two tiers, each evicting by the policy once full
        "snapkv/int8@12",  # pooled neighbours
        "ada-snapkv/int8+int4@12",  # Ada-KV: the heads' slots in one row, evicted together
        "tova/int4@12",
        "h2o@12+slack=4",  # batch eviction: a ranking step, then steps that only write
        "h2o/int8+int4@12+slack=4",
        "ada-snapkv/int8+int4@12+slack=3",
    ],
)
def test_an_unpadded_decode_step_reads_nothing_from_the_device(spec):
    model = tiny_model("qwen2")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 40))
    cache = kvevict.make_cache(model, spec)
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(3):  # every tier full: each step evicts from each
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        assert all(t.filled == t.budget for layer in cache.layers for t in layer.tiers)
        slack = cache.layers[0].tiers[0].slack
        with HostReads() as reads:
            for _ in range(2 * slack):  # every kind of step: the ranking and the writes between
                tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert reads.n == 0, f"{reads.n} host reads in {2 * slack} decode steps of {len(cache.layers)} layers"
