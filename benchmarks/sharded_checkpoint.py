"""Peak CPU memory per rank while a full fine-tuning checkpoint is written: gathered (`dist.checkpoint=full`, every
rank gathers every policy state and the whole AdamW state, rank 0 writes) vs sharded (`dist.checkpoint=sharded`,
torch.distributed.checkpoint: every rank writes its own shards).

Each launch is 2 ranks (gloo, CPU) of FSDP2 over an SD3Transformer2DModel trained in full (fp32, "old" snapshot kept,
as NFT/AWM keep one, AdamW after one step), then one `mmrl.run.save_checkpoint`. Per rank it records the resident
memory (RSS) just before the save and the peak during it (Linux VmHWM, reset right before the save; freed heap is
returned to the OS first with malloc_trim, so a gather cannot hide in memory the process already had). The formats
are launched alternately (A B, B A, ...) in fresh processes; the table gives min / median / max over the launches.

    python benchmarks/sharded_checkpoint.py [--layers 6] [--repeats 3] [--nproc 2]
    python benchmarks/sharded_checkpoint.py --small --repeats 1      # seconds: a 2-layer model
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _timing import machine, markdown_table, spread_of  # noqa: E402

from mmrl.config import RunConfig, TrainConfig  # noqa: E402
from mmrl.distributed import DistConfig, DistContext  # noqa: E402

FORMATS = ("full", "sharded")


@dataclass
class _Cfg(RunConfig):
    algorithm: str = "bench_checkpoint"
    dist: DistConfig = field(default_factory=DistConfig)


def _status_mib(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


def _trim() -> None:
    """Give freed heap back to the OS (glibc), so RSS counts what the save allocates rather than reused pages."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def build_model(layers: int, small: bool):
    """SD3 MMDiT with SD3.5-Medium's width per head (64) and 12 heads (hidden 768), `layers` joint blocks."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    if small:
        return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                     num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                     pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32)
    return SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=64,
                                 num_attention_heads=12, joint_attention_dim=768, caption_projection_dim=768,
                                 pooled_projection_dim=768, out_channels=16, pos_embed_max_size=64)


def worker(ctx: DistContext, fmt: str, out: str, layers: int, small: bool, result: str) -> None:
    from mmrl.adapters import PolicyStates
    from mmrl.run.checkpoint import FullOptimizerState, save_checkpoint
    from mmrl.run.directory import Run

    model = build_model(layers, small).requires_grad_(True)
    n_params = sum(p.numel() for p in model.parameters())
    states = PolicyStates(model, None, old=True)
    fsdp = ctx.enabled
    ctx.wrap_model(model, "fsdp" if fsdp else "none")
    if fsdp:
        states.refresh()
    opt = torch.optim.AdamW(states.trainable_parameters(), lr=1e-4)
    c, d = model.config.in_channels, model.config.joint_attention_dim
    g = torch.Generator().manual_seed(ctx.rank)
    x = {"hidden_states": torch.randn(1, c, 16, 16, generator=g), "encoder_hidden_states": torch.randn(1, 8, d, generator=g),
         "pooled_projections": torch.randn(1, model.config.pooled_projection_dim, generator=g),
         "timestep": torch.tensor([500.0])}
    model(**x).sample.pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    cfg = _Cfg(output_dir=out, train=TrainConfig(max_steps=1, save_every=1),
               dist=DistConfig(strategy="fsdp" if fsdp else "none", checkpoint=fmt))
    with ctx.main_process_first():
        run = Run(cfg, write_config=ctx.is_main)
    stateful = {"optimizer": FullOptimizerState(opt) if fsdp else opt}
    _trim()
    ctx.barrier()
    before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    t0 = time.perf_counter()
    save_checkpoint(ctx, run, 1, states, stateful, fsdp=fsdp)
    took = time.perf_counter() - t0
    peak = _status_mib("VmHWM")
    rows = ctx.all_gather_object({"rank": ctx.rank, "before_mib": before, "peak_mib": peak, "save_s": took})
    if ctx.is_main:
        size = sum(f.stat().st_size for f in (Path(out) / "checkpoints" / "step_1").rglob("*") if f.is_file())
        Path(result).write_text(json.dumps({"ranks": rows, "params": n_params, "checkpoint_mib": size / 2**20}))


def _launch(fmt: str, args, tmp: Path, i: int) -> dict:
    out, result = tmp / f"{fmt}_{i}", tmp / f"{fmt}_{i}.json"
    wargs = (fmt, str(out), args.layers, args.small, str(result))
    if args.nproc == 1:
        import multiprocessing as mp

        proc = mp.get_context("spawn").Process(target=_one_process, args=wargs)  # a fresh process, as with 2 ranks
        proc.start()
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"{fmt}: the 1-process save failed (exit {proc.exitcode})")
    else:
        from mmrl.testing import spawn_ranks

        spawn_ranks(worker, *wargs, world=args.nproc)
    return json.loads(result.read_text())


def _one_process(*wargs) -> None:
    torch.set_num_threads(1)
    worker(DistContext(), *wargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6, help="joint transformer blocks (hidden 768)")
    ap.add_argument("--repeats", type=int, default=3, help="launches per format (alternating)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per launch (1: one process, no FSDP)")
    ap.add_argument("--small", action="store_true", help="a tiny 2-layer model (for a quick check)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.nproc < 1:
        raise SystemExit("--repeats and --nproc must be >= 1")
    runs: dict[str, list[dict]] = {f: [] for f in FORMATS}
    with tempfile.TemporaryDirectory(prefix="mmrl_bench_ckpt_") as tmp:
        for r in range(args.repeats):
            for fmt in (FORMATS if r % 2 == 0 else FORMATS[::-1]):
                runs[fmt].append(_launch(fmt, args, Path(tmp), r))
    params = runs["full"][0]["params"]
    cmd = shlex.join(["python", "benchmarks/sharded_checkpoint.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"`{cmd}` - {machine(1)}\n")
    print(f"SD3 transformer, {params / 1e6:.1f}M parameters trained in full (fp32), 'old' snapshot, AdamW; "
          f"{args.nproc} rank(s) (FSDP2, gloo); {args.repeats} launch(es) per format. Whole tensors per state "
          f"{4 * params / 2**20:.0f} MiB, AdamW moments {8 * params / 2**20:.0f} MiB.\n")
    rows = []
    for fmt in FORMATS:
        for rank in range(args.nproc):
            per = [next(x for x in run["ranks"] if x["rank"] == rank) for run in runs[fmt]]
            before = spread_of([x["before_mib"] for x in per])
            peak = spread_of([x["peak_mib"] for x in per])
            extra = spread_of([x["peak_mib"] - x["before_mib"] for x in per])
            rows.append((fmt, rank, before.fmt(digits=0), peak.fmt(digits=0), extra.fmt(digits=0),
                         spread_of([x["save_s"] for x in per]).fmt(digits=2)))
    print(markdown_table(["format", "rank", "RSS before save MiB", "peak RSS during save MiB",
                          "peak - before MiB", "save s"], rows))
    sizes = {f: spread_of([r["checkpoint_mib"] for r in runs[f]]).median for f in FORMATS}
    print(f"\ncheckpoint size on disk (MiB): full {sizes['full']:.0f}, sharded {sizes['sharded']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
