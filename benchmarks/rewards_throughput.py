"""Throughput of the image rewards: images/s with internal batching vs one image per call.

    .venv/bin/python benchmarks/rewards_throughput.py [--n 16] [--size 256] [--device cpu] [--threads 0] [--repeats 5]
        [--ocr-repeats 3]

Learned rewards run on the tiny random backbones of `mmrl.tiny` (the real code paths, toy sizes: the numbers
measure the reward plumbing - preprocessing, tokenising, chunking - not the cost of a ViT-H); OCR runs the real
PP-OCRv4 models shipped by rapidocr-onnxruntime on rendered text; JPEG is PIL encoding. For each reward the two
ways (one call on all n images; n calls of one image) are timed interleaved in one process (`_timing.interleaved`:
one warm-up round, then `--repeats` rounds), and the table gives images/s as median (min-max) and the speed-up of
the medians, marked "within spread" when the two ranges overlap. Prints a markdown table.
`videoalign` (a video reward) is timed on its tiny checkpoint with min(n, 4) short clips: videos/s, not images/s.
Not a test; takes about 1-2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import interleaved, machine, markdown_table, speedup

from mmrl.rewards import load
from mmrl.tiny import OPEN_CLIP_CONFIGS, build_tiny_clip, build_tiny_open_clip

PROMPTS = ["a red circle", "a blue square on a white background", "a photo of a cat", "two yellow stars"]


def tiny_aesthetic_mlp(path: Path, in_dim: int) -> Path:
    torch.manual_seed(0)
    mods = [torch.nn.Linear(in_dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1)]
    torch.save({f"layers.{k}": v for k, v in torch.nn.Sequential(*mods).state_dict().items()}, path)
    return path


def tiny_imagereward(root: Path) -> dict:
    """A tiny BLIP (transformers classes, random weights) written in ImageReward.pt's key layout."""
    from transformers import BertTokenizerFast, BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    words = sorted({w for p in PROMPTS for w in p.split()})
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    BertTokenizerFast.from_pretrained(str(root)).save_pretrained(root / "bert")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=5 + len(words) + 2, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=40)
    torch.manual_seed(0)
    v = BlipVisionModel(BlipVisionConfig(**vision, layer_norm_eps=1e-6)).state_dict()
    t = BlipTextModel(BlipTextConfig(**text, encoder_hidden_size=32, is_decoder=True), add_pooling_layer=False).state_dict()
    inverse = [(r"embeddings\.class_embedding", "cls_token"), (r"embeddings\.position_embedding", "pos_embed"),
               (r"embeddings\.patch_embedding\.", "patch_embed.proj."), (r"encoder\.layers\.(\d+)\.layer_norm1", r"blocks.\1.norm1"),
               (r"encoder\.layers\.(\d+)\.layer_norm2", r"blocks.\1.norm2"), (r"encoder\.layers\.(\d+)\.self_attn\.qkv", r"blocks.\1.attn.qkv"),
               (r"encoder\.layers\.(\d+)\.self_attn\.projection", r"blocks.\1.attn.proj"),
               (r"encoder\.layers\.(\d+)\.mlp", r"blocks.\1.mlp"), (r"post_layernorm", "norm")]
    sd = {}
    for k, val in v.items():
        for pat, rep in inverse:
            k = re.sub("^" + pat, rep, k)
        sd["blip.visual_encoder." + k] = val
    sd.update({"blip.text_encoder." + k: val for k, val in t.items()})
    mlp = tiny_aesthetic_mlp(root / "mlp.pth", 24)
    sd.update({"mlp." + k: val for k, val in torch.load(mlp).items()})
    torch.save(sd, root / "ImageReward.pt")
    return dict(weights=root / "ImageReward.pt", tokenizer=root / "bert", med_config=text, vision_config=vision)


def tiny_hpsv3(root: Path) -> dict:
    """HPSv3 on its tiny Qwen2-VL checkpoint in the authors' layout (mmrl.tiny.build_tiny_hpsv3); every image
    is resized to 256*28*28 pixels as the authors do, so the image size does not change its cost."""
    from mmrl.tiny.hpsv3 import build_tiny_hpsv3

    path = build_tiny_hpsv3(root / "hpsv3")
    return dict(weights=path / "HPSv3.safetensors", processor=path / "base", dtype="float32")


def tiny_edit_reward(root: Path) -> dict:
    """EditReward on its tiny Qwen2.5-VL checkpoint in the authors' layout (mmrl.tiny.build_tiny_edit_reward):
    two images (source, edit) per sample, each resized to 256*28*28 pixels, and two instructions (one per head)."""
    from mmrl.tiny.hpsv3 import build_tiny_edit_reward

    path = build_tiny_edit_reward(root / "edit_reward")
    return dict(weights=path / "checkpoint", processor=path / "base", dtype="float32")


def render_text_images(n: int, size: int) -> torch.Tensor:
    from PIL import Image, ImageDraw, ImageFont

    out = []
    for i in range(n):
        im = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(im).text((size // 10, size // 3), f"HELLO {i}", fill="black",
                                font=ImageFont.load_default(size=size // 8))
        out.append(torch.from_numpy(__import__("numpy").array(im)).permute(2, 0, 1).float() / 255)
    return torch.stack(out)


def unified_reward_rows(root: Path, images: torch.Tensor, prompts: list[str], device: str, repeats: int) -> list[tuple]:
    """UnifiedReward (mmrl/rewards/unified_reward.py) on its tiny judge, pointwise: one `generate` call of all images
    (left padding) vs one call per image, each reply 32 new tokens (random weights never stop early)."""
    from mmrl.tiny import build_tiny_unified_reward

    n = images.shape[0]
    reward = load("unified_reward", weights=build_tiny_unified_reward(root / "unified_reward"), max_new_tokens=32,
                  batch_size=n, device=device)
    t = measure(reward, images, prompts, repeats)
    print("  measured unified_reward", file=sys.stderr, flush=True)
    return [("unified_reward", "tiny Qwen2.5-VL judge (transformers generate, 32 tokens)", str(n),
             t["batched"].rate(n).fmt_median(digits=1), t["one by one"].rate(n).fmt_median(digits=1),
             speedup(t["one by one"], t["batched"]))]


def measure(reward, images: torch.Tensor, prompts: list[str], repeats: int, metadata: list | None = None) -> dict:
    """Seconds per pass over all images, batched vs one image per call, interleaved (see the module docstring)."""
    n = images.shape[0]

    def one_by_one():
        for i in range(n):
            reward(images[i:i + 1], prompts[i:i + 1], None if metadata is None else metadata[i:i + 1])

    return interleaved({"batched": lambda: reward(images, prompts, metadata), "one by one": one_by_one},
                       repeats=repeats, warmup=1)


def latent_rows(root: Path, n: int, device: str, repeats: int) -> list[tuple]:
    """Latent rewards (`mmrl.rewards.latent`) on their tiny checkpoints: n latents of their space (DiNa-LRM: SD3 4 x
    32 x 32 at u = 0.4; LPO LRM-1.5: SD1.5 4 x 32 x 32 at t = 500, CFG 7.5), one call vs one latent per call."""
    from mmrl.tiny.latent_rewards import build_tiny_dina_lrm, build_tiny_lpo_lrm

    dina, lpo = build_tiny_dina_lrm(root / "dina"), build_tiny_lpo_lrm(root / "lpo")
    specs = [("dina_lrm", "tiny SD3.5-style, 2 blocks + head", dict(weights=dina), {}),
             ("lpo_lrm", "tiny SD1.5 UNet (down + mid)", dict(weights=lpo, base=lpo / "base"), {"timestep": 500})]
    rows = []
    for name, backbone, kw, meta in specs:
        reward = load(name, batch_size=n, device=device, **kw)
        x = torch.randn(n, reward.latent_space.channels, 32, 32, generator=torch.Generator().manual_seed(0))
        prompts, metadata = [PROMPTS[i % len(PROMPTS)] for i in range(n)], [meta] * n

        def one_by_one():
            for i in range(n):
                reward(latents=x[i:i + 1], prompts=prompts[i:i + 1], metadata=metadata[i:i + 1])

        t = interleaved({"batched": lambda: reward(latents=x, prompts=prompts, metadata=metadata),
                         "one by one": one_by_one}, repeats=repeats, warmup=1)
        rows.append((name, backbone, f"{n} latents", t["batched"].rate(n).fmt_median(digits=1),
                     t["one by one"].rate(n).fmt_median(digits=1), speedup(t["one by one"], t["batched"])))
        print(f"  measured {name}", file=sys.stderr, flush=True)
    return rows
def videoalign_rows(root: Path, args) -> list[tuple]:
    """VideoAlign's VideoReward on its tiny checkpoint (`mmrl.tiny.build_tiny_videoalign`, the authors' layout):
    videos/s batched vs one video per call. 9-frame 64 x 64 clips; the reward samples 4 frames and upscales them to
    its 336 x 336 minimum, so each clip is 288 video tokens plus the ~2.2k-token tiny-vocabulary prompt template."""
    from mmrl.rewards.video import sample_video
    from mmrl.tiny import build_tiny_videoalign

    n = min(args.n, 4)
    videos = torch.stack([sample_video(frames=9, size=64, seed=i, speed=1 + i) for i in range(n)])
    reward = load("videoalign", weights=build_tiny_videoalign(root / "videoalign"), device=args.device, batch_size=n)
    t = measure(reward, videos, [PROMPTS[i % len(PROMPTS)] for i in range(n)], args.repeats)
    return [("videoalign", "tiny Qwen2-VL + LoRA + rm_head (VideoReward layout)", f"{n} videos",
             t["batched"].rate(n).fmt_median(digits=2), t["one by one"].rate(n).fmt_median(digits=2),
             speedup(t["one by one"], t["batched"]))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16, help="images per measurement")
    ap.add_argument("--size", type=int, default=256, help="image side (generated images are square)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds of batched + one by one (after 1 warm-up)")
    ap.add_argument("--ocr-repeats", type=int, default=3, help="--repeats for OCR (about 1 s per image on 1 thread)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="mmrl_bench_"))
    clip = build_tiny_clip(root / "clip")
    oc = build_tiny_open_clip(root / "open_clip")
    (root / "ir").mkdir()
    specs = [
        ("pickscore", "tiny CLIP (transformers)", dict(weights=clip)),
        ("clip_score", "tiny CLIP (transformers)", dict(weights=clip)),
        ("hpsv2", "tiny open_clip CLIP", dict(weights=oc / "hps_style.pt", model_config=OPEN_CLIP_CONFIGS["tiny"])),
        ("aesthetic", "tiny CLIP + MLP", dict(weights=tiny_aesthetic_mlp(root / "aes.pth", 16), clip=clip)),
        ("imagereward", "tiny BLIP (transformers)", tiny_imagereward(root / "ir")),
        ("jpeg_compressibility", "PIL JPEG q95", {}),
        ("ocr", "PP-OCRv4 (rapidocr-onnxruntime, real)", {}),
        ("hpsv3", "tiny Qwen2-VL + reward head (authors' layout)", tiny_hpsv3(root)),
        ("edit_reward", "tiny Qwen2.5-VL + 2 reward heads (authors' layout)", tiny_edit_reward(root)),
    ]
    g = torch.Generator().manual_seed(0)
    images = torch.rand(args.n, 3, args.size, args.size, generator=g)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.n)]
    rows = []
    for name, backbone, kw in specs:
        device_kw = {} if name.startswith("jpeg") or name == "ocr" else {"device": args.device}
        try:
            reward = load(name, batch_size=args.n, **device_kw, **kw)
        except ImportError as exc:
            rows.append((name, backbone, "", "skipped", str(exc), ""))
            continue
        if name == "ocr":
            n = min(args.n, 8)
            imgs, prm = render_text_images(n, args.size), [f'a sign that says "HELLO {i}"' for i in range(n)]
        else:
            imgs, prm = images, prompts
        reward.batch_size = imgs.shape[0]
        # an edit reward reads each edit's source from the metadata: the next image stands in for it
        meta = [{"source_image": imgs[(i + 1) % len(imgs)]} for i in range(len(imgs))] if name == "edit_reward" else None
        t = measure(reward, imgs, prm, args.ocr_repeats if name == "ocr" else args.repeats, meta)
        n = imgs.shape[0]
        rows.append((name, backbone, str(n), t["batched"].rate(n).fmt_median(digits=1),
                     t["one by one"].rate(n).fmt_median(digits=1), speedup(t["one by one"], t["batched"])))
        print(f"  measured {name}", file=sys.stderr, flush=True)
    rows += unified_reward_rows(root, images, prompts, args.device, args.repeats)

    rows += latent_rows(root, args.n, args.device, args.repeats)
    rows += videoalign_rows(root, args)  # videos: its own inputs (see videoalign_rows)

    cmd = " ".join(["python", "benchmarks/rewards_throughput.py"] + (argv if argv is not None else sys.argv[1:]))
    print(f"\n`{cmd}` - {args.n} images of {args.size}x{args.size} (OCR: {min(args.n, 8)} rendered text images), "
          f"device {args.device}, {machine()}; {args.repeats} interleaved rounds after 1 warm-up (OCR: "
          f"{args.ocr_repeats})\n")
    print(markdown_table(["reward", "backbone", "images", "images/s batched, median (min-max)",
                          "images/s one by one, median (min-max)", "batching speed-up (medians)"], rows))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
