"""VideoAlign parity: mmrl's `videoalign` against the authors' inference code on the tiny checkpoint.

    python benchmarks/parity/videoalign.py --ref /tmp/ref-videoalign/src --ref-python /tmp/ref-videoalign/venv/bin/python \
        --commit 219ab9db64c045e5181a2202d11f686439351292

--ref: an export of github.com/KwaiVGI/VideoAlign (git archive of the commit you compare with), with one line
patched: inference.py `disable_flash_attn2=False` -> True (flash-attn does not run on CPU; sdpa instead).
--ref-python: a Python with the authors' pins (transformers 4.45.2, peft 0.10.0, trl 0.8.6, accelerate 0.34.0,
decord 0.6.0; a venv reusing mmrl's torch, as docs/rewards.md says). The authors' code runs in that process; this
one builds the tiny checkpoint (mmrl.tiny.build_tiny_videoalign), writes the test clips as lossless PNG-in-MOV
files at 16 fps (their reader, decord, decodes them bit-exactly), scores them with mmrl from the same files, and
prints max |diff| per head (normalised and raw) and batched vs one-by-one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HEAD_KEYS = ("VQ", "MQ", "TA", "Overall")
PROMPTS = ["a red square moves to the right", "a cat sitting on a chair", "blue circles on a dark background",
           "a girl in a pink dress walks into a cozy bedroom", "the camera follows a car at night"]


def authors(ref: str, request: str) -> None:
    """Runs in --ref-python: the authors' VideoVLMRewardInference.reward on each set, normalised and raw."""
    import torch

    sys.path.insert(0, ref)
    from inference import VideoVLMRewardInference

    req = json.loads(Path(request).read_text())
    inf = VideoVLMRewardInference(req["ckpt"], device="cpu", dtype=torch.float32)
    out = []
    with torch.no_grad():
        for paths, prompts in req["sets"]:
            out.append({"norm": inf.reward(paths, prompts, use_norm=True),
                        "raw": inf.reward(paths, prompts, use_norm=False)})
    print("AUTHORS_JSON " + json.dumps(out))


def write_clip(frames, path: Path, fps: int = 16) -> None:
    """uint8 [F, H, W, 3] -> a lossless PNG-in-MOV file (widths a multiple of 64: decord 0.6 misreads others)."""
    import av

    with av.open(str(path), mode="w") as c:
        s = c.add_stream("png", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "rgb24"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def clips(root: Path) -> list[tuple[list[str], list[str]]]:
    """Two sets: 3 clips of 9 frames at 64x64 and 2 clips of 17 frames at 96x128 (moving squares on noise)."""
    import numpy as np

    sets = []
    for n, (frames, h, w) in enumerate([(9, 64, 64), (17, 96, 128)]):
        paths = []
        for i in range(3 - n):
            g = np.random.default_rng(10 * n + i)
            video = g.integers(0, 80, size=(frames, h, w, 3)).astype(np.uint8)
            for t in range(frames):
                video[t, h // 3: h // 3 + h // 4, 4 + 3 * t: 4 + 3 * t + w // 4] = g.integers(150, 256, size=3)
            path = root / f"clip{n}_{i}.mov"
            write_clip(video, path)
            paths.append(str(path))
        sets.append((paths, PROMPTS[len(sets) * 3: len(sets) * 3 + len(paths)]))
    return sets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="the authors' repository export (patched as the docstring says)")
    ap.add_argument("--ref-python", required=True, help="a Python with the authors' pinned packages")
    ap.add_argument("--commit", default="", help="the commit --ref was exported from (else `git -C REF rev-parse`)")
    ap.add_argument("--authors", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.authors:
        return authors(args.ref, args.authors)

    import torch

    from mmrl.rewards import load
    from mmrl.tiny import build_tiny_videoalign

    commit = args.commit or subprocess.run(["git", "-C", args.ref, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = build_tiny_videoalign(root / "videoalign")
        sets = clips(root)
        (root / "req.json").write_text(json.dumps({"ckpt": str(ckpt), "sets": sets}))
        run = subprocess.run([args.ref_python, __file__, "--ref", args.ref, "--ref-python", args.ref_python,
                              "--authors", str(root / "req.json")], capture_output=True, text=True, cwd=tmp)
        line = [ln for ln in run.stdout.splitlines() if ln.startswith("AUTHORS_JSON ")]
        if run.returncode or not line:
            sys.exit(f"the authors' code failed:\n{run.stderr[-3000:]}")
        theirs = json.loads(line[0][len("AUTHORS_JSON "):])
        diffs = {f"{kind}/{h}": 0.0 for kind in ("norm", "raw") for h in HEAD_KEYS}
        batch_vs_single, n = 0.0, 0
        overall = [r["Overall"] for ref in theirs for r in ref["norm"]]
        for (paths, prompts), ref in zip(sets, theirs):
            for kind in ("norm", "raw"):
                reward = load("videoalign", weights=ckpt, normalize=kind == "norm", batch_size=8)
                out = reward(images=paths, prompts=prompts)
                for i, r in enumerate(ref[kind]):
                    for h in HEAD_KEYS:
                        diffs[f"{kind}/{h}"] = max(diffs[f"{kind}/{h}"], abs(float(out.details[h.lower()][i]) - r[h]))
                if kind == "norm":
                    n += len(paths)
                    single = torch.cat([reward(images=[p], prompts=[q]).scores for p, q in zip(paths, prompts)])
                    batch_vs_single = max(batch_vs_single, float((single - out.scores).abs().max()))
    print(f"authors: KwaiVGI/VideoAlign@{commit or '?'} (inference.VideoVLMRewardInference.reward), {n} videos")
    print(f"their overall scores span [{min(overall):.4f}, {max(overall):.4f}]")
    for key, value in diffs.items():
        print(f"max |diff| {key:12s} {value:.3g}")
    print(f"batched vs one by one (mmrl, overall): {batch_vs_single:.3g}")


if __name__ == "__main__":
    main()
