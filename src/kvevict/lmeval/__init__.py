"""kvevict as an lm-evaluation-harness model (``--model kvevict``; extras ``kvevict[lmeval]``).

lm-eval 0.4.13 finds outside models only in its registry (``lm_eval.api.registry``; it reads no
entry-point group), so the model must be registered in the process that runs lm-eval:
``kvevict lm-eval ...`` and ``python -m kvevict.lmeval ...`` call ``register()``, then run
lm-eval's own command line with the remaining arguments. From Python: ``kvevict.lmeval.register()``
before ``lm_eval.simple_evaluate(model="kvevict", model_args=...)``.
"""

from __future__ import annotations


def register():
    """Register ``kvevict`` in lm-eval's model registry (idempotent); returns the model class."""
    try:
        # lm-eval's own models first: lm-eval imports them only into an empty registry
        import lm_eval.models  # noqa: F401
    except ImportError:
        raise ValueError(
            "the lm-eval integration needs lm-evaluation-harness: pip install 'kvevict[lmeval]'."
        ) from None
    from .model import KvevictLM

    return KvevictLM
