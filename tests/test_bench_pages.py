"""The page-size benchmark runs end to end on a tiny model and restores the page size."""

import torch
from benchmarks import page_size

from conftest import tiny_model
from kvevict.storage import paged


def test_decode_steps_and_page_size_restored(tmp_path):
    model = tiny_model("llama-gqa")
    before = paged.PAGE
    assert page_size.decode_steps(model, 8, context=20, batch=2, steps=10, budget=100) > 0
    paged.PAGE = before
    cache_pages = []
    for size in (8, page_size.PREALLOC):
        paged.PAGE = size
        c = page_size.make_cache(model, "h2o", 100)
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 20)), cache=c, use_cache=True)
        cache_pages.append(c.layers[0].tiers[0].capacity)
    paged.PAGE = before
    assert cache_pages == [24, 100]  # three pages of 8, or the whole budget at once
