"""The direct launch of compiled kernels (attngen.kernels.launch.DirectLaunch): on the CPU its
decisions, with a stand-in for the kernel Triton compiles (the interpreter compiles nothing); on
the GPU, that it is taken and gives Triton's own path's outputs bit for bit."""

from types import SimpleNamespace

import pytest
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import attngen
from attngen.checks import check_qkv
from attngen.config import KernelConfig
from attngen.kernels import forward, launch
from attngen.kernels.launch import DirectLaunch, direct_launch, direct_launches
from helpers import assert_close, poisoned_like, rand_qkv
from masks_zoo import doc_ids


class FakeLauncher:
    """Triton's launcher object (CudaLauncher) as the direct launch sees it: called, it would
    allocate `scratch` bytes and call its C function `launch`, which takes the cooperative-grid and
    PDL flags and the two scratch buffers after the function. Both record the launch in `launches`
    as the object's call has it (grid, stream, function, kernel metadata, launch metadata, hooks,
    arguments), and where it went in `entries` (with the C function's flags and scratch)."""

    def __init__(self, launches, scratch=0):
        self.launches, self.entries = launches, []
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, *args):
        self.entries.append("object")
        self.launches.append(args)

    def launch(self, *args):
        self.entries.append(("function", args[5:9]))
        self.launches.append(args[:5] + args[9:])


class FakeCompiled(CompiledKernel):
    """A compiled kernel that records its launches instead of running them."""

    def __init__(self, scratch=0):
        self.launches = []
        self.function, self.packed_metadata = "function", "metadata"
        self.metadata = SimpleNamespace(target=GPUTarget("cuda", 90, 32))
        self._run = FakeLauncher(self.launches, scratch)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA as the direct launch sees it: the current device (`device` of the returned namespace)
    and its current stream (1000 + device); runners that keep compiled kernels."""
    state = SimpleNamespace(device=0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state.device, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    monkeypatch.setattr(launch, "interpreter_on", lambda: False)
    previous = direct_launch(True)
    yield state
    direct_launch(previous)


def _prepared():
    """A forward launch on fp32 CPU tensors (B1 H2 Sq20 Sk30 D16) of the forward kernel's JITFunction."""
    q, k, v = rand_qkv(1, 2, 2, 20, 30, 16, torch.float32)
    shape = check_qkv(q, k, v, kernel=True)
    config = KernelConfig(16, 16, 4, 1)
    bound, structure = forward.blocks(q, None, shape, config)
    out, lse = poisoned_like(q)
    prepared = forward.forward_launch(q, k, v, out, lse, None, bound, structure, shape, 0.25, config, False,
                                      dropout_p=0.1, seed=3)
    if isinstance(prepared.kernel, InterpretedFunction):  # the JITFunction that CUDA would have
        prepared.kernel = JITFunction(prepared.kernel.fn, **prepared.kernel.kwargs)
    return prepared


class Paths:
    """A runner of `prepared` whose Triton path is recorded (and returns `compiled`), with the
    changing arguments `names`; `take(*values)` says which path a call took."""

    def __init__(self, prepared, names=("Q", "O", "LSE", "seed"), variants=None, scratch=0):
        self.compiled, self.triton = FakeCompiled(scratch), []

        def triton_path(*args, **options):
            self.triton.append((args, options))
            return self.compiled

        prepared._launch = triton_path
        self.prepared, self.run = prepared, prepared.runner(*names, variants=variants)

    def take(self, *values, variant=0) -> str:
        before = (len(self.triton), len(self.compiled.launches))
        self.run(*values, variant=variant)
        after = (len(self.triton), len(self.compiled.launches))
        assert after[0] + after[1] == before[0] + before[1] + 1  # one launch either way
        return "triton" if after[0] > before[0] else "direct"


def _tensors(q):
    """Fresh (q, out, lse)-like tensors of the prepared launch's shapes, 16-byte aligned."""
    out, lse = poisoned_like(q)
    return torch.randn_like(q), out, lse


def _misaligned(t):
    """`t`'s values in a view whose base pointer is 4 bytes past a 16-byte boundary."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


def test_later_calls_launch_the_kept_kernel_with_tritons_arguments(fake_cuda):
    """The first call takes Triton's path and keeps its compiled kernel; later ones go straight to it
    with every argument JITFunction.run binds, in signature order (constexprs included; tensors as
    their addresses), on the current stream, with no launch hooks."""
    prepared = _prepared()
    paths = Paths(prepared)
    q = prepared.values[prepared.names.index("Q")]
    assert paths.take(*_tensors(q), 5) == "triton"
    q2, out2, lse2 = _tensors(q)
    taken = direct_launches()
    assert paths.take(q2, out2, lse2, 7) == "direct"
    assert direct_launches() == taken + 1
    (launched,) = paths.compiled.launches
    grid = (2, 2, 1)  # ceil(20 / 16) query blocks, B * H
    assert launched[:9] == (*grid, 1000, "function", "metadata", None, None, None)
    given = dict(zip(prepared.names, prepared.values), **prepared.options, Q=q2, O=out2, LSE=lse2, seed=7)
    want = [given[name] for name in prepared.kernel.arg_names]
    assert len(launched[9:]) == len(want)
    assert [got for got in launched[9:] if isinstance(got, torch.Tensor)] == []
    assert all(got == (w.data_ptr() if isinstance(w, torch.Tensor) else w) for got, w in zip(launched[9:], want))


@pytest.mark.parametrize("scratch", [0, 128])
def test_the_launchers_c_function_is_called_where_no_scratch_is_needed(fake_cuda, scratch):
    """Without scratch memory the launcher object's step is skipped: its C function gets the
    launcher's flags (cooperative grid, PDL) and no scratch buffers; a kernel that needs scratch
    goes through the object, which allocates it."""
    prepared = _prepared()
    paths = Paths(prepared, scratch=scratch)
    q = prepared.values[prepared.names.index("Q")]
    assert paths.take(*_tensors(q), 5) == "triton"
    assert paths.take(*_tensors(q), 5) == "direct"
    entries = paths.compiled._run.entries
    assert entries == (["object"] if scratch else [("function", (False, True, None, None))])


def test_the_seed_never_leaves_the_direct_path(fake_cuda):
    """The forward kernel does not specialise on its seed (do_not_specialize): every seed, 1 and
    multiples of 16 included, is launched directly."""
    prepared = _prepared()
    paths = Paths(prepared)
    q = prepared.values[prepared.names.index("Q")]
    assert paths.take(*_tensors(q), 5) == "triton"
    assert [paths.take(*_tensors(q), seed) for seed in (1, 16, 0, 2**31 - 2)] == ["direct"] * 4


def test_a_call_that_specialises_otherwise_takes_tritons_path(fake_cuda):
    """Triton compiles another kernel for it: a misaligned tensor, a specialised int now 1, a
    multiple of 16 or another width; the kept kernel still serves the calls that fit."""
    prepared = _prepared()
    paths = Paths(prepared, names=("Q", "O", "LSE", "group"))  # group: a specialised int
    q = prepared.values[prepared.names.index("Q")]
    assert paths.take(*_tensors(q), 2) == "triton"
    q2, out2, lse2 = _tensors(q)
    assert paths.take(_misaligned(q2), out2, lse2, 2) == "triton"
    assert paths.take(q2, out2, _misaligned(lse2), 2) == "triton"
    assert paths.take(q2, out2, lse2, 1) == "triton"
    assert paths.take(q2, out2, lse2, 32) == "triton"
    assert paths.take(q2, out2, lse2, 2**40) == "triton"
    assert paths.take(q2, out2, lse2, 3) == "direct"
    assert len(paths.compiled.launches) == 1  # the kernel kept is the first call's


def test_a_misaligned_first_call_keeps_nothing(fake_cuda):
    prepared = _prepared()
    paths = Paths(prepared)
    q = prepared.values[prepared.names.index("Q")]
    q2, out2, lse2 = _tensors(q)
    assert paths.take(_misaligned(q2), out2, lse2, 5) == "triton"
    assert paths.take(q2, out2, lse2, 5) == "triton"  # this one is kept
    assert paths.take(q2, out2, lse2, 5) == "direct"


def _hook(*args):
    pass


BREAKS = {  # name -> what makes Triton's launch do more than a direct one can (undone by monkeypatch)
    "launch enter hook added": lambda mp, kernel: mp.setattr(knobs.runtime.launch_enter_hook, "calls", [_hook]),
    "launch exit hook added": lambda mp, kernel: mp.setattr(knobs.runtime.launch_exit_hook, "calls", [_hook]),
    "launch enter hook set": lambda mp, kernel: mp.setattr(knobs.runtime, "launch_enter_hook", _hook),
    "launch exit hook set": lambda mp, kernel: mp.setattr(knobs.runtime, "launch_exit_hook", _hook),
    "pre-run hook": lambda mp, kernel: mp.setattr(kernel, "pre_run_hooks", [_hook]),
    "debug": lambda mp, kernel: mp.setattr(knobs.runtime, "debug", True),
    "instrumentation": lambda mp, kernel: mp.setattr(knobs.compilation, "instrumentation_mode", "consan"),
    "direct launch off": lambda mp, kernel: mp.setattr(launch, "_direct_launch", False),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_hooks_debug_and_the_switch_take_tritons_path(fake_cuda, monkeypatch, name):
    prepared = _prepared()
    paths = Paths(prepared)
    q = prepared.values[prepared.names.index("Q")]
    assert paths.take(*_tensors(q), 5) == "triton"
    with monkeypatch.context() as mp:
        BREAKS[name](mp, prepared.kernel)
        assert paths.take(*_tensors(q), 5) == "triton"
    assert not knobs.runtime.launch_enter_hook.calls and not prepared.kernel.pre_run_hooks
    assert paths.take(*_tensors(q), 5) == "direct"


def test_another_current_device_takes_tritons_path(fake_cuda):
    prepared = _prepared()
    paths = Paths(prepared)
    q = prepared.values[prepared.names.index("Q")]
    assert paths.take(*_tensors(q), 5) == "triton"
    fake_cuda.device = 1
    assert paths.take(*_tensors(q), 5) == "triton"
    fake_cuda.device = 0
    assert paths.take(*_tensors(q), 5) == "direct"
    assert paths.compiled.launches[-1][3] == 1000  # device 0's stream


def test_each_variant_keeps_its_own_kernel(fake_cuda):
    prepared = _prepared()
    tma = dict(prepared.options, USE_TMA=True)
    paths = Paths(prepared, variants=[prepared.options, tma])
    q = prepared.values[prepared.names.index("Q")]
    assert paths.take(*_tensors(q), 5) == "triton"
    assert paths.take(*_tensors(q), 5, variant=1) == "triton"
    assert paths.triton[-1][1] == tma
    assert paths.take(*_tensors(q), 5, variant=1) == "direct"
    use_tma = paths.prepared.kernel.arg_names.index("USE_TMA")
    assert paths.compiled.launches[-1][9 + use_tma] is True


def test_a_kept_launch_holds_no_calls_tensors(fake_cuda):
    prepared = _prepared()
    q = prepared.values[prepared.names.index("Q")]
    slots = [prepared.names.index(n) for n in ("Q", "O", "LSE", "seed")]
    args = list(prepared.values)
    for slot, value in zip(slots, (*_tensors(q), 5)):
        args[slot] = value
    direct = DirectLaunch.keep(prepared.kernel, FakeCompiled(), prepared.grid, prepared.names, args, slots,
                               prepared.options)
    assert [direct.args[i] for i in direct.slots] == [None] * 4
    assert DirectLaunch.keep(prepared.kernel, None, prepared.grid, prepared.names, args, slots,
                             prepared.options) is None  # nothing compiled came back


def test_other_triton_versions_take_tritons_path(fake_cuda, monkeypatch):
    monkeypatch.setattr(launch, "triton_protocol", lambda: None)
    prepared = _prepared()
    paths = Paths(prepared)
    q = prepared.values[prepared.names.index("Q")]
    assert [paths.take(*_tensors(q), 5) for _ in range(3)] == ["triton"] * 3


def test_the_interpreter_keeps_nothing():
    """Under Triton's interpreter the launches run as before; the direct path is CUDA's only."""
    if not launch.interpreter_on():
        pytest.skip("runs under Triton's interpreter")
    q, k, v = rand_qkv(1, 2, 2, 20, 30, 16, torch.float32)
    taken = direct_launches()
    for _ in range(2):
        out = attngen.attention(q, k, v, mask="causal")
    assert direct_launches() == taken
    assert_close(out, attngen.reference.attention(q, k, v, mask="causal"), torch.float32)


def test_direct_launch_switch():
    previous = direct_launch()
    try:
        assert direct_launch(False) is previous
        assert direct_launch() is False
        assert direct_launch(True) is False and direct_launch() is True
        with pytest.raises(TypeError, match=r"enabled must be True, False or None, got 0"):
            direct_launch(0)
    finally:
        direct_launch(previous)


# ---------------------------------------------------------------------------------------
# on the GPU: the direct path is taken and gives Triton's path's outputs
# ---------------------------------------------------------------------------------------
def _masks(batch, kv_len):
    return {"dense": None, "causal": "causal", "sliding_window": attngen.mask("sliding_window", window=64),
            "document": attngen.mask("document", doc_ids=doc_ids(batch, kv_len, "cuda")), "dropout": None}


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "causal", "sliding_window", "document", "dropout"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_direct_launch_gives_tritons_outputs(case, dtype):
    q, k, v = rand_qkv(2, 4, 2, 200, 300, 64, dtype, device="cuda")
    mask = _masks(2, 300)[case]
    dropout_p = 0.2 if case == "dropout" else 0.0

    def call():
        torch.manual_seed(11)  # the same dropout seed every time
        return attngen.attention(q, k, v, mask=mask, dropout_p=dropout_p, return_lse=True)

    previous = direct_launch(False)
    try:
        want = call()
        direct_launch(True)
        call()  # Triton's path, where the plan's runner keeps the compiled kernel
        taken = direct_launches()
        got = call()
        assert direct_launches() == taken + 1
    finally:
        direct_launch(previous)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if not dropout_p:
        ref, ref_lse = attngen.reference.attention(q, k, v, mask=mask, return_lse=True)
        assert_close(got[0], ref, dtype, got[1], ref_lse)


@pytest.mark.gpu
def test_misaligned_views_take_tritons_path_and_stay_right():
    q, k, v = rand_qkv(1, 8, 8, 128, 128, 64, torch.bfloat16, device="cuda")
    previous = direct_launch(True)
    try:
        for _ in range(2):
            attngen.attention(q, k, v, mask="causal")  # keeps the kernel of aligned calls
        buffer = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
        q_misaligned = buffer[1:].view(q.shape)  # 2 bytes past a 16-byte boundary, same strides
        q_misaligned.copy_(q)
        taken = direct_launches()
        got = attngen.attention(q_misaligned, k, v, mask="causal")
        assert direct_launches() == taken
        attngen.attention(q, k, v, mask="causal")
        assert direct_launches() == taken + 1  # aligned calls still go direct
    finally:
        direct_launch(previous)
    assert_close(got, attngen.reference.attention(q, k, v, mask="causal"), torch.bfloat16)
