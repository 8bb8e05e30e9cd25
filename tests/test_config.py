"""Kernel configs: how attngen shows them, their one validity check, and the fallback table."""

import pytest

from attngen.config import (DEFAULTS, WARP_SPECIALIZE_UNSUPPORTED, KernelConfig, arch_of, block_d_for, default_config,
                            default_entry)


@pytest.mark.parametrize("config,text", [
    (KernelConfig(128, 64, 4, 2), "128x64 w4 s2"),
    (KernelConfig(128, 64, 4, 2, use_tma=True), "128x64 w4 s2 tma"),
    (KernelConfig(16, 32, 8, 1, use_tma=True, warp_specialize=True), "16x32 w8 s1 tma ws"),
    (KernelConfig(64, 16, 2, 3, warp_specialize=True), "64x16 w2 s3 ws"),
])
def test_a_config_shows_as_its_tiles_warps_stages_and_flags(config, text):
    assert str(config) == text and f"{config}" == text
    assert repr(config).startswith("KernelConfig(block_m=")  # the dataclass repr is left alone


def test_problems_are_found_before_compiling():
    assert KernelConfig(64, 32, 4, 2).problems(128, 2) == []
    assert KernelConfig(48, 8, 3, 0).problems(128, 2) == [
        "block_m=48 must be a power of two >= 16", "block_n=8 must be a power of two >= 16",
        "num_warps=3 must be 1, 2, 4, 8 or 16", "num_stages=0 must be >= 1"]
    big = KernelConfig(128, 128, 4, 4)
    need = big.shared_memory(128, 2)
    assert need == 2 * 128 * 128 * 2 * 4 + 128 * 128 * 2
    assert big.problems(128, 2, smem_limit=need) == []
    assert big.problems(128, 2, smem_limit=need - 1) == [
        f"needs about {need} bytes of shared memory, the device has {need - 1}"]
    assert big.shared_memory(100, 2) == need  # a head dim of 100 is padded to 128
    assert big.shared_memory(128, 2, kernel="bwd") == 2 * 128 * 2 * (128 * 4 + 128)
    assert [block_d_for(d) for d in (1, 16, 17, 80, 256)] == [16, 16, 32, 128, 256]
    ws = KernelConfig(128, 128, 4, 2, use_tma=True, warp_specialize=True)
    assert ws.problems(128, 2) == [f"warp_specialize is not supported: {WARP_SPECIALIZE_UNSUPPORTED}"]
    assert ws.problems(128, 2, kernel="bwd") == []  # the backward ignores the flag


def test_a_config_takes_fewer_stages_to_fit_shared_memory():
    """An fp32 call at a row chosen for 16-bit inputs: the sm90 dense backward row at fp32 D 128
    (Triton's own figure for the one-launch kernel at 3 stages: 296 KB, where an sm_90 program may
    take 227 KB) runs with as many fewer stages as the estimate needs; 16-bit inputs, a config that
    fits and no limit keep it."""
    limit = 232448  # an H100's or H200's max_shared_mem
    dense = default_config("bwd_dense", "sm90", 128)
    assert dense.shared_memory(128, 4, "bwd") > limit >= dense.shared_memory(128, 2, "bwd")
    fitted, note = dense.fit_shared_memory(128, 4, limit, "bwd")
    assert fitted == KernelConfig(64, 128, 8, 1) and fitted.shared_memory(128, 4, "bwd") <= limit
    assert note == f"num_stages 1 to fit the device's {limit} bytes of shared memory"
    assert dense.fit_shared_memory(128, 2, limit, "bwd") == (dense, "")
    assert dense.fit_shared_memory(128, 4, None, "bwd") == (dense, "")
    one = KernelConfig(128, 128, 8, 1)  # stages cannot go below one: left to fail where it does not fit
    assert one.fit_shared_memory(256, 4, 1024, "bwd") == (one, "")


def test_defaults_by_family_then_arch():
    assert set(DEFAULTS) >= {"fwd", "bwd"}
    assert default_config("fwd", "sm90", 128) == KernelConfig(128, 64, 4, 2, use_tma=True)
    assert default_entry("fwd", "sm90", 64) == (KernelConfig(128, 64, 8, 3),
                                                "default fwd config for sm90, head dim <= 64")
    assert default_entry("fwd", "sm75", 64)[1] == "default fwd config for sm75, head dim <= 128"  # the generic rows
    assert default_config("fwd", "sm75", 64) == DEFAULTS["fwd"]["generic"][0][1]
    with pytest.raises(ValueError, match="no default fwd config for head dim 300"):
        default_config("fwd", "sm90", 300)
    assert arch_of("cpu") == "interpreter"
