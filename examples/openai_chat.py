"""Chat with a running ``kvevict serve`` through the official openai client, streaming, and print
what the KV cache held. Usage:

    kvevict serve --model smollm2-135m --budget 0.2 &      # loopback, port 8000
    python examples/openai_chat.py --budget 0.2 "Explain ..." "And ..."

Each argument is one user turn; the assistant's streamed answers are kept in the conversation.
"""

from __future__ import annotations

import argparse
import sys

import openai


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("turns", nargs="+", help="user messages, one per turn")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--system", default=None, help="optional system message")
    args = p.parse_args(argv)
    client = openai.OpenAI(base_url=args.url, api_key="kvevict", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for turn in args.turns:
        messages.append({"role": "user", "content": turn})
        print(f"\nuser: {turn}\nassistant: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"kv_policy": args.policy, "kv_budget": args.budget},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
        messages.append({"role": "assistant", "content": "".join(parts)})
        u = usage.model_dump()
        print(
            f"\n  [{u['kv_policy']} kv_budget={u['kv_budget']} -> {u['kv_budget_tokens']} tokens per layer & head; "
            f"prompt {u['prompt_tokens']} + {u['completion_tokens']} new tokens; KV held {u['kv_bytes'] / 2**20:.2f} MiB "
            f"vs full cache {u['kv_bytes_full'] / 2**20:.2f} MiB ({u['kv_bytes'] / u['kv_bytes_full']:.0%})]",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
