"""The smoke test of an installed attngen (`make package` runs it in a fresh venv, once with the
wheel installed, once with the sdist), from a folder outside the source tree:

    python tests/smoke_installed.py dist/attngen-0.1.0-py3-none-any.whl

It checks that attngen comes from that file (pip's direct_url.json), that the data folders and the
command line were installed, and that a kernel renders, runs (under Triton's interpreter without
CUDA) and trains against the float64 reference. Not a pytest file: it runs without pytest.
"""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import attngen  # noqa: E402
from attngen.paths import data_dir  # noqa: E402


def main(artifact: str) -> None:
    installed = Path(attngen.__file__).resolve().parent
    assert Path(sys.prefix).resolve() in installed.parents, f"attngen imported from {installed}, not {sys.prefix}"
    dist = metadata.distribution("attngen")
    origin = json.loads(dist.read_text("direct_url.json"))["url"]
    assert origin.endswith("/" + Path(artifact).name), f"attngen was installed from {origin}, not {artifact}"
    assert dist.version == attngen.__version__

    for name in ("templates", "search_spaces", "tuned"):
        assert data_dir(name).parent == installed, data_dir(name)
    assert (data_dir("tuned") / "h200.yaml").is_file()
    assert {"causal", "sliding_window", "softcap", "key_padding"} <= set(attngen.templates())

    command = Path(sys.prefix) / "bin" / "attngen"
    version = subprocess.run([command, "--version"], capture_output=True, text=True, check=True).stdout
    assert version == f"attngen {attngen.__version__}\n", version
    source = subprocess.run([command, "render", "--mask", "causal & softcap(cap=5.0)"], capture_output=True,
                            text=True, check=True).stdout
    assert source.startswith("# Rendered by attngen from templates/kernels/forward.py.jinja"), source[:200]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(1, h, 33, 16, device=device, requires_grad=True) for h in (4, 2, 2))
    mask = attngen.mask("sliding_window", window=9) & attngen.mask("softcap", cap=5.0)
    out = attngen.attention(q, k, v, mask=mask)
    out.square().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = attngen.reference.attention(q, k, v, mask=mask)
    ref.square().sum().backward()
    for got, want in zip([out] + grads, [ref] + [t.grad for t in (q, k, v)]):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 1e-4, f"relative error {err:.2e} against the float64 reference"
    print(f"attngen {attngen.__version__} from {Path(artifact).name}: installed in {sys.prefix}, smoke test passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/smoke_installed.py PATH_OF_THE_INSTALLED_WHEEL_OR_SDIST")
    main(sys.argv[1])
