"""Shared test setup: the device, fresh inputs, poisoned outputs and one tolerance table.

Without CUDA every kernel runs under Triton's interpreter on CPU tensors; with CUDA the same
tests run the compiled kernels on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first loaded

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from attngen.reference import TOLERANCE  # noqa: E402  (one table for the tests and the tuner)

LSE_TOLERANCE = 1e-4  # the log-sum-exp is computed in fp32 whatever the input dtype

# bf16 tl.dot is wrong under the interpreter, so bf16 runs only on the GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rand_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, device=DEVICE, generator=None):
    """Fresh random q, k, v (never zeros)."""
    def make(h, s):
        return torch.randn(batch, h, s, head_dim, dtype=torch.float32, device=device, generator=generator).to(dtype)
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


@pytest.fixture(autouse=True)
def _template_dirs_isolated():
    """Folders registered by one test are gone for the next."""
    from attngen import masks

    saved = list(masks._user_dirs)
    yield
    masks._user_dirs[:] = saved
    masks._templates = None
