"""What the tests share: the device, fresh inputs, poisoned outputs, one tolerance table, the
kernel-against-reference check, and the environment of a command-line run.

Imported explicitly (`from helpers import ...`): pyproject.toml puts tests/ on the path.
"""

import os
import sys

import torch

import attngen
from attngen.kernels.forward import attention_forward
from attngen.reference import TOLERANCE  # one table for the tests and the tuner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LSE_TOLERANCE = 1e-4  # the log-sum-exp is computed in fp32 whatever the input dtype

# bf16 tl.dot is wrong under the interpreter, so bf16 runs only on the GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def rand_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, device=DEVICE, generator=None):
    """Fresh random q, k, v (never zeros)."""
    def make(h, s):
        # drawn where the generator lives (a seeded CPU generator gives the same values on every device)
        where = generator.device if generator is not None else device
        return torch.randn(batch, h, s, head_dim, dtype=torch.float32, device=where, generator=generator).to(device, dtype)
    return make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def poisoned_like(q, return_lse=True):
    """Output buffers full of NaN: an element the kernel does not write fails the comparison."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device) if return_lse else None
    return out, lse


def rel_error(out, ref):
    ref = ref.to(torch.float64)
    out = out.to(torch.float64)
    denom = ref.norm()
    return ((out - ref).norm() / (denom if denom > 0 else 1)).item()


def assert_close(out, ref, dtype, lse=None, ref_lse=None):
    """Relative norm error within TOLERANCE[dtype]; NaN never passes; the LSE marks exactly the empty rows."""
    assert not torch.isnan(out).any(), "NaN in the output (or an element left unwritten)"
    err = rel_error(out, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3e} over {TOLERANCE[dtype]:.1e} for {dtype}"
    if lse is not None:
        assert not torch.isnan(lse).any(), "NaN in the LSE (or an element left unwritten)"
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "LSE -inf must mark exactly the empty rows"
        if (~empty).any():
            lse_err = rel_error(lse[~empty], ref_lse[~empty])
            assert lse_err <= LSE_TOLERANCE, f"LSE relative error {lse_err:.3e}"
        if empty.any():
            assert (out[empty] == 0).all(), "an empty row must give output 0"


def near_tie_rows(q, k, mask, topk, scale=None, exact_ties=False, margin=1e-6):
    """(B, Hq, Sq) bool: the rows of a top-k call where a visible score just below the topk-th
    largest lies within fp32 rounding of it (`margin` of the row's largest magnitude; a score's
    rounding error is nearer 1e-8 of it). The float64 reference tells the two apart and attngen's
    fp32 scores may not, so either selection is right there (on random floats a row of 90 scores
    has a near tie within 1e-6 about once in 10^5). With `exact_ties`, any other score within that
    distance counts, equal ones too: the interpreter's numpy matmul may round the columns of a tile
    apart. All False without top-k."""
    rows = torch.zeros(q.shape[:3], dtype=torch.bool, device=q.device)
    if topk is None or topk >= k.shape[2] or q.numel() == 0:
        return rows
    s = attngen.reference.scores(q.detach(), k.detach(), mask, scale=scale)
    kth = s.topk(topk, dim=-1).values[..., -1:]
    size = torch.where(torch.isfinite(s), s.abs(), 0).amax(-1, keepdim=True)
    near = ((s - kth).abs() <= margin * size) & torch.isfinite(kth)
    if exact_ties:
        return near.sum(-1) > 1
    return (near & (s < kth)).any(-1)


def rows_to_check(q, k, mask, topk, scale=None):
    """The rows a top-k check compares with the reference: all but its near ties (near_tie_rows),
    which random inputs make rare; a check that would leave out over a tenth of its rows fails
    instead."""
    near = near_tie_rows(q, k, mask, topk, scale)
    assert near.sum() <= 0.1 * near.numel() + 1, f"{int(near.sum())} of {near.numel()} rows have near ties"
    return ~near


def check_output(out, q, k, v, mask=None, *, lse=None, topk=None, **kwargs):
    """A call's output (and LSE) against the float64 reference, on all rows but a top-k call's near
    ties (rows_to_check). kwargs (scale) go to the reference."""
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True, topk=topk, **kwargs)
    rows = rows_to_check(q, k, mask, topk, kwargs.get("scale"))
    assert not torch.isnan(out).any(), "NaN in the output (or an element left unwritten)"
    if lse is None:
        assert_close(out[rows], ref[rows], q.dtype)
    else:
        assert not torch.isnan(lse).any(), "NaN in the LSE (or an element left unwritten)"
        assert_close(out[rows], ref[rows], q.dtype, lse[rows], ref_lse[rows])


def check_forward(q, k, v, mask=None, config=None, *, topk=None, tuning=None, **kwargs):
    """The forward kernel (at `config`, default the dispatcher's) on poisoned outputs, against the
    float64 reference (check_output); returns (out, lse). kwargs (scale) go to both."""
    config = config or attngen.dispatch.choose(q, k, v, mask, topk=topk).config
    out, lse = poisoned_like(q)
    attention_forward(q, k, v, mask, return_lse=True, topk=topk, config=config, out=out, lse=lse, tuning=tuning,
                      **kwargs)
    check_output(out, q, k, v, mask, lse=lse, topk=topk, **kwargs)
    return out, lse


def cli_env(tmp_path, **extra):
    """The environment of an `attngen` command run by a test: its own kernel cache and user registry,
    and no TRITON_INTERPRET (the commands' --interpret sets it)."""
    env = dict(os.environ, ATTNGEN_CACHE_DIR=str(tmp_path / "cache"), ATTNGEN_USER_REGISTRY=str(tmp_path / "reg"),
               PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env


def attngen_cmd(*args):
    """`python -m attngen ARGS` with this interpreter (run with cwd outside the source tree, so
    the installed attngen is the one imported)."""
    return [sys.executable, "-m", "attngen", *args]


# a user's mask template, as the README shows one
DILATED = """\
doc: |
  Dilated causal attention: a query sees every `dilation`-th key before it.
params:
  dilation: {type: int, min: 1, doc: distance between visible keys}
expr: "(kv_idx <= q_idx) & ((q_idx - kv_idx) % dilation == 0)"
"""


# a small forward search space for the interpreter, for tests of the tuner and of space files
GOOD_SPACE = """\
kernel: fwd
arch:
  interpreter:
    block_m: [16, 32]
    block_n: [16]
    num_warps: [4]
    num_stages: [1]
    use_tma: [false]
    warp_specialize: [false]
constraints:
  - {expr: "block_m * block_d <= 1024", why: too big for this test}
"""
