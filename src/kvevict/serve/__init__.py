"""kvevict's OpenAI-compatible server (``kvevict serve``; needs the ``serve`` extra).

app.py        the FastAPI app: its routes, lifespan, exception handlers and middleware
routes.py     the handlers: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics
relay.py      a request's events as its HTTP response: whole, streamed (SSE), with logprobs
protocol.py   request validation (kv_policy, kv_budget, ...) -> GenRequest, or HTTP 400
engine.py     the request queue and the worker thread that makes every model call
work.py       the queue state the handlers and the worker share, under one lock
admission.py  which waiting requests start now (K/V memory, batch slots) and which prefill together
decode.py     prefill, one decode step of every running batch, streaming, rows that end
handle.py     a request's handle (events, cancel, deadline), its row, the batch it may join
budgeter.py   the K/V bytes a row holds, measured through the model: what admission counts
batch.py      one left-padded decode batch sharing one cache
prefix_store.py  stored prompt prefixes' caches: byte-bounded, least recently used out first
prefix_fill.py   a request's prefill from a stored prefix, storing its own earlier turns
detokenize.py token ids -> streamed text deltas, stop strings
sampling.py   greedy / temperature / top-p
logprobs.py   token log-probabilities from the step's logits, in OpenAI's layouts
auth.py       --api-key: Bearer keys on /v1 (401)
drain.py      SIGTERM: 503 for new requests, in-flight ones finish, exit 0
heap.py       the freed heap back to the OS when the server goes idle (glibc's malloc_trim)
responses.py  OpenAI response and chunk objects, SSE
metrics.py    Prometheus text format
server.py     uvicorn in the foreground or in a thread
replicas.py   N replicas under Ray Serve behind the same API
"""
