"""attngen: an autotuning generator of Triton attention kernels.

    import attngen
    out = attngen.attention(q, k, v, mask="causal")
    out = attngen.attention(q, k, v, mask=attngen.mask("sliding_window", window=256) & attngen.mask("softcap", cap=50.0))
    out = attngen.attention(q, k, v, mask=attngen.block_sparse(layout, (128, 128)), topk=64)
"""

from .version import __version__
from . import reference  # noqa: E402
from .api import attention  # noqa: E402
from .decoding import decode  # noqa: E402
from .dispatch import explain, use_registry  # noqa: E402
from .kernels.forward import dropout_mask  # noqa: E402
from .masks import Mask, mask, register_template_dir, templates  # noqa: E402
from .masks import layouts  # noqa: E402
from .masks.layouts import block_sparse  # noqa: E402
from .render import TemplateError  # noqa: E402
from .sdpa import scaled_dot_product_attention, sdpa_override  # noqa: E402
from .varlen import varlen_attention  # noqa: E402

__all__ = ["attention", "decode", "explain", "use_registry", "dropout_mask", "mask", "Mask", "block_sparse", "layouts",
           "register_template_dir", "templates", "reference", "TemplateError", "scaled_dot_product_attention",
           "sdpa_override", "varlen_attention", "__version__"]
