"""A tiny tokenizer for conftest's tiny models (vocab 128), so the eval tasks run end to end on
them: a BPE trained in memory on a little English, with a chat template and special tokens."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"

CORPUS = """The pass key is 12345. Remember it. What is the pass key? Answer with the number only.
There is a pass key hidden in the following text. Find it and remember it.
Some special magic numbers are hidden in the following text. The special magic number for amber is 678901.
Summarize the following article in one sentence. Read the story and answer the question in a few words.
Repeat the following text exactly, word for word, and nothing else. Question: Answer:
Old Tom keeps the lighthouse on the rock. Every night he lights the lamp so that ships can pass.
The village fair opened on Saturday with a parade of tractors. The council voted to repair the bridge.
0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,:;!?'"()-
"""

CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tiny_tokenizer(vocab_size: int = 128):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=list(set(CORPUS.replace("\n", ""))),
        show_progress=False,
    )
    tk.train_from_iterator([CORPUS] * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.chat_template = CHAT
    tok.padding_side = "left"
    return tok


def essay_like(tokenizer, n_tokens: int, start: int = 0) -> str:
    """A haystack for tests: repeated fixture sentences, about ``n_tokens`` tokens."""
    base = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    text = base * (1 + n_tokens // 8)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    cut = tokenizer.decode(ids)
    return cut[: cut.rfind(". ") + 1]


def fake_kvpress(tok, tmp_path, monkeypatch) -> list:
    """A converted model folder "m" and a kvpress child that answers "12345" to every sample; the
    jobs it was given are appended to the list returned."""
    import kvevict.fetch
    import kvevict.peers.locations
    from kvevict.eval import peer_kvpress

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    real = kvevict.fetch.cache_dir  # the converted models' folder moves; its subfolders (nltk's data) stay
    monkeypatch.setattr(kvevict.fetch, "cache_dir", lambda *sub: real(*sub) if sub else tmp_path)
    monkeypatch.setattr(kvevict.peers.locations, "find", lambda peer: Path("python-of-kvpress"))
    jobs: list = []

    def fake_stream(py, job, log):
        jobs.append(job)
        for s in job["samples"]:
            yield {"id": s["id"], "new_ids": tok("12345")["input_ids"], "kv_tokens": 7, "seconds": 0.1}

    monkeypatch.setattr(peer_kvpress, "_stream", fake_stream)
    return jobs
