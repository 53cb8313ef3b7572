"""bam-surgery: model surgery and checkpoint conversion for mixture-of-experts upcycling (BAM, BTX)."""
from setuptools import find_packages, setup

setup(
    name="bam-surgery",
    version="0.1.0",
    description="Merge specialized dense LLM checkpoints into BAM / BTX mixture-of-experts models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["runtime*", "converters*", "surgery*", "recipes*"]),
    package_data={"recipes": ["*.yaml", "README.md"], "converters.hf_bam": ["*.py"]},
    # Exact pins for a reproducible environment live in requirements*.txt (the Makefile uses them).
    install_requires=["torch>=2.4", "safetensors>=0.4", "numpy", "click>=8.1", "tqdm",
                      "huggingface_hub>=0.24", "PyYAML>=6"],
    extras_require={"test": ["transformers==5.23.0", "pytest>=8"]},
    entry_points={"console_scripts": ["bam-surgery = surgery.cli:main"]},
)
