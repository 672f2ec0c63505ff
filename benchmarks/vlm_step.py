"""Throughput of one VLM GRPO step on CPU: rollout tokens/s (HF engine), training tokens/s, padding share.

    .venv/bin/python benchmarks/vlm_step.py [--hidden 256 --layers 4 --prompts 8 --n 8 --max-new-tokens 48]

Builds a CPU-sized random Qwen2-VL (the tiny model's tokenizer/processor, wider and deeper), generates
`prompts x n` responses for ragged prompts (images of 56..112 px, different questions), then runs one
forward+backward pass over them in micro-batches, as `mmrl.vlm.grpo` does. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmrl.vlm.common import collate, load_policy, messages_from_text, response_logprobs  # noqa: E402
from mmrl.vlm.rollout import GenRequest, HFRolloutEngine, SamplingParams  # noqa: E402


def build_model(root: Path, hidden: int, layers: int) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from mmrl.tiny import build_tiny_qwen2_vl

    path = build_tiny_qwen2_vl(root / "tiny")
    cfg = Qwen2VLConfig.from_pretrained(path)
    t = cfg.text_config
    t.hidden_size, t.intermediate_size, t.num_hidden_layers = hidden, hidden * 2, layers
    t.num_attention_heads, t.num_key_value_heads = hidden // 32, max(1, hidden // 64)
    t.layer_types = ["full_attention"] * layers
    t.rope_parameters = dict(t.rope_parameters, mrope_section=[4, 6, 6])  # head_dim 32 -> halves sum to 16
    v = cfg.vision_config
    v.embed_dim, v.depth, v.num_heads, v.hidden_size = hidden // 2, layers, max(1, hidden // 64), hidden
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    out = root / "bench"
    model.save_pretrained(out)
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(path).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args.hidden, args.layers)
        model, proc = load_policy(path)
        n_params = sum(p.numel() for p in model.parameters())
        questions = ["What color is the circle?", "How many shapes are there?",
                     "Is the red square on the left or the right?", "What shape is the blue object?"]
        reqs = [GenRequest(messages=messages_from_text("<image>" + questions[i % 4]),
                           images=[Image.new("RGB", (56 + 28 * (i % 3), 56 + 28 * (i % 2)), (40 * i % 255, 90, 160))])
                for i in range(args.prompts)]
        # no EOS: every response runs to max_new_tokens, so the token count is known
        engine = HFRolloutEngine(model, proc, batch_size=args.prompts * args.n, eos_token_ids=[-1])
        sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        engine.generate(reqs[:1], SamplingParams(n=1, max_new_tokens=2))  # warm-up
        t0 = time.perf_counter()
        res = engine.generate(reqs, sp)
        t_roll = time.perf_counter() - t0
        gen_tokens = sum(len(r.response_ids) for r in res)
        # one training pass (forward + backward) in micro-batches, as the recipe does
        model.train(False)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        real = total = resp_tokens = 0
        for s in range(0, len(res), args.micro_batch):
            mb = res[s:s + args.micro_batch]
            batch, P, mask = collate(model, [r.prompt_ids for r in mb], [r.response_ids for r in mb], [r.mm for r in mb],
                                     engine.pad_id)
            logp, _ = response_logprobs(model, batch, P, batch["input_ids"][:, P:])
            (-(logp * mask).sum() / mask.sum()).backward()
            real += int(batch["attention_mask"].sum())
            total += batch["attention_mask"].numel()
            resp_tokens += int(mask.sum())
        t_train = time.perf_counter() - t0
    rows = [
        ("model", f"Qwen2-VL random, hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.1f}M params"),
        ("batch", f"{args.prompts} prompts x {args.n} samples, {args.max_new_tokens} new tokens, micro-batch {args.micro_batch}"),
        ("torch threads", str(torch.get_num_threads())),
        ("rollout time (s)", f"{t_roll:.2f}"),
        ("rollout tokens/s (generated)", f"{gen_tokens / t_roll:.0f}"),
        ("train fwd+bwd time (s)", f"{t_train:.2f}"),
        ("train tokens/s (prompt+response, non-pad)", f"{real / t_train:.0f}"),
        ("train response tokens/s", f"{resp_tokens / t_train:.0f}"),
        ("padding share of train batches", f"{1 - real / total:.1%}"),
    ]
    print("| quantity | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print(f"\ncommand: .venv/bin/python benchmarks/vlm_step.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
