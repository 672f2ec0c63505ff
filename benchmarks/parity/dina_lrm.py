"""DiNa-LRM parity: mmrl's `dina_lrm` against the authors' scoring code on a tiny checkpoint in their layout.

    PYTHONPATH=. .venv/bin/python benchmarks/parity/dina_lrm.py --ref /tmp/ref-dina --python /tmp/ref-dina/venv/bin/python

`--ref`: a directory holding the authors' `diffusion_rm` package (git archive of HKUST-C4G/diffusion-rm); `--python`:
an interpreter that imports it (their inference module imports omegaconf and sklearn: a side venv over this one's
packages with those two added). Nothing of theirs is patched. Builds `mmrl.tiny.build_tiny_dina_lrm`, scores N fixed
latents (several sizes) and prompts at each u with their `DRMInferencer.reward` (prompts through their
`encode_prompt`, one latent per call after `torch.manual_seed(seed)`, so their `randn_like` noise is the draw mmrl's
`noise_seed` makes) and with `mmrl.rewards.load("dina_lrm", ...)` (one batched call), and prints the max |diff| of the
raw scores and the authors' commit.
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
SIZES = [(16, 16), (16, 16), (8, 12), (16, 16)]
US = [0.4, 0.1, 0.9]
SEED = 7

REF = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from diffusers import StableDiffusion3Pipeline
from diffusion_rm.infer.inference import DRMInferencer
from diffusion_rm.models.sd3_rm import encode_prompt
weights, data = sys.argv[2], torch.load(sys.argv[3])
pipe = StableDiffusion3Pipeline.from_pretrained(weights + "/base", dtype=torch.float32)
scorer = DRMInferencer(pipeline=pipe, config_path=weights + "/config.json", model_path=weights + "/checkpoint",
                       load_from_disk=True, device="cpu", model_dtype=torch.float32)
encs = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
toks = [pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3]
out = {}
with torch.no_grad():
    for u in data["us"]:
        raw = []
        for x, p in zip(data["latents"], data["prompts"]):
            pe, pooled = encode_prompt(encs, toks, [p], max_sequence_length=256)
            torch.manual_seed(data["seed"])
            raw.append(float(scorer.reward({"encoder_hidden_states": pe, "pooled_projections": pooled}, x[None], u=u)))
        out[str(u)] = raw
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="directory holding the authors' diffusion_rm package")
    ap.add_argument("--python", default=sys.executable, help="interpreter that imports it (default: this one)")
    args = ap.parse_args()
    from mmrl.rewards import load
    from mmrl.tiny.latent_rewards import build_tiny_dina_lrm

    ref = Path(args.ref)
    commit = (ref / "COMMIT").read_text().strip() if (ref / "COMMIT").is_file() else "unknown"
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(4, h, w, generator=g) for h, w in SIZES]
    with tempfile.TemporaryDirectory() as tmp:
        weights = build_tiny_dina_lrm(Path(tmp) / "dina")
        data = Path(tmp) / "inputs.pt"
        torch.save({"latents": latents, "prompts": PROMPTS, "us": US, "seed": SEED}, data)
        script = Path(tmp) / "ref.py"
        script.write_text(REF)
        res = subprocess.run([args.python, str(script), str(ref), str(weights), str(data)], capture_output=True,
                             text=True)
        if res.returncode:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        theirs = json.loads(res.stdout.strip().splitlines()[-1])
        worst, n = 0.0, 0
        for u in US:
            reward = load("dina_lrm", weights=weights, u=u, noise_seed=SEED, normalize=False, device="cpu")
            ours = []
            for hw in sorted(set(SIZES)):  # one batched call per latent size
                idx = [i for i, s in enumerate(SIZES) if s == hw]
                out = reward(latents=torch.stack([latents[i] for i in idx]), prompts=[PROMPTS[i] for i in idx])
                ours += list(zip(idx, out.scores.tolist()))
            ours = [s for _, s in sorted(ours)]
            diff = max(abs(a - b) for a, b in zip(ours, theirs[str(u)]))
            print(f"u={u}: mmrl {[round(s, 6) for s in ours]}\n       authors {[round(s, 6) for s in theirs[str(u)]]}"
                  f"\n       max |diff| {diff:.3g}")
            worst, n = max(worst, diff), n + len(ours)
    print(f"DiNa-LRM parity vs HKUST-C4G/diffusion-rm@{commit}: max |diff| = {worst:.3g} over {n} scores (raw)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
