"""bam-surgery: merge dense checkpoints branched from one seed into BAM / BTX mixtures.

The one import namespace of the project. Its layers live in the repository's top-level folders and
are mapped here by setup.py (package_dir); imports point down only:

    bam_surgery.cli          the commands (click), the console-script entry, the demo
    bam_surgery.pipeline     the seed / branch / mix / train / eval / report workflow
    bam_surgery.app          the use cases (export, ...) as plain functions the CLI and pipeline call
    bam_surgery.surgery      recipes -> plan -> streamed execution, audits, inspect, hashing
    bam_surgery.train        training and evaluation: data, tokenizers, the run loop, DDP/FSDP2
    bam_surgery.converters   Hugging Face architectures <-> canonical names, exporters
    bam_surgery.runtime      config, canonical layout, checkpoint format, the model
    bam_surgery.recipes      the shipped YAML recipes (data)
"""
__version__ = "0.1.0"
