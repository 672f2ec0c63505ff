"""LPO LRM parity: mmrl's `lpo_lrm` against the authors' SD15PreferenceModel on a tiny checkpoint in their layout.

    PYTHONPATH=. .venv/bin/python benchmarks/parity/lpo_lrm.py --ref /tmp/ref-lpo

`--ref`: a directory holding the authors' `lpo/lpo/preference_models/models/` (git archive of Kwai-Kolors/LPO; it
imports with this venv's packages). Builds `mmrl.tiny.build_tiny_lpo_lrm`, then scores N fixed latents, prompts and
timesteps with their `get_preference_score` (prompts through their `encode_prompt`, CFG 7.5, multi-scale without
CFG: the released LRM-1.5 configs) and with `mmrl.rewards.load("lpo_lrm", ...)` (one batched call), and prints the
max |diff| and the authors' commit. Not patched: their model is built without a checkpoint, its visual_projection
replaced by one of the tiny width (their code hard-codes SD1.5's 4800 pooled channels; the tiny UNet has 120) and
its text_projection read from a file in the layout of their `clip_ckpt_path`, then their own `load(path)` reads
the tiny checkpoint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = ["a red circle", "a blue square on a white background", "a photo of a cat", "two yellow stars"]
TIMESTEPS = [0, 250, 999, 500]

REF = r"""
import json, sys, torch
from accelerate import PartialState
PartialState()  # their logger (accelerate.logging) needs it, as under `accelerate launch`
sys.path.insert(0, sys.argv[1] + "/lpo/lpo/preference_models")
from models.sd15_preference_model import SD15PreferenceModel, SD15PreferenceModelConfig
weights, data = sys.argv[2], torch.load(sys.argv[3])
torch.save({"text_projection.weight": torch.zeros(16, 32)}, sys.argv[3] + ".clip.bin")
cfg = SD15PreferenceModelConfig(pretrained_model_name_or_path=weights + "/base", clip_ckpt_path=sys.argv[3] + ".clip.bin",
                                ft_model_path=None, text_embed_dim=32, projection_dim=16, multi_scale=True,
                                guidance_scale=7.5, multi_scale_cfg=False)
model = SD15PreferenceModel(cfg)
model.visual_projection = torch.nn.Linear(120, 16, bias=False)
model.load(weights)
model.eval()
ids = model.encode_prompt(data["prompts"])
print(json.dumps(model.get_preference_score(data["latents"], ids, data["timesteps"]).tolist()))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="directory holding the authors' lpo/lpo/preference_models/models")
    ap.add_argument("--python", default=sys.executable, help="interpreter that imports it (default: this one)")
    args = ap.parse_args()
    from mmrl.rewards import load
    from mmrl.tiny.latent_rewards import build_tiny_lpo_lrm

    ref = Path(args.ref)
    commit = (ref / "COMMIT").read_text().strip() if (ref / "COMMIT").is_file() else "unknown"
    latents = torch.randn(len(PROMPTS), 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        weights = build_tiny_lpo_lrm(Path(tmp) / "lrm")
        data = Path(tmp) / "inputs.pt"
        torch.save({"latents": latents, "prompts": PROMPTS, "timesteps": torch.tensor(TIMESTEPS)}, data)
        script = Path(tmp) / "ref.py"
        script.write_text(REF)
        res = subprocess.run([args.python, str(script), str(ref), str(weights), str(data)], capture_output=True,
                             text=True)
        if res.returncode:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        theirs = json.loads(res.stdout.strip().splitlines()[-1])
        reward = load("lpo_lrm", weights=weights, base=weights / "base", device="cpu")
        ours = reward(latents=latents, prompts=PROMPTS, metadata=[{"timestep": t} for t in TIMESTEPS]).scores.tolist()
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    print(f"mmrl    {[round(s, 6) for s in ours]}\nauthors {[round(s, 6) for s in theirs]}")
    print(f"LPO LRM parity vs Kwai-Kolors/LPO@{commit}: max |diff| = {diff:.3g} over {len(ours)} scores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
