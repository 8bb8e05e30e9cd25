"""Hugging Face transformers (5.x): attn_implementation="attngen".

    import attngen.integrations.transformers
    attngen.integrations.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attngen")

register() adds two functions under the name "attngen":
- `build_mask` (transformers' AttentionMaskInterface): transformers calls it once per forward
  and layer type with the mask pattern as a Python function (causal, sliding window, ...), the 2D
  padding mask and the cache offsets. It recognises the pattern and returns an `AttngenMask`: an
  attngen mask object and the number of keys it covers. No (B, 1, Sq, Sk) tensor is built, and a
  mask with a padding tensor is classified into tiles once per forward, not once per layer.
- `attention_forward` (AttentionInterface): every attention layer calls it with q (B, Hq, Sq, D),
  k and v (B, Hkv, Sk, D) as the cache returns them (GQA heads are read in place, never repeated),
  the AttngenMask, the scaling, the dropout and Gemma-2's soft cap; it returns (B, Sq, Hq, D).

What maps to what (positions as transformers counts them, the cache offsets included):
- causal: `causal`; bottom-right aligned when Sq != Sk (a forward over a KV cache); keys after the
  last query are cut (a static cache's empty slots).
- sliding window W (Mistral, Qwen2, Gemma-2's local layers; a query sees keys q - W < k <= q):
  `sliding_window(window=W)`, the same convention; bidirectional W (|q - k| <= W):
  `sliding_window(window=W + 1, two_sided=True)`.
- a 2D attention_mask with zeros (padding): `& key_padding(keep=...)`; a padding query that sees
  no key gets output 0 (eager gives it the average of every value: no implementation defines it,
  and under left padding the first real token is predicted from it, so keep that label out).
- softcap (Gemma-2): `& softcap(cap=...)`, cap * tanh(score / cap) on the scaled score, as Gemma.
- dropout: attngen's dropout with the layer's probability (0 outside training).
Anything else (packed sequences found from position_ids, chunked attention, custom mask
functions, a prepared 4D mask, generate() with a static cache, paged caches, attention sinks,
position bias, output_attentions) raises an error that says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import attngen

try:
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface, masking_utils
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("attngen.integrations.transformers needs Hugging Face transformers 5.x: "
                      "pip install 'attngen[hf]'") from e

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"attngen.integrations.transformers needs transformers 5.x, found {transformers.__version__}: "
                      "pip install 'attngen[hf]'")

NAME = "attngen"


def register() -> None:
    """Make attn_implementation="attngen" available to every transformers model."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, build_mask)


@dataclass(eq=False)
class AttngenMask:
    """What `build_mask` hands the attention layers of one type for one forward."""

    mask: attngen.Mask | None  # which keys each query sees (None: all of them)
    kv_len: int  # the keys the mask covers: each layer cuts its K and V to these
    window: int | None  # the sliding window of transformers' pattern (checked against the layer's)
    _with_softcap: dict = field(default_factory=dict, repr=False)

    @property
    def ndim(self):
        """transformers reads a mask that is not a 4D tensor as the 2D padding mask: this one came back
        from generate(), which builds the masks ahead of the forward for a static cache."""
        raise NotImplementedError(
            "attn_implementation='attngen' does not support generate() with a static cache "
            "(cache_implementation='static'): generate() builds its masks ahead of the forward there and the model "
            "cannot read attngen's back; use the default dynamic cache, or pass a StaticCache to the model's forward")

    def with_softcap(self, cap: float | None) -> attngen.Mask | None:
        """The mask, and the soft cap after it; built once per forward and cap, not per layer."""
        if cap is None:
            return self.mask
        if cap not in self._with_softcap:
            softcap = attngen.mask("softcap", cap=float(cap))
            self._with_softcap[cap] = softcap if self.mask is None else self.mask & softcap
        return self._with_softcap[cap]


# ---------------------------------------------------------------------------------------------
# the mask function


def _captured(fn) -> dict:
    """The variables a closure captured, by name."""
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))


def _code(fn):
    return getattr(fn, "__code__", None)


_AND_CODE = _code(masking_utils.and_masks(masking_utils.causal_mask_function))
_SLIDING_CODE = _code(masking_utils.sliding_window_overlay(1))
_TWO_SIDED_CODE = _code(masking_utils.sliding_window_bidirectional_overlay(1))


def _pattern(mask_function) -> tuple[bool, int | None] | None:
    """(causal, sliding window) of a transformers mask function, or None for another pattern.

    The functions are recognised by identity, and the closures transformers builds for a sliding
    window by their code: a pattern that is not recognised is refused, never approximated.
    """
    if mask_function is masking_utils.causal_mask_function:
        return True, None
    if mask_function is masking_utils.bidirectional_mask_function:
        return False, None
    if _code(mask_function) is _AND_CODE:
        parts = _captured(mask_function).get("mask_functions", ())
        if len(parts) == 2:
            overlay, base = parts
            if base is masking_utils.causal_mask_function and _code(overlay) is _SLIDING_CODE:
                return True, _captured(overlay)["sliding_window"]
            if base is masking_utils.bidirectional_mask_function and _code(overlay) is _TWO_SIDED_CODE:
                return False, _captured(overlay)["sliding_window"]
    return None


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   mask_function=None, attention_mask=None, **kwargs) -> AttngenMask:
    """transformers' mask function for "attngen" (AttentionMaskInterface): the AttngenMask of one
    forward. Query i is at position q_offset + i and key j at kv_offset + j; `attention_mask` is
    the 2D padding mask (batch, positions), True or 1 for a real token."""
    pattern = _pattern(mask_function)
    if pattern is None:
        raise NotImplementedError(
            f"attn_implementation='attngen' supports transformers' causal, sliding-window and bidirectional mask "
            f"patterns with padding, not this one ({getattr(mask_function, '__qualname__', mask_function)}): packed "
            "sequences found from position_ids, chunked attention and custom mask functions (or_mask_function, "
            "and_mask_function, block_sequence_ids) are not supported; use attn_implementation='sdpa' or 'eager'")
    causal, window = pattern
    q_offset = int(q_offset)  # a tensor for static caches: one host sync per forward
    shift = q_offset - kv_offset  # query i and key j are at the same position where j == i + shift
    kv_len = kv_length
    if causal:
        # keys after the last query are hidden: cut them (a static cache's empty slots), so that the
        # last key lines up with the last query
        kv_len = q_length + shift
        if not 0 < kv_len <= kv_length:
            raise ValueError(f"the cache holds keys at positions {kv_offset}..{kv_offset + kv_length - 1}, which "
                             f"does not reach the last query's position {q_offset + q_length - 1}")
    if shift == 0:
        align = "top_left"
    elif shift == kv_len - q_length:
        align = "bottom_right"
    elif window is not None:
        raise ValueError(f"attngen cannot line up {q_length} queries at offset {q_offset} with {kv_len} keys at "
                         f"offset {kv_offset} for a bidirectional sliding window")
    else:
        align = None  # full bidirectional attention: positions do not matter

    mask = None
    if causal and window is None:
        mask = attngen.mask("causal", align=align)
    elif causal:
        mask = attngen.mask("sliding_window", window=window, align=align)
    elif window is not None:
        mask = attngen.mask("sliding_window", window=window + 1, two_sided=True, align=align)
    if attention_mask is not None:
        keep = masking_utils.prepare_padding_mask(attention_mask.bool(), kv_length, kv_offset)
        keep = keep[:, kv_offset:kv_offset + kv_len].contiguous()
        if not keep.all():  # a host sync, once per forward
            padding = attngen.mask("key_padding", keep=keep)
            mask = padding if mask is None else mask & padding
    return AttngenMask(mask, kv_len, window)


# ---------------------------------------------------------------------------------------------
# the attention function


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers' attention function for "attngen" (AttentionInterface).

    query (B, Hq, Sq, D), key and value (B, Hkv, Sk, D); returns ((B, Sq, Hq, D), None): attngen
    computes no attention weights.
    """
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation='attngen' does not support {name} (attention sinks and "
                                      "position biases): use attn_implementation='eager'")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("attn_implementation='attngen' computes no attention weights "
                                  "(output_attentions=True): use attn_implementation='eager'")
    if attention_mask is None:
        is_causal = kwargs.get("is_causal")
        if is_causal if is_causal is not None else getattr(module, "is_causal", False):
            raise NotImplementedError(
                "attn_implementation='attngen' got no mask for a causal attention layer: transformers builds none for "
                "paged caches (continuous batching) or models that do not create their masks with transformers' "
                "masking utilities, and attngen does not guess one")
        attention_mask = AttngenMask(None, key.shape[2], None)
    elif not isinstance(attention_mask, AttngenMask):
        raise TypeError(
            f"attn_implementation='attngen' takes its mask from its own mask function (an AttngenMask), got "
            f"{type(attention_mask).__name__}: a prepared 4D attention_mask passed to the model is not supported "
            "(pass the 2D padding mask, or use attn_implementation='sdpa' or 'eager')")
    if sliding_window is not None and sliding_window != attention_mask.window:
        raise ValueError(f"the attention layer has sliding_window={sliding_window} but transformers built its mask "
                         f"with sliding window {attention_mask.window}: attngen does not know which to follow")
    kv_len = attention_mask.kv_len
    if key.shape[2] < kv_len:
        raise ValueError(f"the mask covers {kv_len} keys but the layer has {key.shape[2]}")
    key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    out = attngen.attention(query, key, value, mask=attention_mask.with_softcap(softcap), scale=scaling,
                            dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None
