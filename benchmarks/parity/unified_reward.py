"""UnifiedReward parity: the authors' inference scripts and mmrl's `unified_reward` on one tiny checkpoint.

    python benchmarks/parity/unified_reward.py --ref /tmp/ref-unified_reward [--max-new-tokens 512]

`--ref`: a copy of CodeGoat24/UnifiedReward (at least inference_qwen/image_generation/ and
UnifiedReward-Think/inference_qwen/image_generation/). Builds the tiny judge (`mmrl.tiny.build_tiny_unified_reward`:
random weights, so the replies are random text), writes fixed images as PNG files, and runs, in a separate process,
each of the authors' three Qwen image-generation scripts (pointwise score, pairwise rank, Think pairwise) unchanged
but for four assignments: model_path, device_map (cuda:0 -> cpu), the image path(s), the caption (and
max_new_tokens when `--max-new-tokens` is not their 512); their
`output_text` is their reply. mmrl judges the same inputs in batches (`batch_size` 4, left padding). Prints, per
mode, how many replies are identical (character for character) and the parsed scores of both, a control (the
pointwise turns decoded without the checkpoint's repetition_penalty), then the authors' commit (`git rev-parse` of
`--ref`, or its COMMIT file). Takes about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmrl.rewards import load
from mmrl.rewards.group import pairwise_verdict
from mmrl.rewards.unified_reward import UnifiedRewardPairwiseJudge
from mmrl.rewards.vlm_judge import pointwise_verdict
from mmrl.tiny import build_tiny_unified_reward

SCRIPTS = {
    "pointwise": "inference_qwen/image_generation/qwen_point_score_image_generation.py",
    "pairwise": "inference_qwen/image_generation/qwen_pair_rank_image_generation.py",
    "think": "UnifiedReward-Think/inference_qwen/image_generation/qwen_infer_cot_image_generation.py",
}
CAPTIONS = ["a red circle on a blue background", "two yellow stars", "a photo of a cat", "a green square"]
SIZES = [(64, 64), (96, 64), (64, 64), (80, 112)]  # (height, width); pairs use the 64 x 64 ones
PAIRS = [(0, 2), (2, 0), (0, 2)]
PAIR_CAPTIONS = ["a red circle on a blue background", "two yellow stars", "a green square"]

# run by a fresh interpreter: exec each patched script of the authors in its own namespace, dump output_text
RUNNER = """
import json, sys
cases = json.load(open(sys.argv[1]))
out = []
for source in cases:
    ns = {"__name__": "__main__"}
    exec(compile(source, "authors_script", "exec"), ns)
    out.append(ns["output_text"])
json.dump(out, open(sys.argv[2], "w"))
"""


def patch(source: str, model: Path, images: list[Path], caption: str, max_new_tokens: int) -> str:
    """The authors' script with its model path, device, image path(s), caption (and max_new_tokens when not their
    512) replaced; nothing else."""
    subs = [(r"model_path = '[^']*'", f"model_path = {str(model)!r}"),
            (r"max_new_tokens=512", f"max_new_tokens={max_new_tokens}"),
            (r"device_map=\{\"\": 'cuda:0'\}", "device_map={'': 'cpu'}"),
            (r"prompt =\s*(''|\"\")", f"prompt = {caption!r}")]
    if len(images) == 1:
        subs.append((r"image_path = '[^']*'", f"image_path = {str(images[0])!r}"))
    else:
        subs += [(rf"image_path_{k + 1} = '[^']*'", f"image_path_{k + 1} = {str(p)!r}") for k, p in enumerate(images)]
    return substitute(source, subs)


def substitute(source: str, subs: list[tuple[str, str]]) -> str:
    """Each (pattern, replacement) applied to the authors' script, each pattern found exactly once."""
    for pattern, repl in subs:
        source, n = re.subn(pattern, lambda _m, r=repl: r, source)
        if n != 1:
            raise SystemExit(f"parity: pattern {pattern!r} found {n} times in the authors' script (expected 1)")
    return source


def write_images(root: Path) -> tuple[list[Path], list[torch.Tensor]]:
    """The fixed test images (`SIZES`, seed 0) as PNG files under `root` and as [3, H, W] tensors in [0, 1]."""
    rng = np.random.default_rng(0)
    files, tensors = [], []
    for k, (h, w) in enumerate(SIZES):
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(arr).save(root / f"img{k}.png")
        files.append(root / f"img{k}.png")
        tensors.append(torch.from_numpy(arr).permute(2, 0, 1).float() / 255)
    return files, tensors


def cases_of(files: list[Path]) -> list[tuple[str, list[Path], str]]:
    """(mode, image files, caption) of every case: pointwise per image, then pairwise and Think per pair."""
    cases = [("pointwise", [files[k]], CAPTIONS[k]) for k in range(len(SIZES))]
    cases += [(mode, [files[i], files[j]], c) for mode in ("pairwise", "think") for (i, j), c in zip(PAIRS, PAIR_CAPTIONS)]
    return cases


def mmrl_replies(tensors: list[torch.Tensor], **common) -> list[str]:
    """mmrl's replies to `cases_of`'s cases, in order: pointwise in batches, then each pair (pairwise, Think)."""
    point = load("unified_reward", **common)(tensors, CAPTIONS)  # mixed sizes: one batch per size
    ours = list(point.details["response"])
    pair_imgs = torch.stack([tensors[0], tensors[2]])
    index = {0: 0, 2: 1}
    first = torch.tensor([index[i] for i, _ in PAIRS])
    second = torch.tensor([index[j] for _, j in PAIRS])
    for think in (False, True):
        judge = UnifiedRewardPairwiseJudge(think=think, **common)
        # compare() reads prompts[first]: put each pair's caption at its first image's row, one call per pair row
        for k in range(len(PAIRS)):
            prompts = [PAIR_CAPTIONS[k]] * 2
            _, det = judge.compare(pair_imgs, prompts, None, first[k:k + 1], second[k:k + 1])
            ours += det["response"]
    return ours


def report(cases, theirs: list[str], ours: list[str]) -> tuple[int, int]:
    """Print per mode the identical replies and the parsed scores of both; returns (identical, total)."""
    total = same = 0
    for mode in ("pointwise", "pairwise", "think"):
        rows = [k for k, c in enumerate(cases) if c[0] == mode]
        eq = sum(theirs[k] == ours[k] for k in rows)
        if mode == "pointwise":
            parsed = [(pointwise_verdict(theirs[k], 5.0)[:2], pointwise_verdict(ours[k], 5.0)[:2]) for k in rows]
        else:
            parsed = [(pairwise_verdict(theirs[k], mode == "think")[0], pairwise_verdict(ours[k], mode == "think")[0])
                      for k in rows]
        print(f"{mode}: {eq}/{len(rows)} identical replies; parsed (theirs, ours): {parsed}")
        for k in rows:
            if theirs[k] != ours[k]:
                print(f"  differs at case {k}: theirs {theirs[k][:120]!r}\n                 ours   {ours[k][:120]!r}")
        total, same = total + len(rows), same + eq
    print(f"reply lengths (characters): {min(map(len, theirs))}-{max(map(len, theirs))}")
    return same, total


def commit_of(ref: Path) -> str:
    """The authors' commit: `git rev-parse` of `ref`, or its COMMIT file (an export of the files with its commit)."""
    commit = subprocess.run(["git", "-C", str(ref), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not commit and (ref / "COMMIT").is_file():
        commit = (ref / "COMMIT").read_text().strip()
    return commit or "unknown"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="/tmp/ref-unified_reward", help="copy of CodeGoat24/UnifiedReward")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="the scripts' 512, or fewer for a quick check")
    args = ap.parse_args(argv)
    ref = Path(args.ref)
    root = Path(tempfile.mkdtemp(prefix="mmrl_parity_ur_"))
    model = build_tiny_unified_reward(root / "tiny_unified_reward", seed=0)
    files, tensors = write_images(root)
    cases = cases_of(files)
    sources = [patch((ref / SCRIPTS[mode]).read_text(), model, imgs, cap, args.max_new_tokens)
               for mode, imgs, cap in cases]
    (root / "cases.json").write_text(json.dumps(sources))
    (root / "runner.py").write_text(RUNNER)
    subprocess.run([sys.executable, str(root / "runner.py"), str(root / "cases.json"), str(root / "theirs.json")],
                   check=True, cwd=str(ref), stdout=subprocess.DEVNULL)  # (their scripts print the reply)
    theirs = json.loads((root / "theirs.json").read_text())

    common = dict(weights=model, max_new_tokens=args.max_new_tokens, batch_size=4, device="cpu")
    ours = mmrl_replies(tensors, **common)
    print(f"tiny checkpoint {model}, max_new_tokens {args.max_new_tokens}")
    same, total = report(cases, theirs, ours)
    # control: the same pointwise turns decoded without the checkpoint's repetition_penalty (plain argmax) do not
    # reproduce the authors' replies, so agreement above is not a property of any greedy decoding
    plain = load("unified_reward", **common)
    plain.judge.generation_config.repetition_penalty = 1.0
    control = list(plain(tensors, CAPTIONS).details["response"])
    print(f"control, repetition_penalty 1.0: {sum(a == b for a, b in zip(theirs, control))}/{len(control)} "
          f"pointwise replies identical")
    print(f"total: {same}/{total} identical replies; authors' code: CodeGoat24/UnifiedReward@{commit_of(ref)}")

if __name__ == "__main__":
    main()
