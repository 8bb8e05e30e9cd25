"""`attngen profile` on the CPU, under Triton's interpreter."""

import json
import subprocess

import pytest
import torch

from attngen import cli
from helpers import attngen_cmd, cli_env

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU profile under --interpret")


def test_profile_prints_the_table_and_writes_a_chrome_trace(tmp_path):
    r = subprocess.run(attngen_cmd("profile", "--interpret", "--method", "attngen", "--shape", "1,2,37,16", "--mask",
                                   "causal", "--trace", "trace.json", "--memory", "--row-limit", "8", "--steps", "2"),
                       env=cli_env(tmp_path), capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "attngen profile: attngen" in r.stdout and "sorted by cpu_time_total" in r.stdout
    assert "Self CPU" in r.stdout and "CPU Mem" in r.stdout  # the key_averages table, with memory columns
    assert "attngen bench step: attngen" in r.stdout
    assert "memory per operator, sorted by self_cpu_memory_usage" in r.stdout
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("name") == "attngen bench step: attngen" for e in trace["traceEvents"])


@pytest.mark.parametrize("args,message", [
    (["--method", "fast"], "--method: unknown method 'fast'; valid: naive"),
    (["--steps", "0"], "--steps and --row-limit must be >= 1, got 0 and 20"),
    (["--dtype", "fp8"], "--dtype must be one of fp16, bf16, fp32, got 'fp8'"),
    (["--method", "sdpa_cudnn", "--shape", "1,1,8,16"], "--method sdpa_cudnn cannot run B=1 H=1 S=8 D=16"),
])
def test_profile_names_what_is_wrong(args, message, capsys):
    assert cli.main(["profile", "--interpret", *args]) == 2
    assert message in capsys.readouterr().err
