"""Hugging Face model directories <-> canonical names: import (a lazy reader) and the exact inverse (a writer).

    families.py       one record per family (its base plus what differs); family.py what a record holds and derives
    architectures.py  the weight-mapping table per model_type (the records'), binding a table to a config
    weights.py        a table's rows and their diff
    config_map.py     config.json <-> ModelConfig: the fields a record's keys are made of, the dense spec
    moe_family.py     the native mixture formats' config maps (mechanisms) and their columns
    ops.py            the named reshape ops the tables use, each with its inverse
    files.py          the files of a model directory (config, weights, index, tokenizer)
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
