"""Memory and switching cost of PolicyStates vs. keeping deep copies of the model.

For a CPU-sized SD3Transformer2DModel and Qwen2VLForConditionalGeneration (random weights) this
prints two markdown tables:

1. parameter memory: base weights, the LoRA adapters for "default"/"old"/"ref" (ref as a frozen
   adapter, i.e. the worst case of training from an existing LoRA), against policy + two deep
   copies (old, ref) = +200% of the base;
2. time: one ``use("old")`` / ``use("ref")`` switch (enter + exit, empty body), a forward inside
   ``use("old")`` vs. a forward of a deep-copied old model, and refreshing "old" from the policy
   (``states.copy``) vs. ``old_model.load_state_dict(policy.state_dict())`` / ``copy.deepcopy``.

Runs single-threaded in well under 2 minutes:  .venv/bin/python benchmarks/adapter_states.py
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _timing import machine, spread_of  # noqa: E402
from peft import LoraConfig  # noqa: E402

from mmrl.adapters import PolicyStates  # noqa: E402


def build_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, num_layers=4, attention_head_dim=64, num_attention_heads=4,
        joint_attention_dim=256, caption_projection_dim=256, pooled_projection_dim=256, out_channels=16,
        pos_embed_max_size=64,
    ).eval()
    g = torch.Generator().manual_seed(1)
    x = dict(
        hidden_states=torch.randn(2, 16, 32, 32, generator=g),
        encoder_hidden_states=torch.randn(2, 32, 256, generator=g),
        pooled_projections=torch.randn(2, 256, generator=g),
        timestep=torch.tensor([100.0, 700.0]),
    )
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    return model, x, (lambda m: m(**x).sample), targets


def build_qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config=dict(
            vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
        ),
        vision_config=dict(depth=2, embed_dim=128, hidden_size=256, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, in_channels=3, temporal_patch_size=2),
        image_token_id=990, video_token_id=991, vision_start_token_id=992, vision_end_token_id=993,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    x = dict(input_ids=torch.randint(3, 900, (4, 128), generator=torch.Generator().manual_seed(1)))
    return model, x, (lambda m: m(**x).logits), ["q_proj", "k_proj", "v_proj", "o_proj"]


def timeit_interleaved(fns: dict, min_rounds=5, budget_s=1.0) -> dict:
    """Seconds per call (a `_timing.Spread`: min / median / max) for several functions run round-robin, at
    least `min_rounds` rounds and until `budget_s` is spent, so that load changes on the shared CPU hit all
    of them alike and the comparison stays fair."""
    for fn in fns.values():
        fn()  # warm-up
    times = {k: [] for k in fns}
    t0 = time.perf_counter()
    while len(times[next(iter(fns))]) < min_rounds or time.perf_counter() - t0 < budget_s:
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: spread_of(v) for k, v in times.items()}


def mib(b):
    return b / 2**20


def run(name, build, rank, budget):
    model, x, fwd, targets = build()
    plain = copy.deepcopy(model)  # for the deep-copy baseline (no adapter layers)
    n_params = sum(p.numel() for p in model.parameters())

    # memory: worst case, "ref" is a frozen adapter (training started from an existing LoRA)
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets)
    with tempfile.TemporaryDirectory() as tmp:
        PolicyStates(copy.deepcopy(plain), cfg).save(tmp)
        states = PolicyStates(model, None, old=True, ref_adapter_path=Path(tmp) / "default")
    mem = states.parameter_memory()
    extra = mem["old"] + mem["ref"]
    mem_row = (f"| {name} | {n_params / 1e6:.2f} M | {rank} | {mib(mem['base']):.2f} | {mib(mem['default']):.3f} | "
               f"{mib(mem['old']):.3f} | {mib(mem['ref']):.3f} | {100 * extra / mem['base']:.2f}% | "
               f"{mib(2 * mem['base']):.2f} (200%) |")

    # timing with ref = adapters disabled (the usual case) and with old
    states_off = PolicyStates(copy.deepcopy(plain), cfg, old=True)
    m = states_off.model
    old_copy = copy.deepcopy(plain)

    def switch(n):
        def f():
            with states_off.use(n):
                pass
        return f

    def fwd_in(n):
        def f():
            with torch.no_grad(), states_off.use(n):
                fwd(m)
        return f

    def fwd_copy():
        with torch.no_grad():
            fwd(old_copy)

    t = timeit_interleaved({"switch_old": switch("old"), "switch_ref": switch("ref")}, budget_s=budget / 3)
    t |= timeit_interleaved({"fwd_default": fwd_in("default"), "fwd_old": fwd_in("old"), "fwd_ref": fwd_in("ref"),
                             "fwd_copy": fwd_copy}, budget_s=4 * budget)
    t |= timeit_interleaved({"copy_adapter": lambda: states_off.copy("default", "old"),
                             "load_sd": lambda: old_copy.load_state_dict(plain.state_dict()),
                             "deepcopy": lambda: copy.deepcopy(plain)}, budget_s=budget / 2)
    digits = dict(switch_old=2, switch_ref=2, copy_adapter=2, load_sd=2)
    cells = [t[k].fmt_median(1e3, digits.get(k, 1)) for k in ("switch_old", "switch_ref", "fwd_default", "fwd_old",
                                                              "fwd_ref", "fwd_copy", "copy_adapter", "load_sd",
                                                              "deepcopy")]
    time_row = f"| {name} | " + " | ".join(cells) + " |"
    return mem_row, time_row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (8 at hidden 256 ~ rank 48 at hidden 1536)")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds per forward timing")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    rows = [run("SD3Transformer2DModel (4 layers, d=256)", build_sd3, args.rank, args.budget),
            run("Qwen2VLForConditionalGeneration (4 layers, d=256)", build_qwen2_vl, args.rank, args.budget)]

    print(f"command: {shlex.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(f"{machine(args.threads)}, float32, CPU\n")
    print("### Parameter memory (MiB); PolicyStates with old + ref adapter vs. two deep copies\n")
    print("| model | params | LoRA r | base | default | old | ref | old+ref vs base | deep copies old+ref |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mem_row, _ in rows:
        print(mem_row)
    print("\n### Time (ms, median (min-max) over interleaved rounds); ref = adapters disabled. SD3: batch 2 of 16x32x32 latents, 32 text tokens; "
          "Qwen2-VL: batch 4 x 128 tokens\n")
    print("| model | switch use(old) | switch use(ref) | fwd default | fwd in use(old) | fwd in use(ref) | "
          "fwd deep-copied model | states.copy(default, old) | load_state_dict into copy | deepcopy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for _, time_row in rows:
        print(time_row)
    print(f"\nswitch = enter + exit of `with states.use(name): pass` (adapter switch + requires_grad snapshot/restore)."
          f"\nTotal benchmark time: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
