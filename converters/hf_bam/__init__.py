"""Export canonical checkpoints to Hugging Face directories with remote code (`trust_remote_code=True`).

configuration_bam.py and modeling_bam.py are the remote code copied into every export, with runtime/blocks.py
(the model math) shipped next to them as blocks_bam.py; they import only torch, transformers and each other.
export.py writes the directory.
"""
import sys

from bam_surgery.runtime import blocks as _runtime_blocks

# modeling_bam.py imports its sibling `.blocks_bam`: in an export that is the shipped copy of runtime/blocks.py,
# inside this package it is runtime.blocks itself (so `import modeling_bam` works here too).
sys.modules.setdefault(f"{__name__}.blocks_bam", _runtime_blocks)

from .export import (canonical_weight_name, check_hf_bam, config_from_hf_dict, export_hf_bam,  # noqa: E402
                     hf_config_dict, hf_weight_name)

__all__ = ["canonical_weight_name", "check_hf_bam", "config_from_hf_dict", "export_hf_bam", "hf_config_dict",
           "hf_weight_name"]
