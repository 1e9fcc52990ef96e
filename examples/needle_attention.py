"""Which queries look at the needle? For needle prompts at 1K tokens, the share of the needle's
digit keys (per layer and KV head) that rank in the top ``budget/2`` by three observers:
the prompt's last 64 queries (the question: SnapKV's window), every prompt query (H2O's sum),
and the full cache's own answer queries (what the oracle sees).

    PYTHONPATH=src python examples/needle_attention.py [n_samples]
"""

import sys

import torch
from transformers import DynamicCache

from kvevict.attention import record_attention_blocks
from kvevict.eval.tasks import NeedleOnceTask, RetrievalTask
from kvevict.generate import _greedy, encode_chat
from kvevict.models import load_model


def digit_positions(tok, ids, answer):
    """Positions of the first occurrence of the answer's tokens in the prompt."""
    want = tok(answer, add_special_tokens=False)["input_ids"]
    seq = ids[0].tolist()
    for i in range(len(seq) - len(want) + 1):
        if seq[i : i + len(want)] == want:
            return list(range(i, i + len(want)))
    return []


def main(n):
    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m")
    tasks = [
        NeedleOnceTask(lengths=(1024,), haystacks=("essays", "wikipedia")),
        RetrievalTask(lengths=(1024,), kinds=("single",)),
    ]
    for task in tasks:
        rows = []
        for s in task.samples(tok, n):
            ids = encode_chat(tok, s.data["messages"])
            pos = digit_positions(tok, ids, s.data["answer"])
            if not pos:
                continue
            model.set_attn_implementation("sdpa")
            seq = _greedy(model, tok, ids, DynamicCache(config=model.config), 12)
            blocks = record_attention_blocks(model, seq, 1)  # per query: (1, hkv, queries, keys)
            n_prompt, half = ids.shape[1], int(0.2 * ids.shape[1]) // 2
            share = []
            for b in blocks:
                a = b[0, :, :, :n_prompt]
                for obs in (a[:, n_prompt - 64 : n_prompt], a[:, :n_prompt], a[:, n_prompt:]):
                    top = obs.sum(1).topk(half, dim=-1).indices  # (hkv, half)
                    share.append(
                        torch.isin(torch.tensor(pos), top).float().mean(0).item()
                        if top.shape[0] == 1
                        else sum(torch.isin(torch.tensor(pos), t).float().mean().item() for t in top) / len(top)
                    )
            rows.append(torch.tensor(share).view(len(blocks), 3))
        t = torch.stack(rows)  # (samples, layers, 3)
        m = t.mean(0)
        print(
            f"{task.name} (n = {t.shape[0]}): share of needle digits in the top budget/2, mean over layers "
            f"and heads: question window {m[:, 0].mean():.3f}, all prompt queries {m[:, 1].mean():.3f}, "
            f"answer queries {m[:, 2].mean():.3f}; best layer: {m[:, 0].max():.2f} / {m[:, 1].max():.2f} / "
            f"{m[:, 2].max():.2f}"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
