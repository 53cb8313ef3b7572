"""vLLM serves HF BAM exports (`--format hf` of a mixture) through this plugin: no remote code, no extra flag.

setup.py declares `register` under vLLM's entry-point group `vllm.general_plugins`, which vLLM calls in each of
its processes. It registers the export's config class with transformers' AutoConfig (so vLLM reads config.json
without running the export's remote code) and the export's architecture with vLLM's ModelRegistry as a string,
"module:class": the vLLM model (model.py, which imports vLLM's layers) is imported only when vLLM builds one.

bam-surgery does not depend on vLLM: nothing here imports it until vLLM itself calls `register`.
support.py says, in plain Python, which config values the vLLM model implements; model.py refuses the others
in one line when a model is loaded.
"""
from __future__ import annotations

from ..hf_bam.export import ARCHITECTURE
from ..hf_bam.schema_bam import MODEL_TYPE

MODEL_CLASS = f"{__name__}.model:BamForCausalLM"


def register() -> None:
    """vLLM's plugin hook (it may call it more than once per process)."""
    # lazy: vLLM and transformers are not bam-surgery's dependencies; only vLLM, which has both, calls this
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from ..hf_bam.configuration_bam import BamConfig

    AutoConfig.register(MODEL_TYPE, BamConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
