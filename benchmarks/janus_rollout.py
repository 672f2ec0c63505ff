"""Janus guided image-token rollout: mmrl's `JanusPolicy.sample` against transformers' own
`generate(generation_mode="image")`, same work, on tiny Janus checkpoints (`mmrl.tiny.build_tiny_janus`).

    .venv/bin/python benchmarks/janus_rollout.py [--repeats 5] [--threads 1]

Per size: one prompt, 4 images, guidance 5, sampling with `top_k=0` (the whole codebook, as the policy samples),
interleaved (`_timing.interleaved`, one warm-up round), ms min / median / max, and whether the tokens are equal for
the same seed (they must be: the policy draws from the same random stream). No VQ decode on either side (`generate`
returns tokens). Sizes: 16 tokens (the tiny demo's grid) and 576 tokens (Janus-Pro's 24 x 24 grid at 384 px), the
decoder at the tiny width 32: what is timed is the per-token work around the decoder, not the decoder's matmuls.
Prints a Markdown table and the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from _timing import interleaved, machine, markdown_table, speedup

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = "a red circle on a blue background"
SIZES = {"16 tokens (16 px, patch 4)": (16, 4), "576 tokens (384 px, patch 16)": (384, 16)}
IMAGES, GUIDANCE = 4, 5.0


def compare(path: Path, repeats: int):
    from mmrl.ar_image.janus import JanusPolicy, load_janus

    model, processor = load_janus(path, torch.device("cpu"), torch.float32)
    policy = JanusPolicy(model, processor, guidance_scale=GUIDANCE)
    ids = policy.prompt_ids(PROMPT)
    out = {}

    def ours():
        torch.manual_seed(0)
        out["mmrl"] = policy.sample(ids, IMAGES)[0]

    def theirs():
        torch.manual_seed(0)
        with torch.no_grad():
            out["transformers"] = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                 generation_mode="image", do_sample=True, guidance_scale=GUIDANCE,
                                                 top_k=0, num_return_sequences=IMAGES)

    times = interleaved({"mmrl": ours, "transformers": theirs}, repeats=repeats, warmup=1)
    return times, torch.equal(out["mmrl"], out["transformers"]), policy.num_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from mmrl.tiny import build_tiny_janus

    torch.set_num_threads(args.threads)
    print(f"`python benchmarks/janus_rollout.py {' '.join(argv if argv is not None else sys.argv[1:])}` - "
          f"{machine(args.threads)}\n", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (size, patch) in SIZES.items():
            path = build_tiny_janus(Path(tmp) / f"m{size}", seed=0, image_size=size, patch_size=patch, aligner_dim=32)
            times, equal, _ = compare(path, args.repeats)
            rows.append((name, times["mmrl"].fmt(1e3, 0), times["transformers"].fmt(1e3, 0),
                         speedup(times["transformers"], times["mmrl"]), "yes" if equal else "NO"))
    print(f"Guided rollout: 1 prompt x {IMAGES} images, guidance {GUIDANCE:g}, tiny Janus (Llama width 32, 2 layers); "
          "ms min / median / max, interleaved\n")
    print(markdown_table(["image tokens", "mmrl JanusPolicy.sample", "transformers generate(image)",
                          "transformers / mmrl", "same tokens"], rows))
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
