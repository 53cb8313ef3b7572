"""bam-surgery: merge dense checkpoints branched from one seed into BAM / BTX mixtures.

The Python API (docs/api.md): the use cases as functions with the CLI's names and options, one implementation for
both (app/api.py over app/):

    import bam_surgery as bs
    m = bs.load("seed.gguf")                                   # any checkpoint: model and tokenizer
    bs.merge("seed/", ["code=code/", "law=law/"], "mix.safetensors", ffn_top_k=1)
    bs.extend("run/", ["math=math/"], "mix-plus-math/")          # specialists added to a trained mixture
    bs.convert("mix.safetensors", "mix-hf", "hf")              # export_onnx, export_gguf
    bs.train_model(init="mix.safetensors", data="code=data/domains/code", out="run", steps=20)
    bs.evaluate("run", "code=data/domains/code"); bs.generate("run", "def fib(n):")
    bs.count_params(preset="paper-small", recipe="bam", experts=4, convention="paper"); bs.inspect(...)

Every refusal raises bam_surgery.UserError, whose str() is the one line the CLI prints. `__all__` lists what is
promised; importing the package imports no torch (each name loads its module when first used).

The one import namespace of the project. Its layers live in the repository's top-level folders and
are mapped here by setup.py (package_dir); imports point down only:

    bam_surgery.cli          the commands (click), the console-script entry, the demo
    bam_surgery.pipeline     the seed / branch / mix / train / eval / report workflow
    bam_surgery.app          the use cases as plain functions the CLI, the pipeline and this API call
    bam_surgery.surgery      recipes -> plan -> streamed execution, audits, inspect, hashing
    bam_surgery.train        training and evaluation: data, tokenizers, the run loop, DDP/FSDP2
    bam_surgery.converters   Hugging Face architectures <-> canonical names, exporters
    bam_surgery.runtime      config, canonical layout, checkpoint format, the model
    bam_surgery.recipes      the shipped YAML recipes (data)
"""
__version__ = "0.1.0"

# name -> the module that defines it (loaded when the name is first used: PEP 562)
_API = {name: "bam_surgery.app.api" for name in (
    "load", "merge", "extend", "convert", "export_onnx", "export_gguf", "train_model", "evaluate", "routing_stats", "generate",
    "count_params", "inspect", "formats")}
_API.update(UserError="bam_surgery.app.errors", Reporter="bam_surgery.app.reporter", Quiet="bam_surgery.app.reporter")

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # lazy: the package imports nothing until a name is used

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
