"""The server's --kv-bits: budgeted rows store packed codes, admission counts their bytes exactly,
the default budget keeps more tokens in the same memory, and answers equal the library's."""

import argparse

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402

from kvevict.commands import serve as serve_cmd  # noqa: E402
from kvevict.generate import generate  # noqa: E402
from kvevict.serve.batch import DecodeBatch  # noqa: E402
from kvevict.serve.budgeter import Budgeter  # noqa: E402
from kvevict.serve.server import ServerThread, build  # noqa: E402
from serve_helpers import DEADLINE, DEFAULTS, MODEL, chat, folder, reference  # noqa: E402,F401


@pytest.mark.parametrize("bits", [8, 4])
def test_admission_counts_packed_rows_exactly(reference, bits):
    model, _ = reference
    packed, plain = Budgeter(model, bits), Budgeter(model)
    # a packed slot is smaller than a model-dtype one (fp32 here), state included
    assert packed.slots_of["h2o"][0][0] < plain.slots_of["h2o"][0][0]
    rows = [("h2o", 8, None), ("tova", 40, None), ("h2o", 16, 4)]
    batch, specs = None, []
    with torch.no_grad():
        for i, (policy, budget, recent) in enumerate(rows):
            n = 10 + 7 * i
            other, _ = DecodeBatch.prefill(model, list(range(1, n + 1)), policy, budget, recent, bits)
            assert other.kv_bytes() == packed.batch_bytes([(policy, budget, recent, n)])
            specs.append((policy, budget, recent, n))
            if batch is None:
                batch = other
            else:
                assert batch.can_join(other)
                batch.join(other)
            assert batch.kv_bytes() == packed.batch_bytes(specs)
        batch.step([1, 2, 3])
        specs = [(p, b, r, n + 1) for p, b, r, n in specs]
        assert batch.kv_bytes() == packed.batch_bytes(specs)
        batch.keep([0, 2])
        assert batch.kv_bytes() == packed.batch_bytes([specs[0], specs[2]])


def test_a_packed_server_answers_as_the_library_and_holds_less(folder, reference):
    model, tok = reference
    answers, held = {}, {}
    for bits in (None, 8):
        app, engine = build(folder, {**DEFAULTS, "budget": 12, "kv_bits": bits})
        with ServerThread(app) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0, timeout=DEADLINE)
            out = client.chat.completions.create(
                model=MODEL, messages=chat("Tell me about the weather."), max_tokens=10
            )
        answers[bits] = out.choices[0].message.content.strip()
        held[bits] = out.usage.model_extra["kv_bytes"]
    want = generate(model, tok, chat("Tell me about the weather."), "h2o", 12, max_new_tokens=10, kv_bits=8).text
    assert answers[8] == want
    assert held[8] < held[None] / 2  # int8 codes with their steps and zeros against fp32 values


def test_the_default_budget_keeps_more_tokens_when_packed(folder):
    tokens = {}
    for bits in (None, 8, 4):  # 512 KiB: the tiny model's fp32 rows get 128 tokens each
        _, engine = build(folder, {**DEFAULTS, "budget": None, "kv_memory": 1 << 19, "kv_bits": bits})
        tokens[bits] = engine.settings.budget
    # (its head dimension is 16: a step and a zero per group weigh more there than at 64)
    assert tokens[None] < 2 * tokens[None] <= tokens[8] < tokens[4]


def test_the_server_stores_int8_unless_told_otherwise(folder):
    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    settings = serve_cmd.settings_from_args(p.parse_args([]))
    assert "kv_bits" not in settings  # the default is Settings'
    _, engine = build(folder, {"model_id": MODEL})
    engine.stop()
    assert engine.settings.kv_bits == 8 and engine.budgeter.kv_bits == 8
    assert serve_cmd.settings_from_args(p.parse_args(["--kv-bits", "none"]))["kv_bits"] is None
    assert serve_cmd.settings_from_args(p.parse_args(["--kv-bits", "4"]))["kv_bits"] == 4


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--kv-bits", "3"], "--kv-bits must be one of"),
        (["--kv-bits", "eight"], "--kv-bits must be one of"),
        (["--policy", "full", "--kv-bits", "8"], "drop --kv-bits"),
    ],
)
def test_bad_kv_bits_say_what_to_change(argv, says):
    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    with pytest.raises(ValueError, match=says):
        serve_cmd.settings_from_args(p.parse_args(argv))
