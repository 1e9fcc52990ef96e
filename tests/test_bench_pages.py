"""The page-size benchmark's pieces on a tiny model: a decode step at a page size, and the pages a
cache then grows by."""

import torch
from benchmarks import page_size

from conftest import tiny_model
from kvevict.storage import paged


def test_decode_steps_and_page_sizes(monkeypatch):
    """decode_steps and make_cache set the module's page size; monkeypatch restores it."""
    model = tiny_model("llama-gqa")
    monkeypatch.setattr(paged, "PAGE", paged.PAGE)  # what decode_steps sets, restored after the test
    assert page_size.decode_steps(model, 8, context=20, batch=2, steps=10, budget=100) > 0
    assert paged.PAGE == 8
    cache_pages = []
    for size in (8, page_size.PREALLOC):
        monkeypatch.setattr(paged, "PAGE", size)
        c = page_size.make_cache(model, "h2o", 100)
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 20)), cache=c, use_cache=True)
        cache_pages.append(c.layers[0].tiers[0].capacity)
    assert cache_pages == [24, 100]  # three pages of 8, or the whole budget at once
