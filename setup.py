"""bam-surgery: model surgery and checkpoint conversion for mixture-of-experts upcycling (BAM, BTX).

One import namespace, `bam_surgery`: the repository's top-level layer folders are mapped into it
(`runtime/` -> `bam_surgery.runtime`, ...), so installing adds no other top-level import name.
"""
from setuptools import find_packages, setup

LAYERS = ("runtime", "converters", "train", "surgery", "recipes")
packages = ["bam_surgery"]
package_dir = {"bam_surgery": "bam_surgery"}
for layer in LAYERS:
    for sub in [layer] + [f"{layer}.{p}" for p in find_packages(where=layer)]:
        packages.append(f"bam_surgery.{sub}")
        package_dir[f"bam_surgery.{sub}"] = sub.replace(".", "/")

setup(
    name="bam-surgery",
    version="0.1.0",
    description="Merge specialized dense LLM checkpoints into BAM / BTX mixture-of-experts models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    package_data={"bam_surgery.recipes": ["*.yaml", "README.md", "pipelines/*.yaml", "pipelines/README.md"],
                  "bam_surgery.converters.hf_bam": ["*.py"]},
    # Exact pins for a reproducible environment live in requirements*.txt (the Makefile uses them).
    install_requires=["torch>=2.4", "safetensors>=0.4", "numpy", "click>=8.1", "tqdm",
                      "huggingface_hub>=0.24", "PyYAML>=6", "tokenizers>=0.19", "datasets", "pyarrow", "matplotlib",
                      "onnx>=1.16", "onnxruntime>=1.18", "onnxscript>=0.1"],
    extras_require={"test": ["transformers==5.23.0", "pytest>=8"]},
    entry_points={"console_scripts": ["bam-surgery = bam_surgery.surgery.launch:main"]},
)
