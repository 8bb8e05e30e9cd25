"""Every built-in mask and score modifier, alone and combined, as factories of one call's sizes."""

import torch

import attngen


def doc_ids(batch, kv_len, device, generator=None):
    """Sorted random document ids per batch row (packed sequences), with short and long documents."""
    cuts = torch.rand(batch, kv_len, generator=generator) < 0.03
    return cuts.cumsum(-1).to(device)


def slopes(heads, device):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)


def _doc(b, h, sq, sk, dev):
    return attngen.mask("document", doc_ids=doc_ids(b, sk, dev))


def _alibi(b, h, sq, sk, dev):
    return attngen.mask("alibi", slopes=slopes(h, dev))


def _layout(b, h, sq, sk, dev):
    """Random blocks of 64 x 48 positions per (batch, head), the second row of query blocks empty."""
    layout = attngen.layouts.random(sq, sk, (64, 48), density=0.5, seed=sq * 1000 + sk, batch=b, heads=h, device=dev)
    layout[:, :, 1:2] = False
    return attngen.block_sparse(layout, (64, 48))


def _keep(b, h, sq, sk, dev):
    """A dense boolean mask (SDPA's attn_mask), the same for every head, two rows with no key."""
    keep = torch.rand(b, 1, sq, sk, device=dev) < 0.6
    keep[:, :, 1:3] = False
    return attngen.mask("keep", keep=keep)


def _bias(b, h, sq, sk, dev):
    """An additive float bias per head, broadcast over the batch (SDPA's float attn_mask)."""
    return attngen.mask("bias", bias=torch.randn(1, h, sq, sk, device=dev))


def _key_padding(b, h, sq, sk, dev):
    """Left padding, as Hugging Face's 2D attention_mask: batch row i starts with 7 * i padding keys."""
    keep = torch.arange(sk, device=dev) >= 7 * torch.arange(b, device=dev)[:, None]
    return attngen.mask("key_padding", keep=keep)


M = attngen.mask
ZOO = {
    "none": lambda b, h, sq, sk, dev: None,
    "causal": lambda b, h, sq, sk, dev: "causal",
    "causal_bottom_right": lambda b, h, sq, sk, dev: M("causal", align="bottom_right"),
    "sliding_window": lambda b, h, sq, sk, dev: M("sliding_window", window=37),
    "sliding_window_two_sided": lambda b, h, sq, sk, dev: M("sliding_window", window=20, two_sided=True),
    "sliding_window_bottom_right": lambda b, h, sq, sk, dev: M("sliding_window", window=50, align="bottom_right"),
    "prefix_lm": lambda b, h, sq, sk, dev: M("prefix_lm", prefix=23),
    "document": _doc,
    "document_1d": lambda b, h, sq, sk, dev: M("document", doc_ids=doc_ids(1, sk, dev)[0]),
    "chunked": lambda b, h, sq, sk, dev: M("chunked", chunk=48),
    "alibi": _alibi,
    "softcap": lambda b, h, sq, sk, dev: M("softcap", cap=3.0),
    "block_sparse": _layout,
    "keep": _keep,
    "sequences": lambda b, h, sq, sk, dev: M("sequences", q_seq=doc_ids(1, sq, dev)[0], kv_seq=doc_ids(1, sk, dev)[0]),
    "sequence_keys": lambda b, h, sq, sk, dev: M(  # query q sees keys 12 (q // 16) .. + 19 (past Sk: none)
        "sequence_keys", seq_kv_start=torch.arange(sq, dtype=torch.int32, device=dev) // 16 * 12,
        seq_kv_len=torch.full((sq,), 20, dtype=torch.int32, device=dev)),
    "bias": _bias,
    "block_sparse_shared": lambda b, h, sq, sk, dev: attngen.block_sparse(  # one (Sq blocks, Sk blocks) layout
        attngen.layouts.strided(sq, sk, (16, 16), local=2, stride=3, device=dev)[0, 0], (16, 16)),
    # combinations
    "block_sparse&causal": lambda b, h, sq, sk, dev: _layout(b, h, sq, sk, dev) & M("causal"),
    "block_sparse|sliding_window&softcap": lambda b, h, sq, sk, dev: (
        (_layout(b, h, sq, sk, dev) | M("sliding_window", window=30)) & M("softcap", cap=3.0)),
    "causal&document": lambda b, h, sq, sk, dev: M("causal") & _doc(b, h, sq, sk, dev),
    "sliding_window|prefix_lm": lambda b, h, sq, sk, dev: M("sliding_window", window=16) | M("prefix_lm", prefix=40),
    "chunked&causal&softcap": lambda b, h, sq, sk, dev: M("chunked", chunk=64) & M("causal") & M("softcap", cap=2.0),
    "keep&causal&bias": lambda b, h, sq, sk, dev: _keep(b, h, sq, sk, dev) & M("causal") & _bias(b, h, sq, sk, dev),
    "key_padding&causal": lambda b, h, sq, sk, dev: _key_padding(b, h, sq, sk, dev) & M("causal", align="bottom_right"),
    "causal&alibi": lambda b, h, sq, sk, dev: M("causal") & _alibi(b, h, sq, sk, dev),
    "(causal|chunked)&document&alibi&softcap": lambda b, h, sq, sk, dev: (
        (M("causal") | M("chunked", chunk=32)) & _doc(b, h, sq, sk, dev) & _alibi(b, h, sq, sk, dev)
        & M("softcap", cap=4.0)),
}
