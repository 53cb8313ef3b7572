"""Peak memory of `bam-surgery export-onnx` against the size of the model it exports.

    .venv/bin/python -m benchmarks.onnx_memory mix.safetensors [--verify] [--python OTHER/bin/python]

Runs `python -m bam_surgery export-onnx CKPT --out TMP [--verify]` as a child process (benchmarks/measure.py: peak
RSS is the child's ru_maxrss, forked from a small launcher; anonymous and file-backed pages sampled at 20 Hz),
with the page cache warm, and prints the peak against the checkpoint's bytes (fp32 export: the model's size in
memory). --python runs another checkout's interpreter (an older commit, for a before/after). A 1.8 GB model needs
about 2.4 GB here (issue 31; it needed 9.2 GB before); leave room for the old figure when measuring an older commit.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.measure import Step, measure, total_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--verify", action="store_true", help="export-onnx --verify (onnxruntime against the runtime)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose bam_surgery runs the export")
    a = ap.parse_args()
    size = total_bytes([a.checkpoint])
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [a.python, "-m", "bam_surgery", "export-onnx", str(a.checkpoint.resolve()), "--out", f"{tmp}/onnx"]
        step = measure(Step("onnx", "export-onnx", "verify" if a.verify else "", cmd + ["--verify"] * a.verify, "warm"),
                       [a.checkpoint], Path(tmp) / "log.txt", cold=False)
        log = (Path(tmp) / "log.txt").read_text()
    result = {"command": " ".join(cmd + ["--verify"] * a.verify), "rc": step.rc, "model_bytes": size,
              "peak_rss_mib": round(step.peak_rss_mb), "anon_mib": round(step.peak_anon_mb),
              "file_mib": round(step.peak_file_mb), "peak_over_model": round(step.peak_rss_mb * 2**20 / size, 2),
              "wall_s": round(step.wall_s, 1), "other_cpu_s": round(step.other_cpu_s, 1),
              "load_before": step.load_before, "log_tail": log.strip().splitlines()[-2:]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
