"""bam-surgery: model surgery and checkpoint conversion for mixture-of-experts upcycling (BAM, BTX).

One import namespace, `bam_surgery`: the repository's top-level layer folders are mapped into it
(`runtime/` -> `bam_surgery.runtime`, ...), so installing adds no other top-level import name.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# the one version string: bam_surgery/__init__.py (read as text: importing it here would need its dependencies)
VERSION = re.search(r'^__version__ = "([^"]+)"$', (HERE / "bam_surgery" / "__init__.py").read_text(encoding="utf-8"),
                    re.M).group(1)

LAYERS = ("runtime", "converters", "train", "surgery", "app", "pipeline", "cli", "recipes")
packages = ["bam_surgery"]
package_dir = {"bam_surgery": "bam_surgery"}
for layer in LAYERS:
    for sub in [layer] + [f"{layer}.{p}" for p in find_packages(where=layer)]:
        packages.append(f"bam_surgery.{sub}")
        package_dir[f"bam_surgery.{sub}"] = sub.replace(".", "/")

setup(
    name="bam-surgery",
    version=VERSION,
    description="Merge specialized dense LLM checkpoints into BAM / BTX mixture-of-experts models",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    package_data={"bam_surgery.recipes": ["*.yaml", "README.md", "pipelines/*.yaml", "pipelines/README.md"],
                  "bam_surgery.converters.hf_bam": ["*.py"]},
    # Every third-party package the code imports (tests/project/test_packaging.py checks this list against the imports).
    # Exact pins for a reproducible environment live in requirements*.txt (the Makefile uses them).
    # transformers is not here: exports are written without it; it is what loads them (the HF BAM remote code
    # declares its range, converters/hf_bam/schema_bam.py).
    install_requires=["torch>=2.4", "numpy", "click>=8.1", "tqdm", "blake3>=0.4",
                      "huggingface_hub>=0.24", "PyYAML>=6", "tokenizers>=0.19", "datasets", "pyarrow", "matplotlib",
                      "onnx>=1.16", "onnxruntime>=1.18", "onnxscript>=0.1", "gguf>=0.19", "jinja2>=3.1.6"],
    extras_require={"test": ["transformers==5.23.0", "safetensors", "pytest>=8", "hypothesis"]},
    # vllm.general_plugins: vLLM, where installed, calls this in its processes to serve HF BAM exports
    # (converters/vllm_bam/); bam-surgery itself never imports vLLM
    entry_points={"console_scripts": ["bam-surgery = bam_surgery.cli.launch:main"],
                  "vllm.general_plugins": ["bam_surgery = bam_surgery.converters.vllm_bam:register"]},
)
