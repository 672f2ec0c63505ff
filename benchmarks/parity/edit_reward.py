"""EditReward parity: mmrl's `edit_reward` against the authors' inference code on the same tiny checkpoint and inputs.

    python benchmarks/parity/edit_reward.py --ref-python /tmp/ref-editreward/venv/bin/python --ref-src /tmp/ref-editreward

The reference is TIGER-AI-Lab/EditReward (commit edb027e, the `EditReward/` package and LICENSE exported from the
repository, outside the project), run in a side venv with its pins (transformers==4.57.0, trl==0.8.6) that reuses
this venv's other packages:

    git --git-dir=<fetched EditReward.git> archive edb027e EditReward LICENSE | tar -x -C /tmp/ref-editreward
    python -m venv /tmp/ref-editreward/venv
    echo $PWD/.venv/lib/python3.11/site-packages > /tmp/ref-editreward/venv/lib/python3.11/site-packages/main.pth
    /tmp/ref-editreward/venv/bin/pip install transformers==4.57.0 trl==0.8.6 peft==0.17.1 fire omegaconf "huggingface_hub<1.0"

Steps: build the tiny checkpoint with `mmrl.tiny.build_tiny_edit_reward` (checkpoint/model.safetensors + a hub-layout
Qwen2.5-VL base), write fixed PNG sources and edits (several sizes, a source and its edit of different sizes), score
them with the README's `EditRewardInferencer(config, checkpoint, reward_dim="overall_detail",
rm_head_type="ranknet_multi_head").reward(prompts, image_src, image_paths)` (one batch) and, with the model's
pooling_strategy set to None, each head's output; then with `mmrl.rewards.load("edit_reward", ...)` here. Prints the
max |diff| of the score, sigma and each head's mu. What differs from the authors' run: their
EditReward-Qwen2.5-7B-VL.yaml is copied with `model_name_or_path` set to the tiny base and `bf16: False`,
`torch_dtype: float32` (a float32 comparison on CPU); mmrl also runs float32 here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PROMPTS = ["make the circle red", "add a dog on the left", "turn the sky blue", "remove the yellow star",
           "make it a painting", "replace the cat with a house"]
# (source, edit) sizes as (height, width)
SIZES = [((64, 80), (64, 80)), ((64, 64), (96, 64)), ((200, 300), (200, 300)), ((128, 96), (64, 48)),
         ((512, 512), (256, 256)), ((37, 91), (37, 91))]

REF = r"""
import json, sys, torch
from EditReward import EditRewardInferencer
args = json.loads(sys.argv[1])
inf = EditRewardInferencer(config_path=args["config"], checkpoint_path=args["checkpoint"], device="cpu",
                           reward_dim="overall_detail", rm_head_type="ranknet_multi_head")
with torch.no_grad():
    out = inf.reward(args["prompts"], args["sources"], args["edits"])
    inf.model.pooling_strategy = None  # the model then returns the list of each head's [B, 2]
    heads = inf.model(return_dict=True, **inf.prepare_batch(args["sources"], args["edits"], args["prompts"]))
print("RESULT " + json.dumps({"out": out.float().tolist(), "heads": [h.float().tolist() for h in heads]}))
"""


def write_images(root: Path) -> tuple[list[str], list[str]]:
    from PIL import Image

    rng = np.random.default_rng(0)

    def image(h, w, path):
        # smooth gradients plus noise: resizing matters (pure noise would hide interpolation differences)
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * 200
        Image.fromarray(np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)).save(path)
        return str(path)

    sources = [image(*s, root / f"src{i}.png") for i, (s, _) in enumerate(SIZES)]
    edits = [image(*e, root / f"edit{i}.png") for i, (_, e) in enumerate(SIZES)]
    return sources, edits


def reference_config(src: Path, base: Path, out: Path) -> Path:
    text = (src / "EditReward" / "config" / "EditReward-Qwen2.5-7B-VL.yaml").read_text()
    for old, new in [('model_name_or_path: "Qwen/Qwen2.5-VL-7B-Instruct"', f'model_name_or_path: "{base}"'),
                     ("bf16: True", "bf16: False"), ('torch_dtype: "bfloat16"', 'torch_dtype: "float32"')]:
        if old not in text:
            raise SystemExit(f"EditReward-Qwen2.5-7B-VL.yaml has no line {old!r}: not the config of commit edb027e")
        text = text.replace(old, new)
    out.write_text(text)
    return out


def run_reference(python: str, src: Path, args: dict) -> dict:
    env = {"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([python, "-c", REF, json.dumps(args)], capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"reference run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-python", default="/tmp/ref-editreward/venv/bin/python")
    ap.add_argument("--ref-src", default="/tmp/ref-editreward", help="the folder holding the EditReward package")
    ap.add_argument("--batch-size", type=int, default=4, help="mmrl's batch_size")
    args = ap.parse_args(argv)
    import torch

    from mmrl.rewards import load
    from mmrl.tiny.hpsv3 import build_tiny_edit_reward

    src = Path(args.ref_src)
    root = Path(tempfile.mkdtemp(prefix="edit_reward_parity_"))
    tiny = build_tiny_edit_reward(root / "tiny")
    sources, edits = write_images(root)
    ref = run_reference(args.ref_python, src, {
        "config": str(reference_config(src, tiny / "base", root / "tiny.yaml")),
        "checkpoint": str(tiny / "checkpoint"), "sources": sources, "edits": edits, "prompts": PROMPTS})
    out_ref, heads_ref = np.array(ref["out"]), np.array(ref["heads"])
    torch.set_num_threads(1)
    reward = load("edit_reward", weights=tiny / "checkpoint", processor=tiny / "base", dtype="float32", device="cpu",
                  batch_size=args.batch_size)
    with torch.no_grad():
        out = reward(images=edits, prompts=PROMPTS, metadata=[{"source_image": s} for s in sources])
    d = {k: v.numpy() for k, v in out.details.items()}
    result = {"reference": "TIGER-AI-Lab/EditReward@edb027e EditRewardInferencer", "inputs": len(edits),
              "max_abs_diff_score": float(np.abs(out.scores.numpy() - out_ref[:, 0]).max()),
              "max_abs_diff_sigma": float(np.abs(d["sigma"] - np.exp(out_ref[:, 1])).max()),
              "max_abs_diff_following": float(np.abs(d["following"] - heads_ref[0, :, 0]).max()),
              "max_abs_diff_quality": float(np.abs(d["quality"] - heads_ref[1, :, 0]).max()),
              "score_range": [float(out.scores.min()), float(out.scores.max())]}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
