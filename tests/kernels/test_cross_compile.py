"""The threshold kernels compiled for sm_90 on any machine (attngen.tools.cross_compile, in a child
process: the interpreter, once on in this one, cannot compile)."""

import os
import subprocess
import sys

import pytest

from attngen.kernels import topk
from attngen.kernels.topk import TopkTuning

SM90_SHARED = 233472  # shared memory of an sm_90 SM, of which each resident program reserves 1 KB
SM90_RESERVED = 1024


def cross_compile(tmp_path, *args):
    """`python -m attngen.tools.cross_compile ARGS` without the interpreter, outside the source tree."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "attngen.tools.cross_compile", *map(str, args)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=tmp_path)


@pytest.mark.parametrize("config,topk_", [("16 16 4 1 0", 64), ("64 64 4 3 1", 64), ("64 64 4 3 1", 256)],
                         ids=["16x16", "64x64 TMA", "64x64 TMA K=256"])
def test_threshold_kernels_compile_for_hopper(tmp_path, config, topk_):
    """The interpreter runs code that a GPU compiler may refuse (an int8 dot over 16 keys did, and
    only the GPU run noticed): compile the threshold kernels for sm_90, as a CUDA launch would, at
    the smallest key blocks and at the threshold tiles of sm_90: topk_bracket, topk_capture (without
    and with the count above hi at K=64, one launch for every tile at K=256, where the rows have a
    hi end), topk_select and topk_threshold."""
    result = cross_compile(tmp_path, "topk", *config.split(), topk_, 4096)
    block_n, warps = (int(x) for x in config.split()[1:3])
    sizes = topk.topk_sizes(topk_, 4096, block_n, TopkTuning())
    assert len(sizes.captures) == (1 if topk_ == 256 else 2)
    assert result.returncode == 0, result.stderr[-4000:]
    kernels = [line.split()[1] for line in result.stdout.splitlines()]
    assert kernels == ["topk_bracket"] + ["topk_capture"] * len(sizes.captures) + ["topk_select", "topk_threshold"]
    # the captures leave room in an SM's shared memory for the programs an SM they are sized for
    # (compiled into one kernel, the two passes took 88 KB, room for 2 where 3 were meant to run)
    programs = topk.capture_setup(sizes, 4096, TopkTuning())[1]
    shared = {}
    for line in result.stdout.splitlines():
        shared.setdefault(line.split()[1], []).append(int(line.split()[2]))
    assert all(programs * (size + SM90_RESERVED) <= SM90_SHARED for size in shared["topk_capture"])
    # so does the bracket, whose sampled blocks are loaded through a pipeline (66.5 KB at 3 stages)
    bracket = shared["topk_bracket"][0]
    assert TopkTuning().bracket_sm_warps // warps * (bracket + SM90_RESERVED) <= SM90_SHARED, bracket


def test_cross_compile_explains_itself(tmp_path):
    result = cross_compile(tmp_path, "fused", 1)
    assert result.returncode == 2 and "python -m attngen.tools.cross_compile topk BLOCK_M" in result.stderr


def test_varlen_compiles_like_the_same_packing_as_a_document_mask(tmp_path):
    """varlen_attention's kernels, compiled for sm_90 at the default configs, use no more registers,
    spills and instructions than the same packing as `document & causal` (the same tiles). Its
    local mask once gathered sequence offsets at kv_idx in every masked tile: the forward spilled
    2.3 KB (the document one 0.6 KB), ran 65% more instructions, and took 2.2x its time on an H200."""
    result = cross_compile(tmp_path, "varlen", "causal")
    assert result.returncode == 0, result.stderr[-4000:]
    usage = {}
    for line in result.stdout.splitlines():
        name, kernel, registers, spills, instructions = line.split()
        usage.setdefault(kernel, {})[name] = (int(registers), int(spills), int(instructions))
    assert sorted(usage) == ["attention_bwd", "attention_fwd"]
    for kernel, both in usage.items():
        (registers, spills, instructions), (doc_registers, doc_spills, doc_instructions) = both["varlen"], both["document"]
        assert registers <= doc_registers + 8, (kernel, both)
        assert spills <= doc_spills + 64, (kernel, both)
        assert instructions <= 1.1 * doc_instructions, (kernel, both)


@pytest.mark.parametrize("mask,paged,group,q_len", [("none", 1, 4, 1), ("none", 0, 1, 1),
                                                    ("sliding_window(window=4096) & softcap(cap=30.0)", 1, 8, 4)],
                         ids=["paged GQA", "contiguous MHA", "paged window softcap 4 tokens"])
@pytest.mark.parametrize("table", ["decode", "decode_paged", "decode_full"])
def test_decode_kernels_compile_for_hopper_without_spilling(tmp_path, mask, paged, group, q_len, table):
    """The decode kernels at the sm_90 default configs (split and full calls): they compile, and the
    split kernel keeps its loop in registers (a memory-bound loop that spills reads local memory on
    top of the cache)."""
    from attngen.config import default_config
    config = default_config(table, "sm90", 128)
    result = cross_compile(tmp_path, "decode", config.block_m, config.block_n, config.num_warps, config.num_stages,
                           mask, paged, group, q_len)
    assert result.returncode == 0, result.stderr[-4000:]
    usage = {line.split()[1]: [int(x) for x in line.split()[2:]] for line in result.stdout.splitlines()}
    assert sorted(usage) == ["decode_combine", "decode_fwd"]
    for kernel, (shared, registers, spills, instructions) in usage.items():
        assert spills == 0 and registers <= 255 and shared + SM90_RESERVED <= SM90_SHARED, (kernel, usage[kernel])


@pytest.mark.parametrize("kernel,config", [("forward", "128 64 4 2 1 none"), ("backward", "64 128 8 3 none")],
                         ids=["forward", "backward"])
def test_dropout_costs_no_byte_permutes_or_multiplies_per_weight(tmp_path, kernel, config):
    """Dropout at the sm_90 configs dropout calls run (the forward's fallback; the backward's
    dropout rule) adds no byte permutes to the kernel's loops, nor a float multiply a weight. With
    `tl.where(keep, p, 0)` the compiler moved the select past the weights' conversion to bf16 and
    spent a byte permute and a select on 16-bit halves per weight (PRMT: 72 an iteration in the
    forward, 40 in the backward's dK/dV loop, against 0 and 0 without dropout); the backward kernel
    took 8% longer under dropout on an H100 for it. A kept factor (1/(1-p) or 0) multiplied in cost
    an FMUL a weight (the forward's loop: 197 against 132)."""
    counts = []
    for dropout in (0, 1):
        result = cross_compile(tmp_path, "--loops", kernel, *config.split(), dropout)
        assert result.returncode == 0, result.stderr[-4000:]
        loops = [line.split() for line in result.stdout.splitlines() if line.startswith("loop")]
        assert loops, result.stdout
        ops = [dict(op.split("=") for op in loop[4:]) for loop in loops]
        # permutes: the most in one loop (an outer loop counts its inner loops' too); multiplies: the
        # first loop, the full blocks' (outer loops also count the output's scaling by 1/(1-p))
        counts.append({"PRMT": max(int(o.get("PRMT", 0)) for o in ops), "FMUL": int(ops[0].get("FMUL", 0))})
    plain, dropped = counts
    assert dropped["PRMT"] <= plain["PRMT"] + 2, (plain, dropped)
    assert dropped["FMUL"] <= plain["FMUL"] + 8, (plain, dropped)


def test_dense_forward_warp_specializes_with_one_key_loop(tmp_path):
    """triton 3.6 warp-specializes a kernel's key loop only where it is the kernel's one loop (with a
    second loop over the partial lists, before or after, its NVGPUWarpSpecialization pass fails):
    the forward of a call without partial tiles (dense, whole key blocks) compiles that loop alone
    (LISTS=1) and gets its partitions. (Compiled only: run on an H100, triton 3.6's warp-specialized
    loop hung or left outputs unwritten, so configs refuse warp_specialize; this keeps the tool's
    check for a later triton.)"""
    result = cross_compile(tmp_path, "forward", 128, 128, 4, 2, 1, "none", 0, 1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "partitions attention_fwd 1" in result.stdout.splitlines(), result.stdout


def test_warp_specialize_is_dropped_where_the_forward_has_two_key_loops(tmp_path):
    """A call with partial tiles (causal) keeps its loop over them, which triton 3.6 cannot
    warp-specialize beside another: a warp-specialized config (a registry entry tuned on whole
    blocks, a ragged call) still compiles, without partitions, instead of failing in the compiler."""
    result = cross_compile(tmp_path, "forward", 128, 128, 4, 2, 1, "causal", 0, 1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "partitions attention_fwd 0" in result.stdout.splitlines(), result.stdout


def test_dense_backward_compiles_no_loop_over_partial_blocks(tmp_path):
    """Where no tile is partial (dense on whole blocks: the tool's 64 rows at 64x64), the dK/dV and dQ
    programs compile only their loops over full blocks (LISTS1 = LISTS2 = 1): on an H100 the dense
    backward ran 1.5% faster than with the unused partial loops compiled (run 150)."""
    result = cross_compile(tmp_path, "--loops", "backward", 64, 64, 4, 2, "none", 0)
    assert result.returncode == 0, result.stderr[-4000:]
    loops = [line for line in result.stdout.splitlines() if line.startswith("loop attention_bwd ")]
    assert len(loops) == 2, result.stdout
