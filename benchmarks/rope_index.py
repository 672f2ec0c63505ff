"""Speed of mmrl's vectorised ``get_rope_index`` against transformers' own, per Qwen-VL model type.

Batch: 64 left-padded rows of 1-2k tokens, each with 2-4 images (Qwen2.5-VL and Qwen3-VL rows also
carry a 4-frame video in every fourth row). Both implementations get identical inputs and their outputs
are checked equal before timing; then both are timed interleaved in one process (`_timing.interleaved`, thread
CPU time: the machine is shared, so wall time is noisier). Prints a markdown table (ms min / median / max, speed-up
of the medians) and the command.

    .venv/bin/python benchmarks/rope_index.py [--batch 64] [--runs 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from _timing import interleaved, machine, speedup

from mmrl.pipelines.qwen_vl import get_rope_index, mm_token_type_ids, rope_kwargs_from_config

PAD, IMG, VID, VSTART, VEND = 0, 60, 61, 62, 63
MERGE = 2


def tiny_models():
    """Tiny transformers models (only their config and get_rope_index are used)."""
    from transformers import (
        Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLConfig, Qwen2VLModel, Qwen3VLConfig, Qwen3VLModel,
    )

    text = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=16, vocab_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    ids = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    return {
        "qwen2_vl": Qwen2VLModel(Qwen2VLConfig(
            text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2), **ids)),
        "qwen2_5_vl": Qwen2_5_VLModel(Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                               fullatt_block_indexes=[0], tokens_per_second=2), **ids)),
        "qwen3_vl": Qwen3VLModel(Qwen3VLConfig(
            text_config=dict(text, head_dim=8),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                               deepstack_visual_indexes=[]), **ids)),
    }


def make_batch(model_type: str, batch: int, seed: int = 0):
    rng = random.Random(seed)
    rows, image_grids, video_grids, secs = [], [], [], []
    for r in range(batch):
        ids = [rng.randrange(1, 60) for _ in range(rng.randrange(100, 300))]
        for _ in range(rng.randrange(2, 5)):
            h, w = MERGE * rng.randrange(12, 23), MERGE * rng.randrange(12, 23)  # 144..484 tokens per image
            image_grids.append([1, h, w])
            ids += [VSTART] + [IMG] * (h * w // MERGE**2) + [VEND]
            ids += [rng.randrange(1, 60) for _ in range(rng.randrange(10, 80))]
        if model_type != "qwen2_vl" and r % 4 == 0:
            t, h, w = 4, 16, 16
            video_grids.append([t, h, w])
            secs.append(rng.choice([0.5, 1.0, 2.0]))
            if model_type == "qwen3_vl":
                ids += [VSTART]
                for _ in range(t):
                    ids += [5, 6, 7] + [VSTART] + [VID] * (h * w // MERGE**2) + [VEND]
                ids += [VEND]
            else:
                ids += [VSTART] + [VID] * (t * h * w // MERGE**2) + [VEND]
        rows.append(ids)
    L = max(map(len, rows))
    input_ids = torch.full((batch, L), PAD, dtype=torch.long)
    mask = torch.zeros(batch, L, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, L - len(r):] = torch.tensor(r)
        mask[i, L - len(r):] = 1
    video = torch.tensor(video_grids) if video_grids else None
    sec = torch.tensor(secs) if secs else None
    return input_ids, mask, torch.tensor(image_grids), video, sec, [len(r) for r in rows]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = tiny_models()
    import transformers

    print(f"{machine()}, transformers {transformers.__version__}; thread CPU time of {args.runs} interleaved "
          f"rounds after 1 warm-up, ms min / median / max\n")
    print("| model type | batch | tokens/row (min-max) | images | videos | transformers (ms) | mmrl (ms) "
          "| speed-up (medians) |")
    print("|---|---|---|---|---|---|---|---|")
    for model_type, model in models.items():
        input_ids, mask, image_grid, video_grid, secs, lengths = make_batch(model_type, args.batch)
        types = mm_token_type_ids(input_ids, IMG, VID)
        hf_kwargs = dict(mm_token_type_ids=types, image_grid_thw=image_grid, video_grid_thw=video_grid,
                         attention_mask=mask)
        if model_type == "qwen2_5_vl":
            hf_kwargs["second_per_grid_ts"] = secs
        kw = rope_kwargs_from_config(model.config)

        def ours():
            return get_rope_index(input_ids, mask, image_grid, video_grid, secs, **kw)

        def theirs():
            return model.get_rope_index(input_ids, **hf_kwargs)

        a, b = ours(), theirs()
        if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])):
            sys.exit(f"{model_type}: outputs differ, not timing")
        t = interleaved({"transformers": theirs, "mmrl": ours}, repeats=args.runs, warmup=1, clock=time.thread_time)
        n_vid = 0 if video_grid is None else video_grid.shape[0]
        print(f"| {model_type} | {args.batch} | {min(lengths)}-{max(lengths)} | {image_grid.shape[0]} | {n_vid} |"
              f" {t['transformers'].fmt(1e3, 1)} | {t['mmrl'].fmt(1e3, 2)} | "
              f"{speedup(t['transformers'], t['mmrl'], digits=1)} |")
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\ncommand: .venv/bin/python benchmarks/rope_index.py {args_text}".rstrip())


if __name__ == "__main__":
    main()
