"""Per-process peak memory of one long video sequence through a Wan transformer, 1 process vs 2 processes splitting it
(`dist.sequence_parallel: 2`, mmrl.distributed.sequence: diffusers' Ulysses attention; gloo on CPU).

    .venv/bin/python benchmarks/sequence_parallel.py [--frames 8] [--size 64] [--threads 1]

A Wan2.1-layout transformer at a CPU-sized width (4 heads x 32, 2 blocks, FFN 512, all weights trainable) takes one
row of latent video (16 channels x frames x size x size, patch 1 x 2 x 2: frames * size^2 / 4 tokens) through forward
and backward. Each process measures the peak bytes of the tensors created in that forward + backward and still alive
(activations, attention temporaries, gradients; weights and inputs excluded): exact tensor bytes, as
benchmarks/real_width.py measures them (what a GPU's caching allocator has to serve), not the resident size.
The split run's output and summed gradients are checked against the single process (max |difference| printed).
Prints a Markdown table and the command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MIB = 2**20


def build(seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16,
                                 out_channels=16, text_dim=64, freq_dim=256, ffn_dim=512, num_layers=2,
                                 rope_max_seq_len=1024)


def inputs(frames: int, size: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, frames, size, size, generator=g), "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, 32, 64, generator=g)}


def measure(model, kw: dict) -> dict:
    """Output, gradients, peak new tensor bytes and seconds of one forward + backward of `model` on `kw`."""
    from real_width import _tensor_peak_mode

    existing = [*model.parameters(), *model.buffers(), *kw.values()]
    t0 = time.perf_counter()
    with _tensor_peak_mode(existing) as peak:
        out = model(**kw, return_dict=False)[0]
        out.square().mean().backward()
    took = time.perf_counter() - t0
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "grads": grads, "peak": peak.extra, "s": took}


def _rank(ctx, frames: int, size: int, out_dir: str) -> None:
    from mmrl.distributed import sequence

    view = sequence.data_parallel_view(ctx, 2)
    model = build()
    sequence.apply(model, view, "wan")
    torch.save(measure(model, inputs(frames, size)), Path(out_dir) / f"rank{ctx.rank}.pt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=8, help="latent frames")
    ap.add_argument("--size", type=int, default=64, help="latent height = width")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.frames < 1 or args.size < 2 or args.size % 2 or (args.frames * args.size ** 2 // 4) % 2:
        raise SystemExit("--frames >= 1 and an even --size >= 2 whose tokens (frames * size^2 / 4) are even")
    torch.set_num_threads(args.threads)
    from mmrl.testing import spawn_ranks

    tokens = args.frames * args.size ** 2 // 4
    one = measure(build(), inputs(args.frames, args.size))
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_rank, args.frames, args.size, tmp)
        two = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(2)]
    out_diff = max((r["out"] - one["out"]).abs().max().item() for r in two)
    grad_diff = max((two[0]["grads"][n] + two[1]["grads"][n] - g).abs().max().item() for n, g in one["grads"].items())
    print(f"Wan-layout transformer (4 heads x 32, 2 blocks), one row of {args.frames} x {args.size} x {args.size} "
          f"latents = {tokens} video tokens + 32 text tokens, forward + backward, CPU, {args.threads} thread(s)\n")
    print("| processes | tokens per process | peak new tensor MiB per process | vs 1 process | seconds |")
    print("|---|---|---|---|---|")
    print(f"| 1 | {tokens} | {one['peak'] / MIB:.1f} | 1.00 | {one['s']:.1f} |")
    peak2 = max(r["peak"] for r in two)
    print(f"| 2 (`dist.sequence_parallel: 2`) | {tokens // 2} | {peak2 / MIB:.1f} | {peak2 / one['peak']:.2f} | "
          f"{max(r['s'] for r in two):.1f} |")
    print(f"\nsplit vs one process: output max |diff| {out_diff:.1e}, summed gradients max |diff| {grad_diff:.1e}")
    print(f"\n`{shlex.join(['python', 'benchmarks/sequence_parallel.py', *(sys.argv[1:] if argv is None else argv)])}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
