"""The cache-spec grammar (kvevict.spec): one reading and one printing of a cache's name, used by
make_cache, generate, eval grids, the CLI, the server and lm-eval."""

import pytest

from conftest import tiny_model
from kvevict import make_cache
from kvevict.eval.caches import new_cache
from kvevict.spec import CacheSpec
from kvevict.storage import Storage


@pytest.mark.parametrize(
    "text, spec",
    [
        ("full", CacheSpec("full")),
        ("full/int4", CacheSpec("full", Storage(kv_bits=4))),
        ("h2o@0.2", CacheSpec("h2o", budget=0.2)),
        ("h2o@512", CacheSpec("h2o", budget=512)),
        ("snapkv+q/int8@512", CacheSpec("snapkv", Storage(kv_bits=8), question=True, budget=512)),
        ("merge-ada-h2o/int8+int4@0.1", CacheSpec("merge-ada-h2o", Storage(kv_bits=8, evicted_bits=4), budget=0.1)),
        ("kvzip-pool@memory=0.2", CacheSpec("kvzip-pool", budget=0.2, memory=True)),
        ("memory=20%", CacheSpec(None, budget=0.2, memory=True)),
        ("h2o/fp+int2", CacheSpec("h2o", Storage(evicted_bits=2))),
    ],
)
def test_a_spec_reads_and_prints_back(text, spec):
    assert CacheSpec.parse(text) == spec
    assert CacheSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "old, new",
    [
        ("stock", "full"),
        ("none", "full"),
        ("kvevict-full", "full/fp"),
        ("kvevict-full/int8", "full/int8"),
        ("mem", "memory"),
        ("mem-kvzip-pool", "kvzip-pool@memory"),
        ("mem-h2o/int4", "h2o/int4@memory"),
        ("h2o/int4+q", "h2o+q/int4"),
    ],
)
def test_older_spellings_still_read(old, new):
    assert str(CacheSpec.parse(old)) == new


@pytest.mark.parametrize(
    "bad, says",
    [
        ("hh2o@0.2", "unknown policy 'hh2o'"),
        ("h2o@1.5", r"share of the prompt is in \(0, 1\]"),
        ("h2o/int3", "kv_bits must be one of"),
        ("full@0.2", "no @BUDGET"),
        ("h2o@", "nothing after @"),
        ("h2o@-3", "keeps nothing"),
        ("", "non-empty string"),
    ],
)
def test_a_bad_spec_says_what_to_write(bad, says):
    with pytest.raises(ValueError, match=says) as err:
        CacheSpec.parse(bad)
    assert "POLICY[+q][/STORAGE][@BUDGET]" in str(err.value)


def test_a_grid_gives_the_budget_and_a_memory_spec_takes_it_as_bytes():
    assert CacheSpec.parse("mem-kvzip-pool").at(0.2) == CacheSpec.parse("kvzip-pool@memory=0.2")
    assert CacheSpec.parse("h2o/int4").at(0.1) == CacheSpec.parse("h2o/int4@0.1")
    assert CacheSpec.parse("full").at(0.1) == CacheSpec("full")
    with pytest.raises(ValueError, match="names its budget already"):
        CacheSpec.parse("h2o@0.2").at(0.1)


def test_make_cache_and_an_eval_cell_build_the_same_cache_from_one_spec():
    model = tiny_model("llama-gqa")
    a = make_cache(model, "h2o/int4@0.5")
    b = make_cache(model, "h2o", 0.5, kv_bits=4)
    c = new_cache(model, "h2o/int4", 0.5)
    assert a.storage == b.storage == c.storage and a.storage.kv_bits == 4
    assert (
        [layer.budget_spec for layer in a.layers] == [layer.budget_spec for layer in c.layers] == [0.5] * len(a.layers)
    )
    with pytest.raises(ValueError, match="names budget already"):
        make_cache(model, "h2o@0.5", budget=0.3)
    with pytest.raises(ValueError, match=r"\+q needs the prompt's text"):
        make_cache(model, "snapkv+q@0.5")
    with pytest.raises(ValueError, match="DynamicCache"):
        make_cache(model, "full/int4")
