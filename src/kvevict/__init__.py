"""kvevict: generate with any transformers decoder under a fixed KV-cache budget.

model, tok = kvevict.load_model("smollm2-135m")
cache = kvevict.make_cache(model, memory=0.2)   # a fifth of the full cache's bytes
model.generate(**inputs, cache=cache)
ctx = kvevict.compress(model, tok, context, memory=0.2)   # compress once, ask many
ctx.ask(["first question?", "second question?"])
"""

from .attention import ATTN_NAME, register
from .cache import EvictingCache, make_cache
from .compress import CompressedContext, compress
from .fork import ForkCache
from .layer import EvictingLayer
from .models import load_model
from .policies import POLICIES, Policy, make_policy
from .prefill import prefill

register()

__all__ = [
    "ATTN_NAME",
    "CompressedContext",
    "EvictingCache",
    "EvictingLayer",
    "ForkCache",
    "POLICIES",
    "Policy",
    "compress",
    "load_model",
    "make_cache",
    "make_policy",
    "prefill",
    "register",
]
__version__ = "0.1.0"
