"""`attngen bench` on the CPU, under Triton's interpreter: its methods, its table and output formats."""

import csv
import json
import math
import re
import subprocess

import pytest
import torch

from attngen import cli
from attngen import masks as masks_
from attngen.tools import bench, methods, report
from attngen.tools.methods import Case
from helpers import attngen_cmd, cli_env

SHAPE = "1,2,32,16"  # B,H,S,D: tiny, so the interpreter and the CPU compilers stay quick
CPU_ONLY = {"sdpa_efficient", "sdpa_cudnn"}  # the methods this machine cannot run, with the reason shown
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU table under --interpret; on a GPU, "
                                "benchmarks/bench_h200.sh runs the real one")


def run_cli(tmp_path, *args):
    """`attngen ARGS` in a process of its own, as a user runs it."""
    return subprocess.run(attngen_cmd(*args), env=cli_env(tmp_path), capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)


def table_rows(stdout: str) -> dict[str, dict]:
    """The terminal table as {method: {column: text}} (columns split on runs of 2+ spaces)."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("method "))
    titles = [t for _, t in report.COLUMNS]
    rows = {}
    for line in lines[head + 2:]:
        if not line or line.startswith(" "):
            break
        cells = [c for c in line.split("  ") if c.strip()]
        cells = [c.strip() for c in cells[:6]] + ["  ".join(cells[6:]).strip()]
        rows[cells[0]] = dict(zip(titles, cells))
    return rows


def number(text: str):
    return None if text == "n/a" else float(text.removesuffix("x"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One run of every method on a causal mask, with every output format."""
    tmp = tmp_path_factory.mktemp("bench")
    r = run_cli(tmp, "bench", "--interpret", "--shape", SHAPE, "--mask", "causal", "--json", "out.json", "--csv",
                "out.csv", "--markdown", "out.md")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, r


def test_table_has_every_method_with_numbers_or_reasons(full_run):
    tmp, r = full_run
    rows = table_rows(r.stdout)
    assert list(rows) == list(methods.METHODS)
    for method, row in rows.items():
        if method in CPU_ONLY:
            assert row["ms"] == "n/a" and row["note"] == "n/a: needs a CUDA device"
            continue
        assert number(row["ms"]) > 0 and number(row["TFLOP/s"]) > 0, (method, row)
        assert row["peak MiB"] == "n/a"  # CUDA's allocator only; the footnote says so
        assert number(row["max rel err"]) < 3e-3, (method, row)  # fp16 against the float64 reference
    assert rows["naive"]["vs naive"] == "1.00x"
    assert rows["sdpa_math"]["note"] == "is_causal=True"
    assert re.match(r"\d+x\d+ w\d+ s\d+ \(no registry entry for interpreter; ", rows["attngen"]["note"])  # the config
    assert "peak MiB: n/a on the CPU" in r.stdout and "not GPU figures" in r.stdout
    # stderr is not a terminal here: a line per finished method, not a progress bar redrawn with \r
    total = len(methods.METHODS)
    progress = [line for line in r.stderr.splitlines() if re.search(rf": \d+/{total} runs, \d+ s$", line)]
    assert len(progress) == total and "\r" not in r.stderr
    assert progress[0].startswith(f"S=32 fp16 causal fwd: {methods.METHODS[0]}: 1/{total} runs, ")


def test_json_csv_markdown_carry_the_numbers_of_the_table(full_run):
    tmp, r = full_run
    rows = table_rows(r.stdout)
    data = json.loads((tmp / "out.json").read_text())
    assert set(data["definitions"]) == {"ms", "tflops", "peak_mib", "speedup", "error"}
    (case,) = data["cases"]
    assert (case["batch"], case["heads"], case["seq_len"], case["head_dim"]) == (1, 2, 32, 16)
    assert case["mask"] == "causal" and case["direction"] == "fwd" and case["dtype"] == "fp16"
    assert case["flops"] == 4 * 16 * 2 * (32 * 33 // 2)  # 4*D per visible pair, causal: S(S+1)/2 per head
    columns = {"ms": "ms", "tflops": "TFLOP/s", "peak_mib": "peak MiB", "speedup": "vs naive", "error": "max rel err"}
    for row in case["rows"]:
        shown = rows[row["method"]]
        for key, title in columns.items():
            assert row[key] == number(shown[title]), (row["method"], key)
        assert row["note"] == shown["note"]
    with open(tmp / "out.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert [c["method"] for c in csv_rows] == list(methods.METHODS)
    for c, row in zip(csv_rows, case["rows"]):
        for key in columns:
            assert (float(c[key]) if c[key] else None) == row[key]
    md = (tmp / "out.md").read_text()
    for row in case["rows"]:
        assert f"| {row['method']} | " in md


def test_backward_runs_what_has_a_backward_and_says_why_not_for_the_rest():
    results = bench.run_cases([case("causal", seq_len=37, bwd=True)], ["naive", "naive_out", "sdpa_math", "flex",
                                                                        "attngen"], "cpu")
    (_, rows, notes, flops), = results
    rows = {r.method: r for r in rows}
    assert flops == int(4 * 16 * 2 * (37 * 38 // 2) * 3.5)  # forward + backward: 1 + 2.5 times the forward
    for method in ("naive", "sdpa_math", "attngen"):
        assert rows[method].ms > 0 and rows[method].error < 3e-3  # output and gradients against float64 autograd
    assert rows["naive_out"].ms is None and "out=" in rows["naive_out"].note
    assert rows["flex"].ms is None and rows["flex"].note.startswith("n/a: ")  # no FlexAttention backward on the CPU


def case(mask="causal", seq_len=32, bwd=False, dtype="fp16"):
    return Case(1, 2, seq_len, 16, dtype, mask, bwd)


def test_a_wrong_result_shows_in_the_error_column(monkeypatch):
    build = methods.BUILDERS["naive"]

    def off_by_one_percent(p):
        fn, note = build(p)
        return (lambda: fn() * 1.01), note

    monkeypatch.setitem(methods.BUILDERS, "naive", off_by_one_percent)
    (_, rows, _, _), = bench.run_cases([case("none")], ["naive", "sdpa_math"], "cpu")
    wrong, right = rows
    assert 5e-3 < wrong.error < 2e-2 and right.error < 1e-3


def test_score_modifiers_have_no_sdpa_form_and_run_elsewhere():
    spec = "sliding_window(window=8) & softcap(cap=5.0)"
    (_, rows, _, _), = bench.run_cases([case(spec, dtype="fp32")], ["naive", "compile", "sdpa_math", "flex", "attngen"],
                                       "cpu")
    rows = {r.method: r for r in rows}
    assert rows["sdpa_math"].note == "n/a: SDPA has no form for score modifiers (softcap)"
    assert rows["flex"].note == "block mask, score_mod"
    for method in ("naive", "compile", "flex", "attngen"):
        assert rows[method].error < 1e-5, (method, rows[method])


@pytest.mark.parametrize("spec", ["causal", "sliding_window(window=5, two_sided=True)", "prefix_lm(prefix=7)",
                                  "chunked(chunk=6) | causal(align='bottom_right')", "none"])
def test_sdpa_forms_and_flex_mask_mods_agree_with_the_reference_mask(spec):
    from torch.nn.attention.flex_attention import create_mask

    m = methods.parse_mask(spec)
    sizes = dict(batch=2, heads=3, q_len=20, kv_len=20)
    kwargs, how = methods.sdpa_kwargs(m, **sizes, device="cpu")
    if m is None:
        assert kwargs == {}
        return
    p = methods.make_inputs(Case(2, 3, 20, 8, "fp32", spec, mask_object=m), "cpu")
    mask_mod, score_mod = methods.torch_mods(p)
    visible = methods.dense_visible(m, **sizes, device="cpu")
    assert score_mod is None
    assert torch.equal(create_mask(mask_mod, 2, 3, 20, 20, device="cpu"), visible.expand(2, 3, 20, 20))  # vmapped
    if spec == "causal":
        assert kwargs == {"is_causal": True}
    else:
        assert torch.equal(kwargs["attn_mask"], visible) and how.startswith("boolean attn_mask")
        bound = masks_.bind(m, device="cpu", **sizes)
        positions = torch.arange(20)
        env = masks_.index_env(positions, positions, **sizes)
        assert torch.equal(visible.expand(2, 3, 20, 20),
                           torch.as_tensor(masks_.evaluate_visible(bound, env)).expand(2, 3, 20, 20))


def test_masks_with_tensor_parameters_reach_flex_through_vmap():
    from torch.nn.attention.flex_attention import create_mask

    ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 15 + [1] * 5])
    m = masks_.mask("document", doc_ids=ids) & masks_.mask("causal")
    p = methods.make_inputs(Case(2, 3, 20, 8, "fp32", "document & causal", mask_object=m), "cpu")
    mask_mod, _ = methods.torch_mods(p)
    visible = methods.dense_visible(m, **p.sizes, device="cpu")
    assert visible.shape == (2, 1, 20, 20) and not visible.all()
    assert torch.equal(create_mask(mask_mod, 2, 3, 20, 20, device="cpu"), visible.expand(2, 3, 20, 20))
    assert methods.reference_slice(p.case) == (2, 3)  # the tensor is sized for the whole call: no slicing


def test_sweep_writes_a_png(tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    code = cli.main(["bench", "--interpret", "--shape", SHAPE, "--seq-lens", "16,48", "--mask", "causal", "--methods",
                     "naive,attngen", "--plot", str(plot), "--json", "-"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)  # --json - puts nothing else on stdout
    assert [c["seq_len"] for c in data["cases"]] == [16, 48]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


@pytest.mark.parametrize("args,message", [
    (["--methods", "naive,fast"], "--methods: unknown method(s) 'fast'; valid: naive, naive_out"),
    (["--shape", "4,16,4096"], "--shape must be four positive integers B,H,S,D, got '4,16,4096'"),
    (["--shape", "1,2,0,16"], "--shape must be four positive integers"),
    (["--dtype", "fp8"], "--dtype must be one of fp16, bf16, fp32"),
    (["--mask", "document"], "--mask 'document' needs tensor parameter(s) document's doc_ids"),
    (["--mask", "sliding_window"], "--mask 'sliding_window': mask 'sliding_window' is missing parameter 'window'"),
    (["--mask", "nonsense"], "--mask 'nonsense': unknown mask 'nonsense'"),
    (["--mask", "causal(align='diagonal')"], "--mask \"causal(align='diagonal')\": mask 'causal' parameter 'align'"),
    (["--json", "-", "--csv", "-"], "only one output can go to stdout"),
])
def test_bad_options_give_clear_errors(args, message, capsys):
    code = cli.main(["bench", "--interpret", "--shape", SHAPE] + args)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_bad_list_option_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--interpret", "--seq-lens", "1k"])
    assert info.value.code == 2 and "--seq-lens" in capsys.readouterr().err


def test_reference_slice_keeps_the_float64_check_affordable():
    assert methods.reference_slice(case()) == (1, 2)
    big = Case(4, 16, 32768, 128, "bf16", "causal")
    assert methods.reference_slice(big) == (1, 1)
    assert methods.reference_slice(Case(4, 16, 4096, 128, "bf16", "none")) == (1, 16)
    assert math.isnan(methods.max_rel_error([torch.full((1, 1, 2, 2), float("nan"))], [torch.ones(1, 1, 2, 2)]))
