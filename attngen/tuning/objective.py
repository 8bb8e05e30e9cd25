"""One trial of `attngen tune`: a config compiled in a child process, checked against the float64
reference, then timed.

1. The config's static rules (its own check, the space's constraints, shared memory against the
   device's limit) run before anything is compiled; a config that breaks one is infeasible.
2. It compiles in a child process (several at once: compilation dominates tuning time, and a
   compiler crash ends only that child), which fills Triton's on-disk cache.
3. In this process, one trial at a time: it runs, its result is compared with the float64
   reference (a wrong result is a failed trial that can never win), and it is timed with CUDA-event
   medians on inputs rotated so that they do not sit in the L2. What runs is the family's prepared
   run where it has one (every built-in family: the call's plan built once, as the dispatcher runs
   it, so that building it stays out of the timing), else its run. The objective is TFLOP/s.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass

import torch

from .. import masks as masks_
from ..checks import check_topk, interpreter_on, topk_pad
from ..config import KernelConfig, shared_memory_limit
from ..dtypes import BYTES as DTYPE_BYTES
from ..dtypes import DTYPES
from ..families import FAMILIES
from ..reference import TOLERANCE
from ..tools.timing import Rotation, input_sets, median_ms
from . import registry as registry_
from .space import SearchSpace

OK, INVALID, FAILED, WRONG = "ok", "invalid", "failed", "wrong"  # how a trial ended
WORKER = f"{socket.gethostname()}:{os.getpid()}"  # recorded on every trial


@dataclass(frozen=True)
class Problem:
    mask: str  # mask spec text, as on the command line
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    kernel: str = "fwd"  # the kernel family (attngen.families)
    topk: int = 0  # top-k softmax (0: plain); a topk >= seq_len is plain softmax too

    def mask_object(self):
        return masks_.parse_spec(self.mask)

    @property
    def effective_topk(self) -> int:
        return check_topk(self.topk or None, self.seq_len)

    @property
    def variant(self) -> str:
        return registry_.variant_of(self.mask_object(), self.effective_topk)

    @property
    def family(self):
        return FAMILIES[self.kernel]

    @property
    def q_len(self) -> int:
        """The query length a run takes: seq_len (Sq = Sk), or the family's new tokens (decode)."""
        return self.family.query_len or self.seq_len

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def study_name(self, gpu: str) -> str:
        """The Optuna study's name; a new kernel revision starts a new study (the old one's times
        were of other kernels)."""
        return (f"attngen/{gpu}/{self.kernel}/r{self.family.revision}/{self.variant}/{self.dtype}/d{self.head_dim}/"
                f"s{self.seq_len}/b{self.batch}h{self.heads}kv{self.kv_heads}")

    def entry_key(self) -> registry_.EntryKey:
        return registry_.EntryKey(variant=self.variant, kernel=self.kernel, dtype=self.dtype,
                                  head_dim=self.head_dim, seq_bucket=registry_.seq_bucket(self.seq_len),
                                  group=self.group, batch_bucket=self.family.batch_bucket(self.batch))


def _inputs(problem: Problem, device, generator=None) -> list[torch.Tensor]:
    """Fresh random inputs of the problem's kernel family: (B, Hq, Sq, D) for each "q" input (the
    queries, an upstream gradient), (B, Hkv, S, D) for each "kv" input."""
    dtype = DTYPES[problem.dtype]
    sizes = {"q": (problem.heads, problem.q_len), "kv": (problem.kv_heads, problem.seq_len)}
    return [torch.randn((problem.batch, *sizes[kind], problem.head_dim), device=device,
                        generator=generator).to(dtype) for kind in problem.family.inputs]


def _gate(tensors, kinds, group: int) -> list[torch.Tensor]:
    """What the correctness gate compares: batch 0 and key/value head 0 with its query heads."""
    return [t[:1, :group] if kind == "q" else t[:1, :1] for t, kind in zip(tensors, kinds)]


def compile_child(spec: str) -> None:
    """Entry point of the child: run the config once so Triton's disk cache holds the kernel."""
    s = json.loads(spec)
    problem = Problem(**s["problem"])
    device = "cuda" if torch.cuda.is_available() and not interpreter_on() else "cpu"
    problem.family.run(*_inputs(problem, device), problem.mask_object(), topk=problem.topk or None,
                       config=KernelConfig(**s["config"]))
    if device == "cuda":
        torch.cuda.synchronize()


def compile_in_child(problem: Problem, config: KernelConfig, timeout: float) -> str | None:
    """None when the config compiled and ran in a child process, else why not."""
    spec = json.dumps(dict(problem=asdict(problem), config=config.as_dict()))
    try:
        r = subprocess.run([sys.executable, "-m", "attngen.tuning.objective", spec], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"compilation took over {timeout:.0f}s"
    if r.returncode == 0:
        return None
    lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return f"exit {r.returncode}: {(errors or lines or ['no output'])[-1][:300]}"


class Objective:
    """Evaluates configs for one problem; trials run in threads, the GPU part one at a time."""

    def __init__(self, problem: Problem, space: SearchSpace, arch: str, device, compile_timeout: float):
        self.problem, self.space, self.arch, self.device = problem, space, arch, torch.device(device)
        self.values = space.for_arch(arch)
        self.compile_timeout = compile_timeout
        self.mask = problem.mask_object()
        self.lock = threading.Lock()
        self.smem_limit = shared_memory_limit(self.device)
        g = torch.Generator(device=self.device).manual_seed(0)
        first = _inputs(problem, self.device, g)
        bytes_per_set = sum(t.numel() * t.element_size() for t in first)
        self.sets = [first] + [_inputs(problem, self.device, g)
                               for _ in range(input_sets(bytes_per_set, self.device) - 1)]
        # correctness gate: batch 0 and the query heads of key/value head 0, against float64
        family, topk = problem.family, problem.topk or None
        self.ref = family.reference(*_gate(first, family.inputs, problem.group), self.mask, topk=topk)
        self.flops = family.flops(self.mask, problem.batch, problem.heads, problem.q_len, problem.seq_len,
                                  problem.head_dim, self.device)

    def runner(self, config: KernelConfig):
        """What a trial checks and times: the family's prepared run (its host-side work done once), else run."""
        family, topk = self.problem.family, self.problem.topk or None
        if family.prepare is None:
            return lambda *tensors: family.run(*tensors, self.mask, topk=topk, config=config)
        return family.prepare(*self.sets[0], self.mask, topk=topk, config=config)

    def __call__(self, trial) -> float:
        config = KernelConfig(**{name: trial.suggest_categorical(name, values) for name, values in self.values.items()})
        status, reason, result = self.evaluate(trial.study, trial.number, config)
        trial.set_user_attr("worker", WORKER)
        trial.set_user_attr("status", status)
        if reason:
            trial.set_user_attr("reason", reason)
        for key, value in result.items():
            trial.set_user_attr(key, value)
        trial.set_constraint("feasible", 0.0 if status == OK else 1.0)
        return result.get("tflops", 0.0)

    def evaluate(self, study, number: int, config: KernelConfig):
        p = self.problem
        problems = config.problems(p.head_dim, DTYPE_BYTES[p.dtype], self.smem_limit, p.kernel)
        problems += self.space.violations(config, head_dim=p.head_dim, elem_bytes=DTYPE_BYTES[p.dtype],
                                          seq_len=p.seq_len, topk_pad=topk_pad(p.effective_topk))
        if problems:
            return INVALID, "; ".join(problems), {}
        earlier = _measured(study, config, number)
        if earlier is not None:  # the sampler asked again: reuse, never re-measure
            attrs = earlier.user_attrs
            result = {k: attrs[k] for k in ("ms", "tflops", "error") if k in attrs}
            result["repeat_of"] = earlier.number
            return attrs["status"], attrs.get("reason", ""), result
        failure = compile_in_child(p, config, self.compile_timeout)
        if failure:
            return FAILED, failure, {}
        with self.lock:
            try:
                run = self.runner(config)
                outs = _gate(run(*self.sets[0]), self.problem.family.outputs, p.group)
                error = max(_rel_error(out, ref) for out, ref in zip(outs, self.ref))
                if not error <= TOLERANCE[DTYPES[p.dtype]]:  # NaN fails too
                    return WRONG, f"relative error {error:.3e} against the float64 reference", {"error": error}
                ms = median_ms(Rotation(run, self.sets), self.device)
            except Exception as e:  # out of resources at launch, and the like: recorded, not fatal
                return FAILED, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", {}
        return OK, "", {"ms": ms, "tflops": self.flops / ms / 1e9, "error": error}

    def sdpa_ms(self) -> tuple[float | None, str]:
        """The SDPA baseline on the same inputs (cuDNN where it runs), or None on the CPU."""
        if self.device.type != "cuda":
            return None, "n/a under the interpreter"
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from ..tools.methods import Unsupported, sdpa_kwargs

        p = self.problem
        if p.effective_topk:
            return None, "SDPA has no top-k softmax"
        if p.family.query_len and self.mask is not None:
            return None, "SDPA aligns a mask's new tokens at the start, decode at the end"
        try:  # the mask's exact SDPA form: is_causal, or a boolean attn_mask
            kwargs, _ = sdpa_kwargs(self.mask, batch=p.batch, heads=p.heads, q_len=p.q_len, kv_len=p.seq_len,
                                    device=self.device)
        except Unsupported as e:
            return None, str(e)
        if p.group > 1:
            kwargs["enable_gqa"] = True
        for backends, name in (([SDPBackend.CUDNN_ATTENTION], "cudnn"), (None, "default")):
            try:
                def run(q, k, v, *dout, backends=backends):
                    """SDPA's forward, and with an upstream gradient (the bwd family's runs) its backward too."""
                    with contextlib.ExitStack() as stack:
                        if backends is not None:
                            stack.enter_context(sdpa_kernel(backends))
                        if not dout:
                            return F.scaled_dot_product_attention(q, k, v, **kwargs)
                        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                        with torch.enable_grad():
                            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
                            return torch.autograd.grad(out, (q, k, v), dout[0])
                with self.lock:
                    return median_ms(Rotation(run, self.sets), self.device), name
            except RuntimeError:
                continue
        return None, "SDPA could not run this case"


def _rel_error(out, ref) -> float:
    """||out - ref|| / ||ref||; NaN where out has one (so it fails the gate)."""
    ref = ref.to(torch.float64)
    return float((out.to(torch.float64) - ref).norm() / ref.norm().clamp_min(1e-30))


def _measured(study, config: KernelConfig, number: int):
    """An earlier finished trial of the same config, if any."""
    import optuna

    params = config.as_dict()
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if t.number != number and t.params == params and "status" in t.user_attrs:
            return t
    return None


if __name__ == "__main__":
    compile_child(sys.argv[1])
