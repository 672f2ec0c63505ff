"""HPSv3 parity: mmrl's `hpsv3` reward against the authors' inference code on the same tiny checkpoint and inputs.

    python benchmarks/parity/hpsv3.py --ref-python /tmp/ref-hpsv3/venv/bin/python --ref-src /tmp/ref-hpsv3/src

The reference is the authors' package `hpsv3` 1.0.0 (PyPI; it pins transformers==4.45.2), unpacked outside the
project and run in a side venv that reuses this venv's packages:

    python -m pip download hpsv3==1.0.0 --no-deps -d /tmp/ref-hpsv3/dl
    unzip /tmp/ref-hpsv3/dl/hpsv3-1.0.0-py3-none-any.whl -d /tmp/ref-hpsv3/src
    python -m venv /tmp/ref-hpsv3/venv
    echo $PWD/.venv/lib/python3.11/site-packages > /tmp/ref-hpsv3/venv/lib/python3.11/site-packages/main.pth
    /tmp/ref-hpsv3/venv/bin/pip install transformers==4.45.2 trl==0.11.4 peft==0.13.2 fire omegaconf "huggingface_hub<0.30"

Steps: build the tiny checkpoint with `mmrl.tiny.build_tiny_hpsv3` (HPSv3.safetensors + a hub-layout Qwen2-VL base),
write fixed PNG images (several sizes and aspect ratios) and prompts, score them with
`hpsv3.HPSv3RewardInferencer(...).reward(paths, prompts)` in the side venv (one batch, their padding), and with
`mmrl.rewards.load("hpsv3", ...)` here; print the max |diff| of mu and of sigma. What differs from the authors' run,
and why: their HPSv3_7B.yaml is copied with `model_name_or_path` set to the tiny base and `bf16: False`,
`torch_dtype: float32` (a float32 comparison on CPU; they run bfloat16 on CUDA); mmrl also runs float32 here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPTS = ["a red circle", "a blue square on the left", "a photo of a cat on a house",
           "two yellow stars in the sky", "a dog", "a beautiful detailed digital painting of a mountain"]
SIZES = [(64, 80), (64, 64), (200, 300), (128, 96), (512, 512), (37, 91)]  # (height, width)

REF = r"""
import json, sys, torch
from hpsv3 import HPSv3RewardInferencer
args = json.loads(sys.argv[1])
inf = HPSv3RewardInferencer(config_path=args["config"], checkpoint_path=args["checkpoint"], device="cpu")
with torch.no_grad():
    out = inf.reward(args["images"], args["prompts"])
print("RESULT " + json.dumps(out.float().tolist()))
"""


def write_images(root: Path) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(SIZES):
        # smooth gradients plus noise: resizing matters (pure noise would hide interpolation differences)
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * 200
        arr = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
        paths.append(str(root / f"img{i}.png"))
        Image.fromarray(arr).save(paths[-1])
    return paths


def reference_config(src: Path, base: Path, out: Path) -> Path:
    text = (src / "hpsv3" / "config" / "HPSv3_7B.yaml").read_text()
    for old, new in [('model_name_or_path: "Qwen/Qwen2-VL-7B-Instruct"', f'model_name_or_path: "{base}"'),
                     ("bf16: True", "bf16: False"), ('torch_dtype: "bfloat16"', 'torch_dtype: "float32"')]:
        if old not in text:
            raise SystemExit(f"HPSv3_7B.yaml has no line {old!r}: not the hpsv3 1.0.0 config")
        text = text.replace(old, new)
    out.write_text(text)
    return out


def run_reference(python: str, src: Path, args: dict) -> np.ndarray:
    env = {"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([python, "-c", REF, json.dumps(args)], capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"reference run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return np.array(json.loads(line[len("RESULT "):]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-python", default="/tmp/ref-hpsv3/venv/bin/python")
    ap.add_argument("--ref-src", default="/tmp/ref-hpsv3/src", help="the unpacked hpsv3 1.0.0 wheel")
    ap.add_argument("--batch-size", type=int, default=8, help="mmrl's batch_size")
    args = ap.parse_args(argv)
    import torch

    from mmrl.rewards import load
    from mmrl.tiny.hpsv3 import build_tiny_hpsv3

    src = Path(args.ref_src)
    version = next(src.glob("hpsv3-*.dist-info"), None)
    root = Path(tempfile.mkdtemp(prefix="hpsv3_parity_"))
    tiny = build_tiny_hpsv3(root / "tiny")
    images = write_images(root)
    ref = run_reference(args.ref_python, src, {
        "config": str(reference_config(src, tiny / "base", root / "tiny.yaml")),
        "checkpoint": str(tiny / "HPSv3.safetensors"), "images": images, "prompts": PROMPTS})
    torch.set_num_threads(1)
    reward = load("hpsv3", weights=tiny / "HPSv3.safetensors", processor=tiny / "base", dtype="float32",
                  device="cpu", batch_size=args.batch_size)
    with torch.no_grad():
        out = reward(images=images, prompts=PROMPTS)
    mu, sigma = out.scores.numpy(), out.details["sigma"].numpy()
    result = {"reference": version.name if version else str(src), "inputs": len(images),
              "max_abs_diff_mu": float(np.abs(mu - ref[:, 0]).max()),
              "max_abs_diff_sigma": float(np.abs(sigma - np.exp(ref[:, 1])).max()),
              "mu_range": [float(mu.min()), float(mu.max())]}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
