"""Throughput of one VLM GRPO step on CPU: rollout tokens/s (HF engine), training tokens/s, padding share; and the
time of the old + reference + training log-prob passes with and without reusing vision features.

    .venv/bin/python benchmarks/vlm_step.py [--hidden 256 --layers 4 --prompts 8 --n 8 --max-new-tokens 48
                                             --eos-mean-tokens 24 --repeats 3]
    .venv/bin/python benchmarks/vlm_step.py --part reuse --image-size 224 --n 8 --threads 1

Part `step`: builds a CPU-sized random Qwen2-VL (the tiny model's tokenizer/processor, wider and deeper), generates
`prompts x n` responses for ragged prompts (images of 56..112 px, different questions), then runs one
forward+backward pass over them in micro-batches, as `mmrl.vlm.grpo` does; rollout and training pass are timed
in `--repeats` interleaved rounds (`_timing.interleaved`, same seed: the same responses every round) and
reported as min / median / max. Responses end at EOS as in real runs (the engine's default EOS id, `<|im_end|>`):
a random model samples it with probability ~1/vocab (1/1009 here) per token, so nearly every response would run
to the cap; a fixed bias is added to the `<|im_end|>` logit (a forward hook on `lm_head`, seen by generation and
training alike) that makes EOS's probability about 1 / `--eos-mean-tokens` per token - response lengths then
spread like a geometric distribution cut at `--max-new-tokens` (their min / median / max and the share that
stopped at EOS are printed; `--eos-mean-tokens 0` = no bias). The
padding share is what the training passes pad: micro-batches of consecutive rows (a prompt's n samples are
neighbours, as in the recipe), each padded to its longest prompt (left) and longest response (right); the old
and reference log-prob passes batch the same rows the same way, so the share is the same for all three passes.
A second table of the `step` part times the training pass as `mmrl.vlm.update.policy_update` runs it (PPO-clip
loss, micro-batches, gradient clipping; a no-op optimizer keeps the weights fixed across rounds) padded vs packed
(`update.packing`, `RolloutBatch.pack`: rows of the longest sequence, the default, and everything in one row),
interleaved, on that rollout batch and on a second one sampled with `--packing-long-tail` times the token cap (same
EOS bias: a longer tail of lengths and more padding), with the padding (or filler) share of the token slots each
variant's forwards run over and the largest log-prob difference from the padded forward.

Part `reuse`: the same kind of model with LoRA on the language model (vision tower frozen, the default recipe),
`prompts x n` rows with `image_size`^2 images and `response_tokens` random response tokens each, timed through the
three passes of a GRPO step (old log-probs, reference log-probs with adapters off, training forward+backward), once
with the vision tower in every forward (`train.reuse_vision_features=false`) and once with
`mmrl.vlm.common.VisionCache` (each prompt's image encoded once per step). Vision width/depth default to the
language model's (Qwen2-VL-2B has a 0.6B vision tower beside a 1.5B language model). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import interleaved, machine, markdown_table, speedup, spread_of  # noqa: E402

from mmrl.vlm.common import (VisionCache, collate, compute_logprobs, load_policy, messages_from_text,  # noqa: E402
                             response_logprobs)
from mmrl.vlm.rollout import GenRequest, HFRolloutEngine, SamplingParams  # noqa: E402


def build_model(root: Path, hidden: int, layers: int, vision_width: int = 0, vision_depth: int = 0) -> Path:
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
    v.embed_dim, v.depth, v.hidden_size = vision_width or hidden // 2, vision_depth or layers, hidden
    v.num_heads = max(1, vision_width // 64) if vision_width else max(1, hidden // 64)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    out = root / "bench"
    model.save_pretrained(out)
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(path).save_pretrained(out)
    return out


def bench_vision_reuse(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Old + ref + train log-prob passes of one step, plain vs reused vision features (see the module docstring)."""
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates
    from mmrl.vlm.rollout import HFRolloutEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args.hidden, args.layers, args.vision_width or args.hidden,
                           args.vision_depth or args.layers)
        model, proc = load_policy(path)
    n_vis = sum(p.numel() for p in model.model.visual.parameters())
    n_all = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(r=16, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
    states = PolicyStates(model, lora)
    model = states.model
    params = states.trainable_parameters()
    questions = ["What color is the circle?", "How many shapes are there?", "Is the red square on the left or the right?",
                 "What shape is the blue object?"]
    s = args.image_size
    reqs = [GenRequest(messages=messages_from_text("<image>" + questions[i % 4]),
                       images=[Image.new("RGB", (s, s), (40 * i % 255, 90, 160))]) for i in range(args.prompts)]
    engine = HFRolloutEngine(model, proc)
    enc = engine.encode(reqs)
    g = torch.Generator().manual_seed(0)
    P = [e.input_ids for e in enc for _ in range(args.n)]
    MM = [e.mm for e in enc for _ in range(args.n)]  # the n samples of a prompt share one mm dict, as in rollouts
    R = [torch.randint(0, 150, (args.response_tokens,), generator=g).tolist() for _ in P]
    mb, pad = args.micro_batch, engine.pad_id

    def passes(reuse: bool) -> tuple[dict[str, float], list[torch.Tensor], int]:
        t: dict[str, float] = {}
        cache = VisionCache(model) if reuse else None
        t0 = time.perf_counter()
        old, _ = compute_logprobs(model, P, R, MM, pad, mb, vision_cache=cache)
        t["old"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with states.use("ref"):  # adapters off; the vision tower has no LoRA, so the features are shared
            compute_logprobs(model, P, R, MM, pad, mb, vision_cache=cache)
        t["ref"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        for i in range(0, len(P), mb):
            batch, Pl, mask = collate(model, P[i:i + mb], R[i:i + mb], MM[i:i + mb], pad)
            if cache is not None:
                batch = cache.apply(batch, MM[i:i + mb])
            logp, _ = response_logprobs(model, batch, Pl, batch["input_ids"][:, Pl:])
            (-(logp * mask).sum() / mask.sum()).backward()
        t["train"] = time.perf_counter() - t0
        return t, old, (cache.vision_calls if cache else 0)

    per_pass: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    outputs: dict[bool, tuple] = {}

    def timed(reuse: bool) -> None:
        t, old, calls = passes(reuse)
        outputs[reuse] = (old, calls)
        for k, v in t.items():
            per_pass[reuse].setdefault(k, []).append(v)

    timed(True)  # warm-up (allocator, kernels: the same modules in both ways); not recorded
    per_pass[True].clear()
    total = interleaved({"plain": lambda: timed(False), "reused": lambda: timed(True)}, repeats=args.repeats,
                        warmup=0)
    (plain_old, _), (cached_old, n_calls) = outputs[False], outputs[True]
    best = {reuse: {k: spread_of(v) for k, v in d.items()} for reuse, d in per_pass.items()}
    grads_ok = all(p.grad is not None for p in params)
    drift = max(float((a - b).abs().max()) for a, b in zip(plain_old, cached_old))
    n_img_tokens = int(enc[0].mm["image_grid_thw"].prod()) // 4
    rows = [
        ("model", f"Qwen2-VL random, LM hidden {args.hidden} x {args.layers} layers, vision width "
                  f"{args.vision_width or args.hidden} x {args.vision_depth or args.layers} blocks; "
                  f"{n_all / 1e6:.1f}M params ({n_vis / 1e6:.1f}M vision); LoRA r=16 on the LM"),
        ("batch", f"{args.prompts} prompts x n={args.n}, {s}x{s} images ({n_img_tokens} image tokens, "
                  f"{n_img_tokens * 4} patches), prompt {len(enc[0].input_ids)} tokens, {args.response_tokens} "
                  f"response tokens, micro-batch {mb}"),
        ("machine", machine()),
        ("timing", f"{args.repeats} interleaved rounds (plain, reused) after a warm-up; seconds median (min-max), "
                   f"speed-up of the medians"),
    ]
    for k in ("old", "ref", "train"):
        a, b = best[False][k], best[True][k]
        rows.append((f"{k} pass (s): plain / reused / speed-up",
                     f"{a.fmt_median()} / {b.fmt_median()} / {speedup(a, b)}"))
    a, b = total["plain"], total["reused"]
    rows += [("old+ref+train (s): plain / reused / speed-up",
              f"**{a.fmt_median()} / {b.fmt_median()} / {speedup(a, b)}**"),
             ("images through the vision tower: plain / reused", f"{3 * len(P)} (3 passes x {len(P)} rows) / "
                                                                 f"{args.prompts} (in {n_calls} calls)"),
             ("max |old log p plain - reused|", f"{drift:.1e}"),
             ("LoRA grads present (training pass through the cache)", str(grads_ok))]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--part", choices=["step", "reuse", "all"], default="step",
                    help="step: rollout + train throughput; reuse: vision-feature reuse timing; all: both")
    ap.add_argument("--image-size", type=int, default=224, help="reuse part: square image side in pixels")
    ap.add_argument("--response-tokens", type=int, default=32, help="reuse part: response length")
    ap.add_argument("--vision-width", type=int, default=0, help="reuse part: vision embed dim (0 = --hidden)")
    ap.add_argument("--vision-depth", type=int, default=0, help="reuse part: vision blocks (0 = --layers)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed interleaved rounds after 1 warm-up (min / median / max are reported)")
    ap.add_argument("--eos-mean-tokens", type=float, default=24.0,
                    help="step part: EOS logit bias for ~1/N EOS probability per token (0 = no bias)")
    ap.add_argument("--packing-long-tail", type=int, default=4,
                    help="step part: the packing table also times a batch sampled with this many times "
                         "--max-new-tokens (same EOS bias: a longer tail of lengths, more padding; 0 = skip)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("reuse", "all"):
        rows = bench_vision_reuse(args)
        print("| quantity | value |\n|---|---|")
        for k, v in rows:
            print(f"| {k} | {v} |")
        print(f"\ncommand: .venv/bin/python benchmarks/vlm_step.py {' '.join(sys.argv[1:])}".rstrip())
        if args.part == "reuse":
            return
        print()
    rows, packing = bench_step(args)
    print("| quantity | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print(f"\ncommand: .venv/bin/python benchmarks/vlm_step.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"\nTraining pass (forward + backward of the policy log-probs over the rollout batch, as "
          f"`mmrl.vlm.update.policy_update` runs it: micro-batch {args.micro_batch}, PPO-clip loss, grad clipping; "
          f"no-op optimizer so every round sees the same weights), padded vs packed (`update.packing`); "
          f"{args.repeats} interleaved rounds after 1 warm-up, {machine()}\n")
    print(markdown_table(["batch", "response tokens min / median / max", "padding / filler share of the token slots",
                          "variant",
                          "s min / median / max", "speed-up vs padded (medians)", "max abs log p diff vs padded"],
                         packing))


def eos_bias(vocab_size: int, mean_tokens: float) -> float:
    """Logit bias b that gives EOS probability p = 1 / mean_tokens per token when the other vocab_size - 1
    logits are about equal (a random model): p = e^b / (e^b + V - 1)  =>  b = log(p / (1 - p) * (V - 1))."""
    p = 1.0 / mean_tokens
    return math.log(p / (1 - p) * (vocab_size - 1))


def bench_step(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Rollout and training throughput and the padding share of the training passes (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args.hidden, args.layers)
        model, proc = load_policy(path)
    n_params = sum(p.numel() for p in model.parameters())
    eos_id = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    bias = 0.0
    if args.eos_mean_tokens > 0:
        bias = eos_bias(model.lm_head.out_features, args.eos_mean_tokens)

        def add_eos_bias(module, inputs, logits):
            logits = logits.clone()
            logits[..., eos_id] += bias
            return logits

        model.lm_head.register_forward_hook(add_eos_bias)
    questions = ["What color is the circle?", "How many shapes are there?",
                 "Is the red square on the left or the right?", "What shape is the blue object?"]
    reqs = [GenRequest(messages=messages_from_text("<image>" + questions[i % 4]),
                       images=[Image.new("RGB", (56 + 28 * (i % 3), 56 + 28 * (i % 2)), (40 * i % 255, 90, 160))])
            for i in range(args.prompts)]
    # the engine's default EOS ids (generation_config: <|im_end|> and the pad token), as in the recipe
    engine = HFRolloutEngine(model, proc, batch_size=args.prompts * args.n)
    sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    res: list = []
    padding: dict[str, int] = {}

    def rollout():
        res[:] = engine.generate(reqs, sp)

    def train():  # one forward + backward pass in micro-batches of consecutive rows, as the recipe does
        model.zero_grad(set_to_none=True)
        real = total = resp_real = resp_total = 0
        for s in range(0, len(res), args.micro_batch):
            mb = res[s:s + args.micro_batch]
            batch, P, mask = collate(model, [r.prompt_ids for r in mb], [r.response_ids for r in mb],
                                     [r.mm for r in mb], engine.pad_id)
            logp, _ = response_logprobs(model, batch, P, batch["input_ids"][:, P:])
            (-(logp * mask).sum() / mask.sum()).backward()
            real += int(batch["attention_mask"].sum())
            total += batch["attention_mask"].numel()
            resp_real += int(mask.sum())
            resp_total += mask.numel()
        padding.update(real=real, total=total, resp_real=resp_real, resp_total=resp_total)

    model.train(False)
    rollout()  # the training pass needs responses before the first (warm-up) round
    t = interleaved({"rollout": rollout, "train": train}, repeats=args.repeats, warmup=1)
    packing = bench_packing(model, res, engine.pad_id, args,
                            f"the batch above (up to {args.max_new_tokens} new tokens)")
    if args.packing_long_tail > 0:
        long_sp = SamplingParams(n=args.n, temperature=1.0,
                                 max_new_tokens=args.max_new_tokens * args.packing_long_tail, seed=0)
        packing += bench_packing(model, engine.generate(reqs, long_sp), engine.pad_id, args,
                                 f"long tail: up to {long_sp.max_new_tokens} new tokens")
    lens = spread_of([len(r.response_ids) for r in res])
    n_eos = sum(r.finish_reason == "stop" for r in res)
    gen_tokens = sum(len(r.response_ids) for r in res)
    real, total = padding["real"], padding["total"]
    prompt_pad = (total - padding["resp_total"]) - (real - padding["resp_real"])
    resp_pad = padding["resp_total"] - padding["resp_real"]
    eos_text = (f"EOS logit +{bias:.2f} (probability ~1/{args.eos_mean_tokens:g} per token)" if bias
                else "no EOS bias (a random model rarely stops)")
    return [
        ("model", f"Qwen2-VL random, hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.1f}M params"),
        ("batch", f"{args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} new tokens, "
                  f"micro-batch {args.micro_batch}; {eos_text}"),
        ("machine", machine()),
        ("timing", f"{args.repeats} interleaved rounds (rollout, train) after 1 warm-up: median (min-max)"),
        ("response tokens min / median / max; stopped at EOS",
         f"{lens.fmt(digits=0)}; {n_eos}/{len(res)} ({n_eos / len(res):.0%})"),
        ("rollout time (s)", t["rollout"].fmt_median()),
        ("rollout tokens/s (generated)", t["rollout"].rate(gen_tokens).fmt_median(digits=0)),
        ("train fwd+bwd time (s)", t["train"].fmt_median()),
        ("train tokens/s (prompt+response, non-pad)", t["train"].rate(real).fmt_median(digits=0)),
        ("train response tokens/s", t["train"].rate(padding["resp_real"]).fmt_median(digits=0)),
        ("padding share of the training passes (pad / all tokens)",
         f"**{1 - real / total:.1%}** ({total - real} of {total}: {prompt_pad} left of prompts, {resp_pad} right of "
         f"responses)"),
    ], packing


class _NoOpOptimizer:
    """Stands in for the optimizer in the packing timing: the update runs in full (zero_grad, micro-batch forwards
    and backwards, clipping, the guard) but the weights stay as they are, so every round trains the same model."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


def bench_packing(model, res: list, pad_id: int, args: argparse.Namespace, label: str) -> list[tuple[str, ...]]:
    """Table rows: the training pass of `mmrl.vlm.update.policy_update` over the rollout results `res` (one
    `RolloutBatch`, old log-probs = the rollout's, fixed random advantages, one mini-batch, micro-batches of
    `--micro-batch` consecutive rows), padded vs packed, interleaved. The vision tower is trained here (full
    fine-tuning), so a VisionCache would pass the training forward through unchanged: none is used."""
    from mmrl.training import UpdateGuard
    from mmrl.vlm.batch import RolloutBatch
    from mmrl.vlm.update import PolicyGradientLoss, contiguous_minibatches, policy_update

    batch = RolloutBatch.build(model, [r.prompt_ids for r in res], [r.response_ids for r in res],
                               [r.mm for r in res], pad_id, rollout_logprobs=[r.response_logprobs for r in res])
    batch.old_logprobs = batch.rollout_logprobs
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn = PolicyGradientLoss("ppo_clip", norm_const=args.max_new_tokens)  # as the recipe builds it (token-mean)
    logp: dict[bool, torch.Tensor] = {}

    variants = {"padded": (False, 0), "packed, rows of the longest sequence (pack_length 0, default)": (True, 0),
                "packed, one row (pack_length 10^9)": (True, 10 ** 9)}

    def update(packed: bool, pack_length: int) -> None:
        model.zero_grad(set_to_none=True)
        policy_update(model, batch.replace(packed=packed, pack_length=pack_length), _NoOpOptimizer(), params,
                      loss_fn=loss_fn, minibatches=contiguous_minibatches(len(batch), len(batch), len(batch)),
                      micro_batch_size=args.micro_batch, max_grad_norm=1.0, guard=UpdateGuard())

    logp = {k: batch.replace(packed=pk, pack_length=pl).logprobs(model, args.micro_batch)  # equal up to float order
            for k, (pk, pl) in variants.items()}
    t = interleaved({k: (lambda v=v: update(*v)) for k, v in variants.items()}, repeats=args.repeats, warmup=1)
    lens = spread_of([len(r.response_ids) for r in res])
    # token slots each variant's forwards run over (real tokens + padding / filler): what packing removes
    real = 0
    slots = dict.fromkeys(variants, 0)
    for sub in batch.micro_batches(args.micro_batch):
        real += int(sub.attention_mask.sum())
        for k, (pk, pl) in variants.items():
            slots[k] += sub.replace(pack_length=pl).pack()[0]["input_ids"].numel() if pk else sub.attention_mask.numel()
    out = []
    for k in variants:
        diff = float(((logp[k] - logp["padded"]).abs() * batch.response_mask).max())
        out.append((label, lens.fmt(digits=0), f"{1 - real / slots[k]:.1%} ({slots[k] - real} of {slots[k]})", k,
                    t[k].fmt(), speedup(t["padded"], t[k]) if k != "padded" else "(reference)",
                    f"{diff:.1e}" if k != "padded" else "(reference)"))
    return out


if __name__ == "__main__":
    main()
