"""Kernel configurations: the tunables of a kernel, their validity check, and the fallbacks.

Tuned winners live in `tuned/` (the registry); search spaces in `search_spaces/`. The one table
here, DEFAULTS, is what the dispatcher uses when nothing was tuned for a call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    # the forward's key loop split into producer and consumer warps: refused for the forward
    # (WARP_SPECIALIZE_UNSUPPORTED), ignored by the other families
    warp_specialize: bool = False

    def shared_memory(self, head_dim: int, elem_bytes: int, kernel: str = "fwd") -> int:
        """Estimated shared memory in bytes of kernel family `kernel` at this config: the forward's
        pipelined K and V tiles plus its Q tile; the backward's pipelined pair of streamed tiles
        (Q and dO in dK/dV, K and V in dQ: block_m rows each) plus the pair it holds (block_n rows);
        the decode kernel's pipelined K and V tiles plus a query tile of at most 128 rows (its block_m
        is the split rule's floor, not a tile)."""
        block_d = block_d_for(head_dim)
        stages = max(1, self.num_stages)
        if kernel == "bwd":
            return 2 * block_d * elem_bytes * (self.block_m * stages + self.block_n)
        if kernel == "decode":
            return 2 * self.block_n * block_d * elem_bytes * stages + 128 * block_d * elem_bytes
        return 2 * self.block_n * block_d * elem_bytes * stages + self.block_m * block_d * elem_bytes

    def fit_shared_memory(self, head_dim: int, elem_bytes: int, smem_limit: int | None,
                          kernel: str = "fwd") -> tuple[KernelConfig, str]:
        """This config with as many fewer pipeline stages as its estimated shared memory needs to fit
        `smem_limit` bytes (a row chosen for 16-bit inputs, run by an fp32 call), and a note saying
        so; unchanged where it fits, at one stage, or without a limit (the interpreter)."""
        config = self
        while (smem_limit is not None and config.num_stages > 1
               and config.shared_memory(head_dim, elem_bytes, kernel) > smem_limit):
            config = replace(config, num_stages=config.num_stages - 1)
        if config == self:
            return self, ""
        return config, f"num_stages {config.num_stages} to fit the device's {smem_limit} bytes of shared memory"

    def problems(self, head_dim: int, elem_bytes: int, smem_limit: int | None = None, kernel: str = "fwd") -> list[str]:
        """Why this config cannot run (empty when it can); checked before anything is compiled."""
        out = []
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                out.append(f"{name}={value} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            out.append(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            out.append(f"num_stages={self.num_stages} must be >= 1")
        if self.warp_specialize and kernel == "fwd":
            out.append(f"warp_specialize is not supported: {WARP_SPECIALIZE_UNSUPPORTED}")
        if smem_limit is not None:
            need = self.shared_memory(head_dim, elem_bytes, kernel)
            if need > smem_limit:
                out.append(f"needs about {need} bytes of shared memory, the device has {smem_limit}")
        return out

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        """How attngen shows a config everywhere: `128x64 w4 s2 tma ws` (tiles, warps, stages, then
        `tma` and `ws` where tensor-descriptor loads and warp specialization are on)."""
        flags = (" tma" if self.use_tma else "") + (" ws" if self.warp_specialize else "")
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}{flags}"


# why the forward refuses warp_specialize (KernelConfig.problems)
WARP_SPECIALIZE_UNSUPPORTED = (
    "triton 3.6's warp-specialized key loop hung (4-d tensor descriptors) or left outputs unwritten "
    "(2-d ones) on an H100 (docs/journal/backward.md, runs 148-150)")


def block_d_for(head_dim: int) -> int:
    """The head dimension padded to a power of two (and at least 16, the smallest tl.dot)."""
    return max(16, 1 << (head_dim - 1).bit_length())


# the decode tables' untuned rows, the same for split calls and calls that fill the GPU
_DECODE_UNTUNED: dict[str, list[tuple[int, KernelConfig]]] = {
    "sm80": [
        (128, KernelConfig(256, 64, 4, 3)),
        (256, KernelConfig(256, 32, 4, 2)),
    ],
    "generic": [
        (256, KernelConfig(256, 32, 4, 2)),
    ],
    "interpreter": [
        (256, KernelConfig(32, 32, 4, 1)),
    ],
}


# Fallback configs when the registry has nothing for a call: kernel family -> architecture ->
# [(largest head dim, config)], first fit wins. sm90 forward: the configs `attngen tune` picked most
# often on an H200 (triton 3.6; benchmarks/RESULTS.md): 128x64, 8 warps, 3 stages for D <= 64;
# 128x64, 4 warps, 2 stages with TMA for D <= 128. D > 128 and the other rows are untuned starting
# points. Top-k calls take the forward row too; their threshold kernels may run at tiles of their
# own (attngen.kernels.topk.threshold_config).
DEFAULTS: dict[str, dict[str, list[tuple[int, KernelConfig]]]] = {
    "fwd": {
        "sm90": [
            (64, KernelConfig(128, 64, 8, 3)),
            (128, KernelConfig(128, 64, 4, 2, use_tma=True)),
            (256, KernelConfig(64, 64, 4, 2, use_tma=True)),
        ],
        "sm80": [
            (64, KernelConfig(128, 64, 4, 3)),
            (128, KernelConfig(128, 64, 8, 2)),
            (256, KernelConfig(64, 32, 4, 2)),
        ],
        "generic": [
            (128, KernelConfig(64, 64, 4, 2)),
            (256, KernelConfig(32, 32, 4, 1)),
        ],
        # Triton's interpreter on the CPU: big tiles mean fewer (slow) Python-level steps
        "interpreter": [
            (256, KernelConfig(64, 32, 4, 1)),
        ],
    },
    # backward: dK/dV runs (block_m, block_n) tiles, dQ (block_n, block_m) (attngen.kernels.backward.tiles).
    # sm90 D <= 128: of the configs benchmarks/bwd_configs.py tried on an H200 (bf16, B=4 H=16 S=4096;
    # benchmarks/RESULTS.md), the fastest with a sliding window of 512 and with 8 causal documents (0.960 and
    # 0.745 ms against 1.183 and 0.839 at 64x128 w8 s3) and within 1% of the best dense and causal; the other
    # rows are untuned starting points
    "bwd": {
        "sm90": [
            (128, KernelConfig(64, 64, 4, 2)),
            (256, KernelConfig(16, 64, 4, 2)),
        ],
        "sm80": [
            (128, KernelConfig(32, 128, 4, 3)),
            (256, KernelConfig(16, 64, 4, 2)),
        ],
        "generic": [
            (128, KernelConfig(32, 64, 4, 2)),
            (256, KernelConfig(16, 32, 4, 1)),
        ],
        "interpreter": [
            (256, KernelConfig(32, 64, 4, 1)),
        ],
    },
    # decode (split-KV): block_m is the fewest keys a split takes (the split rule's floor, see
    # attngen.kernels.decode.split_count), block_n the keys per tile. "decode" serves calls over a
    # contiguous cache whose keys are split (their (sequence, key/value head) pairs fill under 80% of
    # two programs per SM), "decode_paged" the same over a paged cache, "decode_full" those whose
    # pairs fill the GPU alone. sm90 D <= 128: from benchmarks/decode_configs.py (bf16, Hq 32, Hkv 8):
    # two programs per SM need 128-key tiles to keep enough bytes in flight, while the unsplit calls
    # (hundreds of programs) want 64-key tiles and 2 stages. A paged split call takes the contiguous
    # call's 128-key tiles: with its gathered rows' offsets in int32 (OFFSETS_32) they beat 64-key
    # tiles at twice the splits (figures in docs/decode.md and docs/journal/decode.md). The other rows
    # are untuned starting points
    "decode": {
        "sm90": [
            (128, KernelConfig(256, 128, 4, 2)),
            (256, KernelConfig(256, 32, 4, 2)),
        ],
        **_DECODE_UNTUNED,
    },
    "decode_paged": {
        "sm90": [
            (128, KernelConfig(256, 128, 4, 2)),
            (256, KernelConfig(256, 32, 4, 2)),
        ],
        **_DECODE_UNTUNED,
    },
    "decode_full": {
        "sm90": [
            (128, KernelConfig(256, 64, 4, 2)),
            (256, KernelConfig(256, 32, 4, 2)),
        ],
        **_DECODE_UNTUNED,
    },
}
# packed sequences (attngen.varlen_attention; attngen.families picks this table): at 128x64 w4 the
# mask's per-query tensors are loaded as 128 x 1 tiles, which Triton lays out a row per thread, so
# the mask goes to the MMA layout through shared memory at every partial tile, and the kernel
# spills; 64-row tiles avoid both. sm90 D <= 128: on an H100 (benchmarks/varlen.py, 8 packed
# causal sequences, docs/journal/backward.md) the forward took 0.822 ms at 64x64 w4 s2 TMA against
# 0.879 at 128x64 w4 s2 TMA and 1.038 at 128x64 w8 s2 TMA. D <= 64 and the other
# architectures: the fwd rows.
DEFAULTS["fwd_varlen"] = dict(DEFAULTS["fwd"],
                              sm90=[DEFAULTS["fwd"]["sm90"][0], (256, KernelConfig(64, 64, 4, 2, use_tma=True))])
# the backward of dense and causal calls (no other mask, no score modifier; attngen.families picks
# this table): where nearly every block is full, 128-key blocks on 8 warps beat the bwd row. sm90
# D 65-128, bf16 S 4096 (benchmarks/bwd_configs.py, benchmarks/RESULTS.md "Backward configs"): on an
# H100 4.440 / 2.534 ms (dense / causal, forward included) at 64x128 w8 s3 against 4.586 / 2.631 at
# 64x64 w4 s2; on an H200 4.458 / 2.541 against 4.651 / 2.577. With sparser masks (a window of 512,
# documents) 64x64 w4 s2 is 11-19% faster. Top-k calls take these rows on Hopper and the threshold
# kernels' tiles elsewhere (kernels.backward.topk_config).
DEFAULTS["bwd_dense"] = dict(DEFAULTS["bwd"], sm90=[(64, DEFAULTS["bwd"]["sm90"][0][1]),
                                                   (128, KernelConfig(64, 128, 8, 3)), DEFAULTS["bwd"]["sm90"][1]])


def arch_of(device) -> str:
    """The DEFAULTS key for a device ("interpreter" for CPU tensors)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9:
        return "sm90"
    if major >= 8:
        return "sm80"
    return "generic"


def shared_memory_limit(device) -> int | None:
    """The most shared memory a program may take on a CUDA device, in bytes (None for CPU tensors)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def default_entry(kernel: str, arch: str, head_dim: int) -> tuple[KernelConfig, str]:
    """The fallback config of a kernel family on an architecture for a head dim, and which row of
    DEFAULTS it is."""
    table = DEFAULTS[kernel]
    for max_d, config in table.get(arch, table["generic"]):
        if head_dim <= max_d:
            return config, f"default {kernel} config for {arch}, head dim <= {max_d}"
    raise ValueError(f"no default {kernel} config for head dim {head_dim}")


def default_config(kernel: str, arch: str, head_dim: int) -> KernelConfig:
    return default_entry(kernel, arch, head_dim)[0]
