"""attn_implementation="attngen" in Hugging Face transformers: tiny models built from configs with
random weights (nothing downloaded) give the logits, the gradients and the greedy generations of
the same model under attn_implementation="eager"."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attngen  # noqa: E402
import attngen.integrations.transformers as hf  # noqa: E402
from helpers import DEVICE, assert_close, rand_qkv, rel_error  # noqa: E402

hf.register()

VOCAB, SEQ, PAD = 64, 24, 5  # the second batch row starts with PAD padding tokens where a test pads
GRAD_TOLERANCE = 1e-4  # fp32 gradients after two layers and the loss; eager itself differs from float64 by less

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
             bos_token_id=2, initializer_range=0.2)  # weights large enough for scores of a few units
CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    # a window shorter than the sequence, and than the prompt plus the generated tokens
    "mistral": (transformers.MistralConfig, dict(sliding_window=7)),
    # a sliding layer then a full one, both soft-capped; a cap small enough to change the scores a lot
    "gemma2": (transformers.Gemma2Config, dict(sliding_window=7, query_pre_attn_scalar=16, attn_logit_softcapping=0.5,
                                               final_logit_softcapping=None)),
}
MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def models(name, **config):
    """(eager, attngen): one model of random weights, twice."""
    config_class, defaults = CONFIGS[name]
    torch.manual_seed(0)
    eager = getattr(transformers, MODELS[name])._from_config(config_class(**{**SMALL, **defaults, **config}),
                                                             attn_implementation="eager")
    eager = eager.to(DEVICE)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("attngen")
    assert ours.config._attn_implementation == "attngen" and eager.config._attn_implementation == "eager"
    return eager, ours


def batch(padded: bool):
    """Token ids (2, SEQ) and the 2D attention mask; with `padded`, row 1 is left-padded."""
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :PAD] = 0
        mask[1, :PAD] = 0
    return ids, mask


def train_step(model, ids, mask):
    """Logits and every parameter's gradient after one loss.backward().

    Padding is not a label, nor is the first real token after left padding: it is predicted from a
    padding position, a query that sees no key, whose output no implementation defines (eager
    averages every value there, attngen gives 0).
    """
    model.train()
    model.zero_grad()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


# a padded batch has an unpadded row too; Llama unpadded runs the masks without a key_padding term
@pytest.mark.parametrize("name,padded", [("llama", False), ("llama", True), ("mistral", True), ("gemma2", True)],
                         ids=["llama", "llama_left_padded", "mistral_left_padded", "gemma2_left_padded"])
def test_logits_and_gradients_match_eager(name, padded):
    eager, ours = models(name)
    ids, mask = batch(padded)
    ref_logits, ref_grads = train_step(eager, ids, mask)
    logits, grads = train_step(ours, ids, mask)
    real = mask.bool()  # a padding position's output is not used (eager and attngen differ there)
    assert_close(logits[real], ref_logits[real], torch.float32)
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(ours.parameters()))
    for n, g in grads.items():
        assert not torch.isnan(g).any(), n
        assert rel_error(g, ref_grads[n]) <= GRAD_TOLERANCE, (n, rel_error(g, ref_grads[n]))


@pytest.mark.parametrize("name,change", [("mistral", dict(sliding_window=None)),
                                         ("gemma2", dict(attn_logit_softcapping=None))], ids=["window", "softcap"])
def test_the_window_and_the_cap_matter_here(name, change):
    """The shapes above are small enough for the window and the cap to change the logits: a model that
    ignored them would fail the comparison with eager."""
    eager, _ = models(name)
    changed, _ = models(name, **change)
    ids, mask = batch(False)
    with torch.no_grad():
        assert rel_error(changed.eval()(ids).logits, eager.eval()(ids).logits) > 1e-2


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_generate_gives_eager_tokens(name):
    """Greedy decoding over the KV cache of a left-padded batch (queries bottom-right aligned;
    Mistral's window is shorter than the prompt, so its cache keeps only the window; Gemma-2 has a
    full and a sliding layer): the same tokens as eager."""
    eager, ours = models(name)
    ids, mask = batch(True)
    ids, mask = ids[:, :12], mask[:, :12]
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = eager.eval().generate(ids, **kwargs)
    assert expected.shape == (2, 17)
    assert torch.equal(ours.eval().generate(ids, **kwargs), expected)


def test_a_static_cache_matches_eager():
    """A StaticCache passed to the forward: 32 slots, the prompt's 12 then one token; its empty slots
    are cut (the query offset is a tensor there), and Mistral's window is shorter than the prompt."""
    ids, mask = batch(True)
    ids, mask = ids[:, :12], mask[:, :12]
    logits = []
    for model in models("mistral"):
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            prompt = model.eval()(ids, attention_mask=mask, cache=cache, use_cache=True).logits
            token = torch.full((2, 1), 7, device=DEVICE)
            step = model(token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1), cache=cache,
                         use_cache=True).logits
        logits.append((prompt[mask.bool()], step))
    (ref_prompt, ref_step), (prompt, step) = logits
    assert_close(prompt, ref_prompt, torch.float32)
    assert_close(step, ref_step, torch.float32)


def test_bidirectional_sliding_window_matches_eager():
    """A decoder made bidirectional (config.is_causal=False): |q - k| <= window, with padding."""
    eager, ours = models("mistral", is_causal=False)
    ids, mask = batch(True)
    with torch.no_grad():
        ref = eager.eval()(ids, attention_mask=mask).logits
        out = ours.eval()(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close(out[real], ref[real], torch.float32)


def test_masks_are_attngen_masks_not_dense_tensors():
    """transformers hands the layers attngen's mask objects: causal with padding, and the sliding
    window with the cache's offsets (positions 10..23 hold the keys, 20..23 the queries)."""
    keep = torch.ones(2, 24, dtype=torch.bool)
    keep[1, :12] = False
    m = hf.build_mask(2, 24, 24, mask_function=transformers.masking_utils.causal_mask_function,
                          attention_mask=keep)
    assert isinstance(m, hf.AttngenMask) and m.kv_len == 24 and m.window is None
    assert m.mask.variant == "causal(align='top_left') & key_padding"
    assert torch.equal(m.mask.terms()[1].values["keep"], keep)

    window = transformers.masking_utils.sliding_window_causal_mask_function(7)
    m = hf.build_mask(2, 4, 14, q_offset=20, kv_offset=10, mask_function=window, attention_mask=keep)
    assert m.kv_len == 14 and m.window == 7
    assert m.mask.variant == "sliding_window(align='bottom_right', two_sided=False) & key_padding"
    assert torch.equal(m.mask.terms()[1].values["keep"], keep[:, 10:24])

    # a static cache: 32 slots, 20 filled; the keys after the last query are cut
    m = hf.build_mask(2, 4, 32, q_offset=torch.tensor(16), mask_function=window, attention_mask=keep)
    assert m.kv_len == 20 and m.mask.variant == "sliding_window(align='bottom_right', two_sided=False) & key_padding"
    # no padding: no key_padding term
    m = hf.build_mask(2, 4, 24, q_offset=20, mask_function=window, attention_mask=torch.ones(2, 24))
    assert m.mask.variant == "sliding_window(align='bottom_right', two_sided=False)"


def test_dropout_is_attngens_with_the_layers_probability():
    """The layer's dropout goes to attngen.attention (torch's generator: the same seed, the same mask);
    in train mode a model with attention dropout gives other logits than in eval mode."""
    q, k, v = rand_qkv(2, 4, 2, 20, 20, 16, torch.float32)
    mask = hf.build_mask(2, 20, 20, mask_function=transformers.masking_utils.causal_mask_function)
    torch.manual_seed(3)
    out, weights = hf.attention_forward(None, q, k, v, mask, dropout=0.3, scaling=0.2)
    torch.manual_seed(3)
    ref = attngen.attention(q, k, v, mask="causal", dropout_p=0.3, scale=0.2)
    assert weights is None and out.shape == (2, 20, 4, 16) and out.is_contiguous()
    assert torch.equal(out, ref.transpose(1, 2))

    _, ours = models("llama", attention_dropout=0.3)
    ids, _ = batch(False)
    with torch.no_grad():
        assert rel_error(ours.train()(ids).logits, ours.eval()(ids).logits) > 1e-2


def test_unsupported_input_says_so():
    q, k, v = rand_qkv(1, 4, 2, 8, 8, 16, torch.float32)
    mask = hf.build_mask(1, 8, 8, mask_function=transformers.masking_utils.causal_mask_function)
    with pytest.raises(NotImplementedError, match="packed sequences found from position_ids"):
        hf.build_mask(1, 8, 8, mask_function=transformers.masking_utils.packed_sequence_mask_function(
            torch.zeros(1, 8, dtype=torch.long)))
    with pytest.raises(TypeError, match="a prepared 4D attention_mask passed to the model is not supported"):
        hf.attention_forward(None, q, k, v, torch.zeros(1, 1, 8, 8))
    with pytest.raises(NotImplementedError, match="got no mask for a causal attention layer"):
        hf.attention_forward(None, q, k, v, None, is_causal=True)
    with pytest.raises(NotImplementedError, match="does not support s_aux"):
        hf.attention_forward(None, q, k, v, mask, s_aux=torch.zeros(4))
    with pytest.raises(NotImplementedError, match=r"output_attentions=True"):
        hf.attention_forward(None, q, k, v, mask, output_attentions=True)
    with pytest.raises(ValueError, match="sliding_window=4 but transformers built its mask with sliding window None"):
        hf.attention_forward(None, q, k, v, mask, sliding_window=4)

    # through a model: packed sequences (position_ids restarting inside a row, no attention mask), and
    # generate() with a static cache, which builds the masks before the forward
    _, ours = models("llama")
    ids = batch(False)[0]
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None].to(DEVICE)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        ours(ids[:1], position_ids=positions, use_cache=False)
    with pytest.raises(NotImplementedError, match=r"does not support generate\(\) with a static cache"):
        ours.eval().generate(ids, max_new_tokens=2, cache_implementation="static", pad_token_id=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_on_the_gpu_is_as_close_as_eager_in_bf16(name):
    """bf16 models on a 300-token left-padded batch: attngen's logits and gradients are no further
    from the fp32 eager model's than eager's own in bf16 (twice its error, plus a little)."""
    ids = torch.randint(3, VOCAB, (2, 300), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :PAD], mask[1, :PAD] = 0, 0
    eager, ours = models(name)
    exact = train_step(eager, ids, mask)
    results = {}
    for label, model in (("eager", eager), ("attngen", ours)):
        logits, grads = train_step(model.to(torch.bfloat16), ids, mask)
        results[label] = (logits[mask.bool()], torch.cat([g.flatten() for g in grads.values()]))
    want = (exact[0][mask.bool()], torch.cat([g.flatten() for g in exact[1].values()]))
    for i, what in enumerate(("logits", "gradients")):
        ours_err, eager_err = (rel_error(results[label][i], want[i]) for label in ("attngen", "eager"))
        assert ours_err <= 2 * eager_err + 1e-3, (what, ours_err, eager_err)
