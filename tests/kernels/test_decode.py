"""The decode kernels (split-KV over contiguous and paged KV caches) against the float64 reference:
fresh random inputs, ragged lengths (1 and lengths that are no multiple of a page or a tile),
GQA, several new tokens, every mask, poisoned outputs; the errors of bad caches, tables and lengths."""

import math

import pytest
import torch

import attngen
from attngen import decoding
from attngen.checks import Shape
from attngen.config import KernelConfig
from attngen.families import DECODE
from attngen.kernels import decode as decode_kernels
from attngen.kernels.decode import Cache, combine_rows, combine_tiles, decode_forward, split_count
from helpers import DEVICE, assert_close, poisoned_like
from masks_zoo import ZOO

# splits of at least 16 keys, 16-key tiles: the small caches here take several of both
CONFIG = KernelConfig(16, 16, 4, 1)
PAGE = 8


def make_case(batch, heads, kv_heads, q_len, capacity, dtype, lens, generator, head_dim=16):
    """q, a contiguous cache (B, Hkv, capacity, D) and its lengths, fresh random values."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)
    q = randn(batch, heads, q_len, head_dim)
    k, v = randn(batch, kv_heads, capacity, head_dim), randn(batch, kv_heads, capacity, head_dim)
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def paged(k, v, lens, generator, page=PAGE):
    """The same keys and values in a paged cache: the pages of all sequences shuffled into one pool
    with spare pages of noise, a block table with a spare column of -1 (pages no sequence uses)."""
    batch, kv_heads, capacity, d = k.shape
    per_seq = capacity // page
    n_pages = batch * per_seq + 5
    order = torch.randperm(n_pages, generator=generator)[:batch * per_seq].view(batch, per_seq)
    pool_k = torch.randn(n_pages, page, kv_heads, d, generator=generator).to(k.dtype).to(DEVICE)
    pool_v = torch.randn(n_pages, page, kv_heads, d, generator=generator).to(k.dtype).to(DEVICE)
    for b in range(batch):
        for j in range(per_seq):
            pool_k[order[b, j]] = k[b, :, j * page:(j + 1) * page].transpose(0, 1)
            pool_v[order[b, j]] = v[b, :, j * page:(j + 1) * page].transpose(0, 1)
    table = torch.cat([order, torch.full((batch, 1), -1)], dim=1).to(torch.int32).to(DEVICE)
    # the spare column is past every length: unused, so never read nor checked
    assert int(lens.max()) <= capacity
    return pool_k, pool_v, table


def run_checked(q, k, v, lens, table=None, mask=None, splits=None, config=CONFIG):
    """decode_forward on poisoned outputs against the float64 reference; returns (out, lse)."""
    out, lse = poisoned_like(q)
    decode_forward(q, k, v, lens, block_table=table, mask=mask, return_lse=True, config=config, splits=splits,
                   out=out, lse=lse)
    ref, ref_lse = attngen.reference.decode(q, k, v, lens, block_table=table, mask=mask, return_lse=True)
    assert_close(out, ref, q.dtype, lse, ref_lse)
    return out, lse


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("q_len,group", [(1, 1), (1, 4), (4, 2), (3, 1)])  # 3 rows: the combine's 4th is padding
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_reference(layout, q_len, group, splits, dtype):
    g = torch.Generator().manual_seed(q_len * 100 + group * 10 + (splits or 0))
    capacity = 6 * PAGE  # 48 keys
    lens = [capacity, q_len, 37]  # full, only the new tokens (1 with q_len 1), no multiple of a page or tile
    q, k, v, lens_t = make_case(3, 2 * group, 2, q_len, capacity, dtype, lens, g)
    if layout == "paged":
        k, v, table = paged(k, v, lens_t, g)
        run_checked(q, k, v, lens_t, table, splits=splits)
    else:
        run_checked(q, k, v, lens_t, splits=splits)


def test_many_splits_and_a_wide_head():
    """The combine kernel reads its splits in chunks and a head dim 32 columns a program: 37 splits
    (two chunks of 32, the last one partial), a head dim of 80 (the last column program partial),
    and a short sequence whose later splits see no key."""
    g = torch.Generator().manual_seed(37)
    q, k, v, lens = make_case(2, 4, 2, 1, 37 * 16 + 5, torch.float32, [37 * 16 + 5, 40], g, head_dim=80)
    assert combine_tiles(16, 128, 37) == (32, 32) and combine_tiles(16, 128, 4) == (32, 4)
    assert combine_tiles(128, 128, 37) == (32, 1) and combine_tiles(32, 128, 37) == (32, 4)
    assert combine_tiles(16, 64, 3) == (32, 4) and combine_tiles(4, 128, 37) == (32, 64)
    # the combine's rows: group * Sq as a power of two (Hq 32, Hkv 8: 4; 3 tokens of MHA: 4; MHA: 1)
    assert [combine_rows(Shape(1, hq, 8, sq, 64, 128)) for hq, sq in ((32, 1), (8, 3), (8, 1))] == [4, 4, 1]
    run_checked(q, k, v, lens, splits=37)


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_every_mask(name, layout):
    """Every built-in mask and combination, its positions counted from each sequence's end (the
    mask's tensors sized for the cache's capacity)."""
    g = torch.Generator().manual_seed(len(name))
    capacity = 8 * PAGE
    q, k, v, lens = make_case(2, 4, 2, 2, capacity, torch.float32, [capacity - 3, 29], g)
    table = None
    if layout == "paged":
        k, v, table = paged(k, v, lens, g)
        capacity = table.shape[1] * PAGE  # the spare column counts
    mask = ZOO[name](2, 4, capacity, capacity, DEVICE)
    run_checked(q, k, v, lens, table, mask=mask, splits=3)


@pytest.mark.parametrize("page", [PAGE, 16], ids=["rows look up their pages", "a tile is one page"])
def test_paged_is_bit_identical_to_contiguous(page):
    """One computation whatever the layout: the same keys through a block table give the same bits,
    whether each row reads its page number (pages smaller than a tile) or the tile is one page."""
    g = torch.Generator().manual_seed(5)
    q, k, v, lens = make_case(3, 4, 2, 1, 5 * 16, torch.float16, [80, 1, 23], g)
    pool_k, pool_v, table = paged(k, v, lens, g, page)
    for splits in (1, 4):
        contiguous = decode_forward(q, k, v, lens, config=CONFIG, splits=splits)[0]
        through_pages = decode_forward(q, pool_k, pool_v, lens, block_table=table, config=CONFIG, splits=splits)[0]
        assert torch.equal(contiguous, through_pages)


def test_pages_in_other_layouts_are_read_in_place():
    """An HND pool (num_pages, Hkv, page_size, D), passed as its (num_pages, page_size, Hkv, D)
    transpose, and K and V as two views of one (2, num_pages, ...) tensor (vLLM's kv_cache) give the
    bits of the NHD pool: the cache's strides are read, nothing is copied."""
    g = torch.Generator().manual_seed(8)
    q, k, v, lens = make_case(2, 4, 2, 1, 4 * PAGE, torch.float32, [32, 13], g)
    pool_k, pool_v, table = paged(k, v, lens, g)
    expected = decode_forward(q, pool_k, pool_v, lens, block_table=table, config=CONFIG, splits=2)[0]
    hnd_k, hnd_v = (x.transpose(1, 2).contiguous() for x in (pool_k, pool_v))
    got = decode_forward(q, hnd_k.transpose(1, 2), hnd_v.transpose(1, 2), lens, block_table=table, config=CONFIG,
                         splits=2)[0]
    assert torch.equal(got, expected)
    kv = torch.stack([pool_k, pool_v])
    assert torch.equal(decode_forward(q, kv[0], kv[1], lens, block_table=table, config=CONFIG, splits=2)[0], expected)


def test_gathered_rows_offsets_in_int64_give_the_same_bits(monkeypatch):
    """A paged cache whose elements all lie within 2**31 of its start computes the gathered rows'
    offsets in int32 (OFFSETS_32); a larger one in int64. Both read the same rows: the output is the
    same bit for bit when the span check is made to fail for a small cache."""
    g = torch.Generator().manual_seed(9)
    q, k, v, lens = make_case(2, 4, 2, 1, 4 * PAGE, torch.float32, [32, 13], g)
    pool_k, pool_v, table = paged(k, v, lens, g)
    fast = decode_forward(q, pool_k, pool_v, lens, block_table=table, config=CONFIG, splits=2)[0]
    monkeypatch.setattr(decode_kernels, "span", lambda t: 2 ** 31 + 1)
    wide = decode_forward(q, pool_k, pool_v, lens, block_table=table, config=CONFIG, splits=2)[0]
    assert torch.equal(fast, wide)


def test_which_caches_take_int32_offsets():
    """OFFSETS_32 exactly where every element of K and V is under 2**31 elements from the first (a
    paged cache; a contiguous one never needs it): shapes on the meta device, nothing allocated."""
    meta = dict(device="meta")
    q = torch.empty(2, 4, 1, 128, dtype=torch.bfloat16, **meta)
    lens = torch.empty(2, dtype=torch.int32, **meta)
    table = torch.empty(2, 256, dtype=torch.int32, **meta)
    most = 2 ** 31 // (16 * 2 * 128)  # pages of 16 rows x 2 heads x 128 that fit 2**31 elements exactly
    for pages, small in ((512, True), (most, True), (most + 1, False)):
        cache = torch.empty(pages, 16, 2, 128, dtype=torch.bfloat16, **meta)
        assert (decode_kernels.span(cache) <= 2 ** 31) is small
        shape, layout = decode_kernels.check_decode(q, cache, cache, lens, table, kernel=False)
        launch = decode_kernels.decode_launches(q, cache, cache, table, lens, q, None, None, shape, layout, 0.1,
                                                CONFIG, 4)[0]
        assert launch.options["OFFSETS_32"] is small, pages
    assert decode_kernels.span(torch.empty(3, 5, **meta).t()) == 15
    assert decode_kernels.span(torch.empty(0, 5, **meta)) == 0


@pytest.mark.parametrize("page", [1, 3, 16, 64])
def test_page_sizes(page):
    """Pages smaller than a tile, of an odd size, of a tile, and larger than a tile."""
    g = torch.Generator().manual_seed(page)
    capacity = 2 * 64 if page == 64 else 24 * page if page < 16 else 4 * page
    q, k, v, lens = make_case(2, 2, 1, 1, capacity, torch.float32, [capacity - 1, 5], g)
    pool_k, pool_v, table = paged(k, v, lens, g, page)
    run_checked(q, pool_k, pool_v, lens, table, splits=2)


def test_public_decode_matches_and_keeps_one_plan(monkeypatch):
    """attngen.decode: the dispatcher's config; new lengths and a new block table reuse the plan."""
    built = []
    real = decoding.DecodePlan

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decoding, "DecodePlan", counting)
    decoding._plans.clear()
    g = torch.Generator().manual_seed(9)
    q, k, v, lens = make_case(2, 4, 1, 1, 4 * PAGE, torch.float32, [32, 9], g)
    pool_k, pool_v, table = paged(k, v, lens, g)
    for new_lens in ([32, 9], [3, 31], [1, 1]):
        lens = torch.tensor(new_lens, dtype=torch.int32, device=DEVICE)
        table = table[torch.randperm(2, generator=g)]  # other pages for each sequence
        out, lse = attngen.decode(q, pool_k, pool_v, lens, block_table=table, mask="causal", scale=0.3,
                                  return_lse=True)
        ref, ref_lse = attngen.reference.decode(q, pool_k, pool_v, lens, block_table=table, mask="causal", scale=0.3,
                                                return_lse=True)
        assert_close(out, ref, q.dtype, lse, ref_lse)
    assert len(built) == 1
    # a contiguous cache without lengths: every sequence is full
    out = attngen.decode(q, k, v)
    assert_close(out, attngen.reference.decode(q, k, v), q.dtype)


def test_split_rule():
    """Two program slots per SM; the count whose waves times its share of keys (in whole tiles) is
    least, the fewest splits among ties; never splits shorter than config.block_m keys; none when
    the (sequence, head) pairs fill the GPU."""
    def splits(batch, kv_heads, capacity, block_m=256, sms=132, paged=False):
        shape = Shape(batch, kv_heads * 4, kv_heads, 1, capacity, 128)
        return split_count(shape, Cache(paged, 16 if paged else capacity, batch, capacity),
                           KernelConfig(block_m, 64, 4, 2), sms)
    # 256 of 264 slots, 2048 keys each (29: 232 slots, 2304 keys each; 33: 2048 keys, one split empty)
    assert splits(1, 8, 65536) == 32
    assert splits(8, 8, 8192) == 4  # 256 programs in one wave (5 would take two)
    assert splits(64, 8, 2048) == 1  # 512 (sequence, head) programs fill the GPU already
    assert splits(16, 8, 4096) == 2
    assert splits(1, 8, 1024) == 4  # 1024 keys: four splits of 256 at most
    assert splits(1, 8, 100) == 1
    assert splits(1, 1, 65536, block_m=4096) == 16  # at most 16 splits of 4096 keys
    # a paged cache: the same rule (two programs an SM, whatever more its kernel's registers allow)
    assert splits(1, 8, 65536, paged=True) == 32 and splits(8, 8, 8192, paged=True) == 4


def test_untuned_calls_take_the_split_or_the_full_defaults(clean_dispatch, tmp_path):
    """With no registry entry, a decode call whose (sequence, head) pairs fill the GPU takes
    DEFAULTS["decode_full"], a split one DEFAULTS["decode"] or, over a paged cache,
    DEFAULTS["decode_paged"] (sm_count: 4 under the interpreter, so 8 program slots; the GPU's own
    count on CUDA), and explain/choose says which row it was."""
    from attngen.config import DEFAULTS, arch_of
    from attngen.families import DECODE
    clean_dispatch.use_registry(tmp_path)  # empty: every call falls back
    sms = decode_kernels.sm_count(torch.device(DEVICE))
    full_batch = math.ceil(0.8 * sms)  # with 2 key/value heads: 80% of the 2 * sms slots
    cases = ((1, False, "decode"), (1, True, "decode_paged"), (full_batch, False, "decode_full"),
             (full_batch, True, "decode_full"))
    for batch, paged_cache, table in cases:
        q = torch.randn(batch, 4, 1, 64, device=DEVICE)
        shape = Shape(batch, 4, 2, 1, 320, 64)
        choice = attngen.dispatch.choose_config(DECODE, q, shape, None, paged=paged_cache)
        want = dict(DEFAULTS[table][arch_of(q.device)])[256 if arch_of(q.device) == "interpreter" else 128]
        assert choice.config == want and f"default {table} config" in choice.source, (batch, paged_cache, choice)
    k = torch.randn(1, 2, 300, 64, device=DEVICE)  # attngen.dispatch.choose: a contiguous cache
    assert "default decode config" in attngen.dispatch.choose(q[:1], k, k, kernel="decode").source


def test_a_tuned_entry_serves_contiguous_calls_and_paged_calls_take_the_defaults(clean_dispatch, tmp_path,
                                                                                  monkeypatch):
    """The tuner times contiguous caches: its decode entry runs contiguous calls, while a paged call
    takes the defaults (its gathered rows want other tiles), and both still match the reference."""
    from attngen.tuning import registry
    g = torch.Generator().manual_seed(5)
    q, k, v, lens = make_case(2, 4, 2, 1, 64, torch.float32, [64, 37], g)
    pool_k, pool_v, table = paged(k, v, lens, g)
    tuned = KernelConfig(64, 16, 2, 1)
    key = registry.EntryKey(variant="none", kernel="decode", dtype="fp32", head_dim=16, seq_bucket=64, group=2,
                            batch_bucket=2)
    gpu = attngen.dispatch.gpu_of(q.device)
    registry.write_entries(tmp_path / f"{gpu}.yaml", [registry.Entry(
        key=key, revision=DECODE.revision, config=tuned.as_dict(), ms=1.0, tflops=1.0, sdpa_ms=None, trials=3,
        triton="3.6.0", torch="2.13.0", date="2026-12-03")], gpu, "test")
    clean_dispatch.use_registry(tmp_path)
    used = []
    real = decoding.DecodePlan
    monkeypatch.setattr(decoding, "DecodePlan", lambda *a, **kw: used.append(a[10]) or real(*a, **kw))
    out = attngen.decode(q, k, v, lens)
    out_paged = attngen.decode(q, pool_k, pool_v, lens, block_table=table)
    shape_default = decode_kernels.default_table(Shape(2, 4, 2, 1, 64, 16), q.device, paged=True)
    from attngen.config import arch_of, default_config
    assert used == [tuned, default_config(shape_default, arch_of(q.device), 16)]
    for got in (out, out_paged):
        assert_close(got, attngen.reference.decode(q, k, v, lens), q.dtype)


def test_bad_values_never_read_outside_the_cache():
    """validate=False: lengths past the capacity count as the capacity, pages outside the cache as
    zeros (the reference's dense_cache does the same); nothing else is read."""
    g = torch.Generator().manual_seed(3)
    q, k, v, lens = make_case(2, 2, 1, 1, 4 * PAGE, torch.float32, [32, 20], g)
    pool_k, pool_v, table = paged(k, v, lens, g)
    long = torch.tensor([1000, 20], dtype=torch.int32, device=DEVICE)
    out = decode_forward(q, k, v, long, config=CONFIG, validate=False)[0]
    assert torch.equal(out, decode_forward(q, k, v, lens, config=CONFIG)[0])
    table[1, 0] = 10_000
    out = decode_forward(q, pool_k, pool_v, lens, block_table=table, config=CONFIG, validate=False)[0]
    assert_close(out, attngen.reference.decode(q, pool_k, pool_v, lens, block_table=table), q.dtype)


def _case():
    g = torch.Generator().manual_seed(0)
    q, k, v, lens = make_case(2, 4, 2, 1, 32, torch.float32, [32, 4], g)
    pool_k, pool_v, table = paged(k, v, lens, g)
    return dict(q=q, k=k, v=v, lens=lens, pool_k=pool_k, pool_v=pool_v, table=table)


BAD = {
    "length under Sq": (lambda c: attngen.decode(c["q"].expand(2, 4, 2, 16), c["k"], c["v"],
                                                 torch.tensor([32, 1], dtype=torch.int32, device=DEVICE)),
                        ValueError, r"seq_lens\[1\] = 1 must be between the 2 new tokens .* capacity 32"),
    "length past the cache": (lambda c: attngen.decode(c["q"], c["k"], c["v"], torch.tensor([33, 4], dtype=torch.int32, device=DEVICE)),
                              ValueError, r"seq_lens\[0\] = 33 must be between the 1 new tokens .* capacity 32"),
    "page outside the cache": (lambda c: attngen.decode(c["q"], c["pool_k"], c["pool_v"], c["lens"],
                                                        block_table=c["table"].masked_fill(c["table"] == c["table"][1, 0], 99)),
                               ValueError, r"block_table\[1, 0\] = 99 is not a page of the cache \(0..12\)"),
    "negative page in use": (lambda c: attngen.decode(c["q"], c["pool_k"], c["pool_v"], c["lens"],
                                                      block_table=torch.cat([c["table"][:, :1], -c["table"][:, 1:2] - 1,
                                                                             c["table"][:, 2:]], 1)),
                             ValueError, r"block_table\[0, 1\] = -\d+ is not a page of the cache"),
    "paged without lengths": (lambda c: attngen.decode(c["q"], c["pool_k"], c["pool_v"], block_table=c["table"]),
                              ValueError, "a paged cache needs seq_lens"),
    "float lengths": (lambda c: attngen.decode(c["q"], c["k"], c["v"], c["lens"].float()),
                      ValueError, r"seq_lens must be a \(2,\) int32 or int64 tensor"),
    "table of floats": (lambda c: attngen.decode(c["q"], c["pool_k"], c["pool_v"], c["lens"],
                                                 block_table=c["table"].float()),
                        TypeError, "block_table must hold int32 or int64 page numbers"),
    "table of another batch": (lambda c: attngen.decode(c["q"], c["pool_k"], c["pool_v"], c["lens"],
                                                        block_table=c["table"][:1]),
                               ValueError, r"block_table must have shape \(batch, pages per sequence\) = \(2, ...\)"),
    "3-d cache": (lambda c: attngen.decode(c["q"], c["k"][0], c["v"][0]), ValueError,
                  r"k_cache must have 4 dimensions \(batch, heads, seq_len, head_dim\)"),
    "cache dtype": (lambda c: attngen.decode(c["q"], c["k"].half(), c["v"].half()), TypeError,
                    "k_cache has dtype torch.float16 but q has torch.float32"),
    "other batch": (lambda c: attngen.decode(c["q"], c["k"][:1], c["v"][:1]), ValueError,
                    "k_cache has batch 1 but q has 2"),
    "heads": (lambda c: attngen.decode(c["q"][:, :3], c["k"], c["v"]), ValueError,
              "q has 3 heads, which is not a multiple of the cache's 2"),
    "too many rows": (lambda c: attngen.decode(c["q"].expand(2, 4, 65, 16), c["k"], c["v"]), ValueError,
                      "2 query heads of a key/value head times the 65 new tokens = 130 rows"),
    "grad": (lambda c: attngen.decode(c["q"].clone().requires_grad_(), c["k"], c["v"]), ValueError,
             "attngen.decode has no backward"),
    "validate flag": (lambda c: attngen.decode(c["q"], c["k"], c["v"], validate="no"), TypeError,
                      "validate must be a bool"),
    "scale": (lambda c: attngen.decode(c["q"], c["k"], c["v"], scale="big"), TypeError,
              "scale must be a float or None"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_clear_error(name):
    call, kind, message = BAD[name]
    with pytest.raises(kind, match=message):
        call(_case())


# ---------------------------------------------------------------------------------------------
# on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_bf16_decode_at_a_model_shape(layout):
    """bf16 (which the interpreter cannot run), Hq 32 / Hkv 8, D 128, ragged lengths, the
    dispatcher's config and split rule."""
    g = torch.Generator().manual_seed(1)
    q, k, v, lens = make_case(4, 32, 8, 1, 64 * 16, torch.bfloat16, [1024, 1, 777, 300], g, head_dim=128)
    table = None
    if layout == "paged":
        k, v, table = paged(k, v, lens, g, page=16)
    out = attngen.decode(q, k, v, lens, block_table=table)
    assert_close(out, attngen.reference.decode(q, k, v, lens, block_table=table), torch.bfloat16)


@pytest.mark.gpu
def test_a_decode_step_captured_in_a_cuda_graph():
    """A decode step captured once replays on new tokens, new lengths and a new block table (written
    into the captured tensors), without recompiling, and equals eager calls."""
    g = torch.Generator().manual_seed(2)
    q, k, v, lens = make_case(3, 8, 2, 1, 32 * PAGE, torch.float16, [256, 100, 7], g)
    pool_k, pool_v, table = paged(k, v, lens, g)
    attngen.decode(q, pool_k, pool_v, lens, block_table=table, mask="causal")  # compile outside the capture
    module = decode_kernels.module_for("decode", attngen.masks.as_mask("causal"))
    compiled = sum(len(c[0]) for c in module.decode_fwd.device_caches.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attngen.decode(q, pool_k, pool_v, lens, block_table=table, mask="causal")
    for step in range(3):
        q.copy_(torch.randn(q.shape, generator=g).to(q.dtype))
        lens.copy_(torch.tensor([256 - step, 100 + step * 50, 8 + step], dtype=torch.int32))
        table.copy_(table[torch.randperm(3, generator=g)])
        graph.replay()
        eager = attngen.decode(q, pool_k, pool_v, lens, block_table=table, mask="causal")
        assert torch.equal(out, eager)
        assert_close(out, attngen.reference.decode(q, pool_k, pool_v, lens, block_table=table, mask="causal"),
                     torch.float16)
    assert sum(len(c[0]) for c in module.decode_fwd.device_caches.values()) == compiled


# ---------------------------------------------------------------------------------------------
# attngen.attention with a short query runs on the decode kernels
@pytest.mark.parametrize("name", list(ZOO))
def test_short_attention_queries_take_the_decode_kernels(name, monkeypatch):
    """attention() of 3 query tokens without gradients: the decode kernels, with attention's own
    positions (q_idx from 0, top-left unless the mask says otherwise) and mask sizes, equal to the
    reference; the explanation names the decode kernel."""
    built = []
    real = decode_kernels.ShortQueryPlan

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attngen.api, "ShortQueryPlan", counting)
    attngen.api._plans.clear()  # no plan from an earlier test of the same signature
    attngen.api._tensor_plans.clear()
    g = torch.Generator().manual_seed(len(name) + 1)
    q, k, v, _ = make_case(2, 4, 2, 3, 45, torch.float32, [45, 45], g)
    mask = ZOO[name](2, 4, 3, 45, DEVICE)
    out, lse = attngen.attention(q, k, v, mask=mask, return_lse=True)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask=mask, return_lse=True)
    assert_close(out, ref, q.dtype, lse, ref_lse)
    assert built == [1]
    assert attngen.explain(q, k, v, mask=mask).startswith("decode kernel, variant ")


def test_which_attention_calls_take_the_decode_kernels():
    """A short query (<= 16 tokens, group * Sq <= 128 rows) without top-k, dropout or gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v, _ = make_case(1, 4, 2, 16, 40, torch.float32, [40], g)
    assert attngen.explain(q, k, v).startswith("decode kernel")
    assert attngen.explain(torch.cat([q, q[:, :, :1]], 2), k, v).startswith("fwd kernel")  # 17 tokens
    assert attngen.explain(q, k, v, topk=4).startswith("fwd kernel")
    assert attngen.explain(q.clone().requires_grad_(), k, v).startswith("fwd kernel")
    assert decode_kernels.takes_short_query(Shape(1, 4, 2, 16, 40, 16), 0, 0.0)
    assert not decode_kernels.takes_short_query(Shape(1, 4, 2, 16, 40, 16), 0, 0.1)  # dropout
    assert not decode_kernels.takes_short_query(Shape(1, 128, 1, 2, 40, 16), 0, 0.0)  # 256 rows


# ---------------------------------------------------------------------------------------------
# a seeded fuzz of attngen.decode
FUZZ_MASKS = ["none", "causal", "sliding_window", "alibi", "softcap", "document", "key_padding&causal",
              "chunked&causal&softcap"]
INVALID = {"length past the cache": r"seq_lens\[\d\] = \d+ must be between", "length under Sq": r"seq_lens\[\d\] = ",
           "page outside the cache": r"block_table\[\d, 0\] = \d+ is not a page", "head dims differ": "head dims differ"}


@pytest.mark.parametrize("chunk", range(2))
def test_fuzz(chunk):
    """60 random calls (shapes, GQA groups, 1-5 new tokens, head dims that are no power of two,
    contiguous caches read through a (B, S, Hkv, D) transpose or paged ones of odd page sizes,
    ragged lengths, masks, scale, return_lse), one in five made invalid on purpose: each either
    matches the float64 reference or raises a ValueError naming what is wrong."""
    import random

    for index in range(chunk * 30, chunk * 30 + 30):
        rng = random.Random(1000 + index)
        g = torch.Generator().manual_seed(index)
        batch, kv_heads, group = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 2, 4])
        q_len, head_dim = rng.randint(1, 5), rng.choice([8, 16, 24])
        dtype = rng.choice([torch.float32, torch.float16])
        page = rng.choice([1, 3, 8, 16])
        per_seq = rng.randint(1, 6) if page > 1 else rng.randint(5, 30)
        capacity = page * per_seq
        q_len = min(q_len, capacity)
        lens = [rng.randint(q_len, capacity) for _ in range(batch)]
        q, k, v, lens_t = make_case(batch, kv_heads * group, kv_heads, q_len, capacity, dtype, lens, g, head_dim)
        table = None
        if rng.random() < 0.5:
            k, v, table = paged(k, v, lens_t, g, page)
        elif rng.random() < 0.5:  # a (B, S, Hkv, D) cache read in place
            k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
        size = table.shape[1] * page if table is not None else capacity
        name = rng.choice(FUZZ_MASKS)
        mask = ZOO[name](batch, kv_heads * group, size, size, DEVICE)
        kwargs = dict(mask=mask, scale=rng.choice([None, 0.05, 1.3]), return_lse=rng.random() < 0.5)
        invalid = rng.choice(list(INVALID)) if rng.random() < 0.2 else None
        if invalid == "length past the cache":
            lens_t[rng.randrange(batch)] = size + rng.randint(1, 5)
        elif invalid == "length under Sq":
            lens_t[rng.randrange(batch)] = q_len - 1
        elif invalid == "page outside the cache":
            if table is None:
                invalid = None
            else:
                table[rng.randrange(batch), 0] = k.shape[0] + rng.randint(0, 3)
        elif invalid == "head dims differ":
            q = q[..., :-1]
        what = f"case {index}: B {batch} Hkv {kv_heads} group {group} Sq {q_len} D {head_dim} {dtype} " \
               f"{'paged' if table is not None else 'contiguous'} page {page} lens {lens_t.tolist()} mask {name} " \
               f"{kwargs} invalid {invalid}"
        if invalid is not None:
            with pytest.raises(ValueError, match=INVALID[invalid]):
                attngen.decode(q, k, v, lens_t, block_table=table, **kwargs)
            continue
        got = attngen.decode(q, k, v, lens_t, block_table=table, **kwargs)
        ref = attngen.reference.decode(q, k, v, lens_t, block_table=table, **kwargs)
        try:
            if kwargs["return_lse"]:
                assert_close(got[0], ref[0], dtype, got[1], ref[1])
            else:
                assert_close(got, ref, dtype)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
