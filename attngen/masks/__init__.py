"""Masks: templates (YAML files) -> mask objects -> bound to a call -> block classification.

    template_files  the template files, their parameters, where they are found (the function
                    attngen.masks.templates() lists them)
    objects         Term and Mask (templates with values, combined with & and |), mask(), parse_spec()
    binding         a mask bound to one call: kernel arguments, Triton source, torch evaluation
    blocks          which tiles a mask shows fully, partly or not at all (BlockStructure)
    layouts         block-sparse masks and the usual block layouts
"""

from .binding import (Bound, bind, evaluate_visible, index_env, kernel_params, predicate_fn, predicate_names,
                      same_device, scalar_params, score_fn, triton_score_grads, triton_sources)
from .blocks import EMPTY, FULL, PARTIAL, BlockStructure, block_structure
from .objects import Mask, Term, TracedMask, as_mask, mask, parse_spec
from .template_files import (LOCAL_PARAMS, LOCAL_SUFFIX, SEQUENCE_KEYS, TEMPLATE_PATH_ENV, Param, Template,
                             generation, get_template, register_template_dir, template_dirs, templates)

__all__ = ["Bound", "bind", "evaluate_visible", "index_env", "kernel_params", "predicate_fn", "predicate_names",
           "same_device", "scalar_params", "score_fn", "triton_score_grads", "triton_sources", "EMPTY", "FULL",
           "PARTIAL", "BlockStructure", "block_structure", "Mask", "Term", "TracedMask", "as_mask", "mask", "parse_spec",
           "LOCAL_PARAMS", "LOCAL_SUFFIX", "SEQUENCE_KEYS", "TEMPLATE_PATH_ENV", "Param", "Template", "generation", "get_template", "register_template_dir", "template_dirs",
           "templates"]
