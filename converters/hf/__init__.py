"""Hugging Face model directories <-> canonical names: import (a lazy reader) and the exact inverse (a writer).

    architectures.py  one weight-mapping table per model_type (llama, mistral, qwen2, gpt_neox, gpt2, cohere, phi,
                      mixtral)
    config_map.py     config.json <-> ModelConfig, one spec per model_type
    ops.py            the named reshape ops the tables use, each with its inverse
    files.py          the files of a model directory (config, weights, index, tokenizer)
    mixtral_config.py Mixtral's config.json map and what a mixture needs to be written as Mixtral
    reader.py         HFCheckpointReader: the reader protocol over an HF directory (Mixtral included)
    writer.py         any table run backwards into an HF directory, streamed (save_hf: a dense model)
"""
from ..base import CapabilityError
from .architectures import ARCHITECTURES, Architecture, WeightRule, architecture, bind
from .config_map import hf_to_model_config, model_config_to_hf
from .files import TOKENIZER_FILES
from .reader import HFCheckpointReader
from .writer import save_hf

__all__ = ["ARCHITECTURES", "Architecture", "CapabilityError", "HFCheckpointReader", "TOKENIZER_FILES",
           "WeightRule", "architecture", "bind", "hf_to_model_config", "model_config_to_hf", "save_hf"]
