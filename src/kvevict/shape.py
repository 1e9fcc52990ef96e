"""What kvevict reads of a model's shape: whether its attention can be hooked, its layers, head
dimension and sliding windows (the text config of a multimodal model)."""

from __future__ import annotations


def config_text(config, decoder: bool = False):
    """The text part of a model's ``config`` (a multimodal model's text config; ``decoder``: its
    decoder's, as transformers' ``get_text_config(decoder=True)``), or ``config`` itself when it has
    no parts."""
    if not hasattr(config, "get_text_config"):
        return config
    return config.get_text_config(decoder=True) if decoder else config.get_text_config()


def text_config(model):
    """The decoder's config (a multimodal model's text config)."""
    return config_text(model.config)


def check_hookable(model) -> int:
    """Raise a clear error unless the model routes attention through AttentionInterface."""
    name = type(model).__name__
    config = text_config(model)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{name} is an encoder-decoder model; kvevict evicts the self-attention cache of decoder-only models."
        )
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not getattr(model, "_supports_attention_backend", False) or can_set is None or not can_set():
        raise ValueError(
            f"{name} does not route its attention through transformers' AttentionInterface, so kvevict "
            "cannot hook it. Use a decoder whose modeling code supports attn_implementation switching "
            "(Llama, Qwen2, Mistral, Gemma, Phi3, ...)."
        )
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise ValueError(f"{name} has {odd} layers (not softmax attention); kvevict cannot budget their state.")
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"cannot find the number of decoder layers of {name} (config.num_hidden_layers).")
    return n


def head_dim_of(model) -> int | None:
    config = text_config(model)
    d = getattr(config, "head_dim", None)
    if isinstance(d, int):
        return d
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    return hidden // heads if isinstance(heads, int) and isinstance(hidden, int) and heads else None


def layer_windows(model) -> list:
    """Per decoder layer, its sliding window where transformers' stock cache would make it a
    sliding-window layer (``layer_types``, or Mistral-style configs), else None."""
    config = text_config(model)
    n = config.num_hidden_layers
    try:  # the stock cache's own rule, so that kvevict slides exactly where DynamicCache does
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(config)
        return [kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, kwargs)][:n]
    except (ImportError, AttributeError):
        types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if types is None:
            types = ["sliding_attention" if window is not None else "full_attention"] * n
        return [window if t == "sliding_attention" else None for t in types[:n]]
