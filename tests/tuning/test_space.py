"""Search spaces: the shipped files, their rules, and files that cannot be used."""

import pytest

from attngen.config import KernelConfig
from attngen.families import FAMILIES
from attngen.paths import data_dir
from attngen.tuning.space import SpaceError, find_space, load_space
from helpers import GOOD_SPACE


def test_every_shipped_space_parses_for_its_family():
    files = sorted(data_dir("search_spaces").glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        space = load_space(path)
        assert space.kernel in FAMILIES, path
        assert find_space(path.stem, space.kernel).values == space.values
        for arch in space.values:
            assert space.size(arch) >= 1


def test_shipped_forward_space_rules():
    space = find_space("forward", "fwd")
    for arch in ("sm90", "sm80", "generic", "interpreter"):
        assert space.size(arch) > 1
    ws_without_tma = KernelConfig(64, 64, 4, 2, use_tma=False, warp_specialize=True)
    assert space.violations(ws_without_tma, head_dim=64, elem_bytes=2, seq_len=1024) == [
        "warp specialization is only tried with tensor-descriptor loads"]


def test_topk_space_rules():
    space = find_space(FAMILIES["fwd"].topk_space, "fwd")
    # no per-row buffer beside the tile: a wide query tile is allowed whatever K
    assert space.violations(KernelConfig(128, 64, 4, 2), head_dim=128, elem_bytes=2, seq_len=4096, topk_pad=256) == []
    assert space.violations(KernelConfig(128, 64, 4, 2), head_dim=256, elem_bytes=2, seq_len=4096, topk_pad=256) == [
        "the fp32 accumulator would take over 128 registers a thread and spill"]


def test_start_configs(tmp_path):
    space = find_space("backward", "bwd")
    assert space.start["sm90"] == (KernelConfig(64, 128, 8, 3),)
    for arch, configs in space.start.items():  # every shipped start config is one its space may try
        assert all(space.violations(c, head_dim=128, elem_bytes=2, seq_len=4096) == [] for c in configs), arch
    path = tmp_path / "space.yaml"
    path.write_text(GOOD_SPACE + "start:\n  interpreter:\n    - {block_m: 32, block_n: 16, num_warps: 4, num_stages: 1}\n")
    assert load_space(path).start == {"interpreter": (KernelConfig(32, 16, 4, 1),)}
    path.write_text(GOOD_SPACE)
    assert load_space(path).start == {}


def test_a_space_is_for_one_kernel_family(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(GOOD_SPACE)
    assert find_space(str(path), "fwd").kernel == "fwd"
    with pytest.raises(SpaceError, match=r"space.yaml is a space for 'fwd' kernels, not 'bwd'"):
        find_space(str(path), "bwd")
    with pytest.raises(SpaceError, match="forward.yaml is a space for 'fwd' kernels, not 'bwd'"):
        find_space("forward", "bwd")
    with pytest.raises(SpaceError, match="no search space for architecture 'sm90'"):
        load_space(path).for_arch("sm90")


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("kernel: fwd\n", ""), "missing 'kernel'"),
    (lambda s: s.replace("kernel: fwd\n", "template: forward.py.jinja\ndirection: fwd\n"), "unknown key(s) direction, "
                                                                                            "template"),
    (lambda s: s.replace("block_n: [16]", "block_n: [24]"), "powers of two >= 16, got 24"),
    (lambda s: s.replace("block_n: [16]", "block_n: 16"), "block_n must be a list of distinct int values"),
    (lambda s: s.replace("use_tma: [false]", "use_tma: [0]"), "use_tma must be a list of distinct bool values"),
    (lambda s: s.replace("    warp_specialize: [false]\n", ""), "must list exactly block_m"),
    (lambda s: s + "extra: 1\n", "unknown key"),
    (lambda s: s.replace("block_m * block_d <= 1024", "block_m * nonsense"), "unknown name 'nonsense'"),
    (lambda s: s.replace("why: too big for this test", "because: x"), "exactly `expr` and `why`"),
    (lambda s: "arch: [unclosed", "cannot read search space"),
    (lambda s: s + "start: [1]\n", "start must map architecture names"),
    (lambda s: s + "start:\n  sm90: []\n", "start names architecture 'sm90', which arch does not list"),
    (lambda s: s + "start:\n  interpreter: {block_m: 16}\n", "start 'interpreter' must be a list"),
    (lambda s: s + "start:\n  interpreter:\n    - {block_m: 16}\n",
     "config 0 must map block_m, block_n, num_warps, num_stages (and optionally use_tma, warp_specialize)"),
    (lambda s: s + "start:\n  interpreter:\n    - {block_m: 64, block_n: 16, num_warps: 8, num_stages: 1, x: 1}\n",
     "config 0 must map block_m"),
    (lambda s: s + "start:\n  interpreter:\n    - {block_m: 64, block_n: 16, num_warps: 8, num_stages: 1}\n",
     "config 0 has block_m, num_warps outside the values arch 'interpreter' lists"),
])
def test_bad_space_files_are_rejected(tmp_path, edit, message):
    path = tmp_path / "space.yaml"
    path.write_text(edit(GOOD_SPACE))
    with pytest.raises(SpaceError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        load_space(path)
    assert str(path) in str(info.value)
