"""Export canonical checkpoints to Hugging Face directories with remote code (`trust_remote_code=True`).

configuration_bam.py and modeling_bam.py are the remote code copied into every export; they import only torch
and transformers. export.py writes the directory.
"""
from .export import (canonical_weight_name, check_hf_bam, config_from_hf_dict, export_hf_bam, hf_config_dict,
                     hf_weight_name)

__all__ = ["canonical_weight_name", "check_hf_bam", "config_from_hf_dict", "export_hf_bam", "hf_config_dict",
           "hf_weight_name"]
