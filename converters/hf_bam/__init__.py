"""Export canonical checkpoints to Hugging Face directories with remote code (`trust_remote_code=True`).

configuration_bam.py, modeling_bam.py and schema_bam.py are the remote code copied into every export, with
runtime/blocks.py (the model math) shipped next to them as blocks_bam.py, runtime/routers.py as routers.py and
runtime/config_rules.py (the properties derived from config fields) as config_rules.py and runtime/deltanet.py (the
Gated DeltaNet's math) as deltanet.py;
they import only torch, transformers and each other. export.py writes the directory; it reads schema_bam.py (plain
data), so writing an export needs no transformers.
"""
import sys

from bam_surgery.runtime import blocks as _runtime_blocks
from bam_surgery.runtime import config_rules as _runtime_config_rules
from bam_surgery.runtime import deltanet as _runtime_deltanet
from bam_surgery.runtime import routers as _runtime_routers

# modeling_bam.py imports its siblings `.blocks_bam` and `.routers`: in an export those are the shipped copies of
# runtime/blocks.py and runtime/routers.py, inside this package they are the runtime's modules themselves (so
# `import modeling_bam` works here too).
sys.modules.setdefault(f"{__name__}.blocks_bam", _runtime_blocks)
sys.modules.setdefault(f"{__name__}.routers", _runtime_routers)
sys.modules.setdefault(f"{__name__}.config_rules", _runtime_config_rules)
sys.modules.setdefault(f"{__name__}.deltanet", _runtime_deltanet)

from .export import (canonical_weight_name, check_hf_bam, config_from_hf_dict, export_hf_bam,  # noqa: E402
                     hf_config_dict, hf_weight_name)

__all__ = ["canonical_weight_name", "check_hf_bam", "config_from_hf_dict", "export_hf_bam", "hf_config_dict",
           "hf_weight_name"]
