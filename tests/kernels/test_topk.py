"""Top-k softmax: the threshold kernels and the attention kernel against the float64 reference,
the tie rule, and bad arguments.

The threshold kernels find a row's threshold one of three ways (PATHS): "whole" (the row's key
blocks all fit in the sample, which is then exact), "sampled" (a small sample brackets the threshold
and one capture pass finds it) and "missed" (no margin around the sample's estimate, so rows miss
their bracket: topk_select flags their tiles, and topk_threshold redoes them with retries). Each
test passes its own TopkTuning. The tests parametrized over paths, masks and cases run one case of
each code path under the interpreter and every combination on the GPU machine (`on_cpu`).
"""

import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl

import attngen
from attngen.checks import check_qkv
from attngen.config import KernelConfig
from attngen.kernels import forward, topk
from attngen.kernels.launch import module_for
from attngen.kernels.topk import Thresholds, TopkTuning
from helpers import DEVICE, check_forward, check_output, poisoned_like, rand_qkv, rows_to_check
from masks_zoo import ZOO

PATHS = {
    "whole": TopkTuning(),  # a sample of 1024 scores covers these rows whole
    "sampled": TopkTuning(sample=32),  # two key blocks of 16
    "missed": TopkTuning(sample=32, margin=0.0),
}
FLT_MAX = 3.4028234663852886e38
MASKS = (None, "causal")


def on_cpu(cpu, **axes):
    """Parameters of every combination of the axes' values: those listed in `cpu` run everywhere,
    the rest carry the gpu marker (the GPU machine runs them all; the CPU suite keeps one case of
    each code path, under the interpreter)."""
    product = list(itertools.product(*axes.values()))
    assert set(cpu) <= set(product), set(cpu) - set(product)
    return [pytest.param(*values, marks=() if values in cpu else pytest.mark.gpu,
                         id="-".join(str(v) for v in values)) for values in product]


def thresholds_of(q, k, mask, topk_, config, tuning=TopkTuning(), scale=1.0, own=None):
    """The Thresholds of one call (mask a name, object or None)."""
    shape = check_qkv(q, k, k, kernel=True)
    bound, structure = forward.blocks(q, attngen.masks.as_mask(mask), shape, config)
    return Thresholds(q, k, bound, structure, shape, scale, topk_, config, tuning, own)


def run_keeping_buffers(thresholds, q, k):
    """thresholds.run(q, k), keeping its work buffers: (thr, lo, hi, area, counts, flags, work)."""
    kept = []
    real = thresholds.buffers

    def buffers(device, empty=False):
        kept.append(real(device, empty))
        return kept[-1]

    thresholds.buffers = buffers
    thresholds.run(q, k)
    return kept[-1]


def check_thresholds(q, k, v, mask, topk_, config, tuning=TopkTuning(), own=None):
    """The threshold kernels (at `own`, default threshold_config) and then the attention kernel on
    poisoned outputs, against the float64 reference (scale 1); returns the thresholds' work buffers."""
    shape = check_qkv(q, k, v, kernel=True)
    bound, structure = forward.blocks(q, attngen.masks.as_mask(mask), shape, config)
    thresholds = Thresholds(q, k, bound, structure, shape, 1.0, topk_, config, tuning, own)
    buffers = run_keeping_buffers(thresholds, q, k)
    out, lse = poisoned_like(q)
    forward.forward_launch(q, k, v, out, lse, buffers[0], bound, structure, shape, 1.0, config, False)()
    check_output(out, q, k, v, mask, lse=lse, topk=topk_, scale=1.0)
    return buffers


def exact_thresholds(scores, visible, thr, topk_):
    """Each row's threshold keeps exactly its scores >= its topk-th largest visible score."""
    scores = scores.masked_fill(~visible, float("-inf"))
    kth = scores.topk(topk_, dim=-1).values[..., -1:]
    return torch.equal((scores >= thr) & visible, (scores >= kth) & visible)


def integers(shape, seed, low=-2, high=3):
    """Small random integers as floats: exact scores, with many ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float().to(DEVICE)


# ---------------------------------------------------------------------------------------
# against the reference, on every path
# ---------------------------------------------------------------------------------------
CONFIGS = {
    "k1": (1, KernelConfig(32, 32, 4, 1)),
    "k8": (8, KernelConfig(16, 16, 4, 1)),
    "k8 tma": (8, KernelConfig(16, 16, 4, 1, use_tma=True)),  # both kernels load K through tensor descriptors
    "k40": (40, KernelConfig(32, 16, 4, 1)),  # causal: the first 40 rows see fewer than topk keys
    "k64": (64, KernelConfig(16, 32, 4, 1)),  # causal: the first 64 rows see fewer than topk keys
}


@pytest.mark.parametrize("path,case,mask", on_cpu(
    {*(("whole", "k8", m) for m in MASKS), *(("sampled", "k8", m) for m in MASKS),
     *(("missed", "k8", m) for m in MASKS), ("missed", "k8 tma", None), ("missed", "k8 tma", "causal"),
     ("sampled", "k1", "causal"), ("missed", "k1", None), ("sampled", "k40", "causal"), ("whole", "k40", None),
     ("missed", "k64", "causal"), ("sampled", "k64", None)},
    path=PATHS, case=CONFIGS, mask=MASKS))
def test_topk_matches_reference(path, case, mask):
    topk_, config = CONFIGS[case]
    q, k, v = rand_qkv(1, 2, 1, 70, 90, 16, torch.float32)
    check_forward(q, k, v, mask, config, topk=topk_, tuning=PATHS[path])


def test_a_row_with_a_near_tie_is_left_out_of_the_comparison():
    """Seeded inputs with one row whose 64th and 65th largest scores differ by 5.7e-9 (after the
    scale), below fp32's rounding: under the interpreter the kernels kept the 65th and the float64
    reference the 64th (relative error 3e-3; CI once drew such inputs). The checks leave out that
    row alone."""
    q, k, v = rand_qkv(1, 2, 1, 70, 90, 16, torch.float32, generator=torch.Generator().manual_seed(806))
    assert (~rows_to_check(q, k, None, 64)).nonzero().tolist() == [[0, 1, 8]]
    check_forward(q, k, v, None, CONFIGS["k64"][1], topk=64, tuning=PATHS["sampled"])


@pytest.mark.parametrize("path", on_cpu({("sampled",), ("missed",)}, path=PATHS))
def test_topk_with_ragged_lengths_gqa_and_fp16(path):
    q, k, v = rand_qkv(2, 4, 2, 37, 75, 24, torch.float16)
    check_forward(q, k, v, "causal", KernelConfig(16, 16, 4, 1), topk=5, tuning=PATHS[path])


@pytest.mark.parametrize("path,topk_,mask", on_cpu(
    {*(("whole", 7, m) for m in MASKS), *(("sampled", 7, m) for m in MASKS), *(("missed", 7, m) for m in MASKS),
     ("sampled", 1, None), ("missed", 1, "causal"), ("whole", 40, None), ("sampled", 40, "causal")},
    path=PATHS, topk_=[1, 7, 40], mask=MASKS))
def test_thresholds_are_exact_on_integer_scores(path, topk_, mask):
    """Small integer q and k give exact scores with many ties: each row's threshold must keep exactly
    the scores >= its topk-th largest (all visible scores where it sees fewer)."""
    q, k = integers((1, 1, 45, 16), topk_), integers((1, 1, 197, 16), topk_ + 1)
    result = thresholds_of(q, k, mask, topk_, KernelConfig(16, 16, 4, 1), PATHS[path]).run(q, k)
    thr, row_max = result[:45].view(1, 1, 45, 1), result[45:].view(1, 1, 45)
    scores = q @ k.transpose(-1, -2)  # the kernel compares unscaled scores when no modifier runs
    visible = torch.ones(45, 197, dtype=torch.bool, device=DEVICE)
    if mask == "causal":
        visible = visible.tril()
    assert exact_thresholds(scores, visible, thr, topk_)
    assert torch.equal(row_max, scores.masked_fill(~visible, float("-inf")).amax(-1))  # what the softmax subtracts


@pytest.mark.parametrize("path,mask", on_cpu({("sampled", None), ("missed", "causal")}, path=PATHS, mask=MASKS))
def test_topk_softmax_of_large_scores(path, mask):
    """Scores in the hundreds: the attention kernel's softmax subtracts each row's largest score,
    which the capture recorded, so nothing overflows (exp2 of an unshifted score would) or
    vanishes (a shift too far would leave the row's weights 0)."""
    q, k, v = rand_qkv(1, 2, 1, 40, 130, 16, torch.float32)
    check_forward(q * 12, k * 12, v, mask, KernelConfig(16, 16, 4, 1), topk=6, tuning=PATHS[path])


@pytest.mark.parametrize("path", on_cpu({("sampled",), ("missed",)}, path=PATHS))
def test_topk_after_score_modifiers_and_a_block_layout(path):
    """The k largest are taken among the visible, modified scores."""
    q, k, v = rand_qkv(1, 2, 2, 64, 80, 16, torch.float32)
    q = q * 3  # spread the scores so that the soft cap reorders nothing but still bends them
    mask = ZOO["block_sparse|sliding_window&softcap"](1, 2, 64, 80, DEVICE)
    check_forward(q, k, v, mask, KernelConfig(16, 16, 4, 1), topk=6, tuning=PATHS[path])


@pytest.mark.parametrize("path", list(PATHS))
def test_ties_at_the_kth_score_are_all_kept(path):
    """Keys repeated three times give scores tied in threes; topk=4 keeps the top group and the whole next one."""
    sq, sk, d = 20, 48, 16
    q, base, _ = rand_qkv(1, 1, 1, sq, sk // 3, d, torch.float32)
    k = base.repeat_interleave(3, dim=2)  # every score value appears exactly 3 times in a row
    v = torch.eye(sk, device=DEVICE).view(1, 1, sk, sk)  # output row = the softmax weights themselves
    q = torch.nn.functional.pad(q, (0, sk - d))  # zero columns: the same scores at v's head dim
    k = torch.nn.functional.pad(k, (0, sk - d))
    weights = attngen.reference.attention(q, k, v, topk=4)[0, 0]
    assert ((weights > 0).sum(-1) == 6).all()  # 3 + 3: the 4th largest ties with the 5th and 6th
    out, _ = check_forward(q, k, v, None, KernelConfig(16, 16, 4, 1), topk=4, tuning=PATHS[path])
    assert torch.equal(out[0, 0] > 0, weights > 0)


@pytest.mark.parametrize("path,mask", on_cpu({("sampled", None), ("missed", "causal")}, path=PATHS, mask=MASKS))
def test_thresholds_at_tiles_of_their_own(path, mask):
    """Threshold kernels at other tiles than the attention kernel's (`own`: threshold_config's
    choice on Hopper; given here), over a block structure of their own: exact where every score
    comes out the same at both tiles, as integer-valued ones do under the interpreter."""
    q, k = integers((1, 1, 45, 16), 5), integers((1, 1, 197, 16), 6)
    v = torch.randn(1, 1, 197, 16, device=DEVICE)
    own = KernelConfig(32, 16, 4, 1)
    assert thresholds_of(q, k, mask, 7, KernelConfig(16, 16, 4, 1), own=own).bm == 32
    check_thresholds(q, k, v, mask, 7, KernelConfig(16, 16, 4, 1), PATHS[path], own=own)


@pytest.mark.parametrize("path,mask", on_cpu({("sampled", "causal"), ("missed", None)}, path=PATHS, mask=MASKS))
def test_capture_areas_in_chunks(path, mask):
    """A call whose capture areas do not fit the area budget captures and selects chunk by chunk
    (3 query tiles a chunk here, the last chunk short); the flagged tiles of every chunk are redone."""
    config = KernelConfig(16, 16, 4, 1)
    q, k, v = rand_qkv(1, 2, 1, 64, 150, 16, torch.float32)  # 8 query tiles of 16 rows
    cap_w = topk.topk_sizes(9, 150, 16, PATHS[path]).cap_w
    small = dataclasses.replace(PATHS[path], area_floats=3 * 16 * cap_w)
    assert thresholds_of(q, k, mask, 9, config, small).chunk == 3
    check_forward(q, k, v, mask, config, topk=9, tuning=small)


def test_a_short_sample_is_doubled_to_an_eighth_of_the_row():
    """K=8 over 790 keys: a sample of 32 scores (expecting 0.3 of the 8 largest) is doubled twice,
    to 128, an eighth of the row (expecting 1.3)."""
    for tuning in (PATHS["sampled"], PATHS["missed"]):
        assert topk.topk_sizes(8, 790, 16, tuning).sample_w == 128
    q, k, v = rand_qkv(1, 1, 1, 13, 790, 16, torch.float32)
    check_forward(q, k, v, None, KernelConfig(16, 16, 4, 1), topk=8, tuning=PATHS["sampled"])


# ---------------------------------------------------------------------------------------
# the sample, the bracket and the capture, one case each
# ---------------------------------------------------------------------------------------
def test_selection_holds_as_little_of_a_row_as_it_needs():
    """topk_select searches the first quarter, half or three quarters of a capture area where its
    rows fit there (_select_fitted): query blocks that see 80, 192, 320 and 400 keys, captured whole
    in areas of 512, reach all four widths, and every threshold must keep exactly the scores >= the
    row's topk-th."""
    q, k = integers((1, 1, 64, 16), 11, -8, 9), integers((1, 1, 400, 16), 12, -8, 9)
    layout = torch.zeros(1, 1, 4, 25, dtype=torch.bool)
    for block, seen in enumerate((5, 12, 20, 25)):  # key blocks of 16
        layout[..., block, :seen] = True
    mask = attngen.block_sparse(layout.to(DEVICE), block_size=(16, 16))
    thresholds = thresholds_of(q, k, mask, 40, KernelConfig(16, 16, 4, 1))
    assert thresholds.cap_w == 512 and thresholds.group == 2
    thr, lo, hi, area, counts, flags, work = run_keeping_buffers(thresholds, q, k)
    assert counts[0::2].tolist() == [n for n in (80, 192, 320, 400) for _ in range(16)]  # captured
    assert int(flags.sum()) == 0  # no retries: topk_select set every threshold
    visible = layout.repeat_interleave(16, 2).repeat_interleave(16, 3)[0, 0].to(DEVICE)
    scores = (q @ k.transpose(-1, -2)).view(64, 400)
    assert exact_thresholds(scores, visible, thr[:64].view(64, 1), 40)


@pytest.mark.parametrize("margin,case", on_cpu({(0.0, "k8"), (5.5, "k20 causal"), (5.5, "k150 ties")},
                                               margin=[5.5, 0.0], case=["k8", "k20 causal", "k150 ties"]))
def test_bracket_from_the_sample_candidates(margin, case):
    """A sample of 8 key blocks (7 sampled over 25 blocks): a column samples more scores than the 3
    it keeps, so the bracket's ends come from bounds of the sampled counts; at K=150 (blocks of 64
    keys, enough candidates for its lo end) the hi end is finite. Without a margin, rows miss and
    retry."""
    topk_, mask, integer, block_n, q_len = {"k8": (8, None, False, 16, 13), "k20 causal": (20, "causal", False, 16, 64),
                                            "k150 ties": (150, None, True, 64, 13)}[case]
    kv_len = 25 * block_n - 7  # 25 key blocks, the last one short
    tuning = TopkTuning(sample=8 * block_n, margin=margin)
    assert topk.topk_sizes(topk_, kv_len, block_n, tuning).sample_w == 8 * block_n
    if topk_ == 150:
        assert topk.bracket_ranks(topk_, kv_len, block_n, 8 * block_n, tuning)[2] >= 1  # a finite hi end
    q, k, v = rand_qkv(1, 1, 1, q_len, kv_len, 16, torch.float32)
    if integer:  # scores of small integers: many ties
        q, k = q.round(), k.round()
    check_forward(q, k, v, mask, KernelConfig(16, block_n, 4, 1), topk=topk_, tuning=tuning)


@pytest.mark.parametrize("share", [0.01, 0.05])
def test_bracket_hi_end_only_where_its_rank_is_a_share_of_the_sample(share):
    """K=150 over 25 key blocks of 64, 7 of them sampled (448 scores): the hi end's rank, 10, is
    2.2% of the sample, so topk_bracket gives every row a finite hi at a share of 1% and none at
    5% (each such tile then runs the capture without the count above hi); the thresholds are
    exact either way."""
    tuning = TopkTuning(sample=8 * 64, hi_share=share)
    rank_hi = topk.bracket_ranks(150, 25 * 64 - 7, 64, 8 * 64, tuning)[2]
    assert rank_hi == (10 if share == 0.01 else 0)
    q, k, v = rand_qkv(1, 1, 1, 13, 25 * 64 - 7, 16, torch.float32)
    hi = check_thresholds(q, k, v, None, 150, KernelConfig(16, 64, 4, 1), tuning)[2]
    assert bool(torch.isfinite(hi).all()) if rank_hi else bool((hi == float("inf")).all())


@pytest.mark.parametrize("margin", on_cpu({(5.5,), (0.0,)}, margin=[5.5, 0.0]))
def test_one_capture_launch_takes_tiles_with_and_without_a_hi_end(margin):
    """K=80 over 8 key blocks of 32, 4 of them sampled: the full rows' bracket has a hi end (rank
    14), so the capture is one launch, with the count above hi, for every tile; under a causal mask
    the first query tiles see too few keys for a hi end (they are captured whole), and that launch
    takes them too. The thresholds are exact either way, and with no margin (rows that miss,
    retried) too."""
    tuning = TopkTuning(sample=4 * 32, margin=margin)
    if margin:
        assert topk.bracket_ranks(80, 256, 32, 4 * 32, tuning)[2] == 14
        assert topk.topk_sizes(8, 256, 32, tuning).captures == ((False, False), (True, False))  # no hi end at K=8
    assert topk.topk_sizes(80, 256, 32, tuning).captures == ((True, True),)
    q, k, v = rand_qkv(1, 1, 1, 256, 256, 16, torch.float32)
    config = KernelConfig(16, 32, 4, 1)
    thresholds = thresholds_of(q, k, "causal", 80, config, tuning)
    captures = [launch.options for launch, _, _ in thresholds.launches if launch.kernel.fn.__name__ == "topk_capture"]
    assert [(o["HAS_HI"], o["ALL_TILES"]) for o in captures] == [(True, True)]
    hi = check_thresholds(q, k, v, "causal", 80, config, tuning)[2]
    hi_tiles = torch.isfinite(hi).view(-1, 16).any(1)
    if margin:
        assert hi_tiles.tolist() == [False] * 8 + [True] * 8  # tiles of 8 or fewer key blocks are captured whole


@pytest.mark.parametrize("topk_,area", [(40, None), (4, 64)], ids=["lo's rank", "a narrow area"])
def test_causal_tiles_sample_as_their_candidates_and_area_allow(topk_, area):
    """Under a causal mask a query tile sees fewer key blocks than the longest rows, which the sample
    is sized for (here 8 of 20 blocks of 16). K=40: tiles of 9, 11, 13 or 15 blocks, sampled every
    second block, would rank lo past their 48 candidates (lo = -FLT_MAX: the whole row captured; at
    B=4 H=16 S=4096 K=256 on an H200, 964 tiles overflowed and the call took 50.6 ms); they must
    sample sparser. An area of 64 (narrower than the sample; a margin of 3 sizes it so): tiles of 5
    to 8 blocks, which the sample would cover whole, must be sampled. The last row of every other
    tile must get a finite lo, of a covered one -FLT_MAX, and every threshold must keep exactly the
    row's topk largest."""
    tuning = TopkTuning(sample=128) if area is None else TopkTuning(sample=128, margin=3.0)
    sizes = topk.topk_sizes(topk_, 320, 16, tuning)
    assert sizes.sample_w == 128 and (area is None or sizes.cap_w == area)
    q, k = integers((1, 1, 320, 16), topk_, -3, 4), integers((1, 1, 320, 16), topk_ + 1, -3, 4)
    thresholds = thresholds_of(q, k, "causal", topk_, KernelConfig(16, 16, 4, 1), tuning)
    thr, lo, hi, area_, counts, flags, work = run_keeping_buffers(thresholds, q, k)
    last = lo[15::16]  # the last row of each query tile, which sees all of its key blocks
    covered = [blocks <= sizes.sample_w // 16 and blocks * 16 <= sizes.cap_w for blocks in range(1, 21)]
    assert 0 < sum(covered) < 20
    assert [bool(x) for x in last == -FLT_MAX] == covered
    visible = torch.ones(320, 320, dtype=torch.bool, device=DEVICE).tril()
    assert exact_thresholds((q @ k.transpose(-1, -2)).view(320, 320), visible, thr[:320].view(320, 1), topk_)
    if area is None:
        assert int(flags.sum()) == 0  # no tile needed retries (an area of 64 overflows on long rows)


# ---------------------------------------------------------------------------------------
# through the public API
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", MASKS)
def test_topk_over_the_key_length_keeps_every_visible_key(mask):
    q, k, v = rand_qkv(1, 2, 1, 70, 90, 16, torch.float32)
    check_forward(q, k, v, mask, KernelConfig(16, 32, 4, 1), topk=300)


def test_topk_at_or_over_the_key_length_is_plain_softmax():
    q, k, v = rand_qkv(1, 2, 2, 30, 40, 16, torch.float32)
    plain = attngen.attention(q, k, v, mask="causal")
    assert torch.equal(attngen.attention(q, k, v, mask="causal", topk=40), plain)
    assert torch.equal(attngen.attention(q, k, v, mask="causal", topk=10_000), plain)
    assert "topk" not in attngen.explain(q, k, v, mask="causal", topk=40)


def test_dispatcher_names_the_topk_variant():
    q, k, v = rand_qkv(1, 2, 2, 30, 400, 16, torch.float32)
    text = attngen.explain(q, k, v, mask="causal", topk=40)
    assert "variant causal(align='top_left') & topk(64)" in text
    check_output(attngen.attention(q, k, v, mask="causal", topk=40), q, k, v, "causal", topk=40)


@pytest.mark.parametrize("topk_,error,message", [
    (0, ValueError, "topk must be >= 1"),
    (-3, ValueError, "topk must be >= 1"),
    (2.5, TypeError, "topk must be an int or None"),
    (True, TypeError, "topk must be an int or None"),
    (1025, ValueError, "topk=1025 is over the supported 1024"),
])
def test_bad_topk(topk_, error, message):
    q, k, v = rand_qkv(1, 1, 1, 8, 2000, 16, torch.float32)
    for fn in (attngen.attention, attngen.reference.attention):
        with pytest.raises(error, match=message):
            fn(q, k, v, topk=topk_)


# ---------------------------------------------------------------------------------------
# the selection's helpers, called from a test kernel
# ---------------------------------------------------------------------------------------
_HELPERS = module_for("topk", None)  # the rendered template's selection helpers
_load_part, _count_group, _extremes, _search_start, _refine = (
    _HELPERS._load_part, _HELPERS._count_group, _HELPERS._extremes, _HELPERS._search_start, _HELPERS._refine)


@triton.jit
def _selection_probe(VALS, N, T, R, OUT, W: tl.constexpr, WIDTH: tl.constexpr, EXTRA: tl.constexpr,
                     GROUP: tl.constexpr, GRID: tl.constexpr):
    """Per row of VALS (GROUP rows of W, the first N[row] written), held as the selection holds
    them (its first WIDTH places, and EXTRA more as a second part): the count of values >= T[row],
    then the bracket (lo, hi, c_lo, c_hi) after one counting round for rank R[row]."""
    rows = tl.arange(0, GROUP)
    n = tl.load(N + rows)
    r = tl.load(R + rows)
    a = _load_part(VALS, W, 0, n, GROUP, 0, WIDTH)
    b = None if EXTRA == 0 else _load_part(VALS, W, 0, n, GROUP, WIDTH, EXTRA)
    tl.store(OUT + rows, _count_group(a, b, tl.load(T + rows)).to(tl.float32))
    bottom, top_up = _extremes(a, b, tl.full([GROUP], -3.4028234663852886e38, dtype=tl.float32))
    lo, hi, c_lo, c_hi, valid = _search_start(bottom, top_up, n, r)
    lo, hi, c_lo, c_hi = _refine(a, b, r, lo, hi, c_lo, c_hi, GRID)
    tl.store(OUT + GROUP + rows, lo)
    tl.store(OUT + 2 * GROUP + rows, hi)
    tl.store(OUT + 3 * GROUP + rows, c_lo.to(tl.float32))
    tl.store(OUT + 4 * GROUP + rows, c_hi.to(tl.float32))


@pytest.mark.skipif(DEVICE == "cuda", reason="a helper test: the interpreter runs it on any machine")
@pytest.mark.parametrize("stride,width,extra", [(256, 256, 0), (1024, 1024, 0), (1024, 512, 256), (512, 64, 0)])
def test_selection_counts_are_the_compares(stride, width, extra):
    # the selection counts values below a point by the sign of their difference (and two points a
    # sum), over a row held whole, in part, or in two parts (_select_fitted): the counts must equal
    # the float compares, at signed zeros, ties, extremes and -inf padding too
    group, grid = 4, 6
    g = torch.Generator().manual_seed(stride + width)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, FLT_MAX, -FLT_MAX, 1e-45, -1e-45])
    vals = torch.full((group, stride), float("-inf"))
    width += extra  # the places held
    n = torch.tensor([width, width - 3, width // 2, 5], dtype=torch.int32)
    for row in range(group):
        x = torch.randint(-3, 4, (int(n[row]),), generator=g).float()  # many ties
        if row < 3:
            x[: len(special)] = special
        if row == 1:
            x = torch.randn(int(n[row]), generator=g) * 1e-38  # tiny, with denormal differences
        vals[row, : int(n[row])] = x
    thresholds = torch.tensor([0.0, -0.0, 1.0, 2.5])
    ranks = torch.tensor([1, int(n[1]) // 3, int(n[2]), 3], dtype=torch.int32)
    out = torch.full((5 * group,), float("nan"))
    _selection_probe[(1,)](vals, n, thresholds, ranks, out, W=stride, WIDTH=width - extra, EXTRA=extra, GROUP=group,
                           GRID=grid)
    counts, lo, hi, c_lo, c_hi = out.view(5, group)
    for row in range(group):
        written = vals[row, : int(n[row])]
        assert counts[row] == (written >= thresholds[row]).sum(), row
        assert c_lo[row] == (written >= lo[row]).sum() >= ranks[row] > (written >= hi[row]).sum() == c_hi[row], row
        assert lo[row] < hi[row]
