"""Real width, honest memory: the registered real architectures (mmrl.perf.architectures; each diffusion family
declares its own in its file) at their published widths with a few blocks and random bf16 weights, one training step
each on CPU, memory measured per block and extrapolated to the full depth and the shipped recipe's micro-batch, against
one 80 GB GPU; FLOPs per step from the architecture.

    python benchmarks/real_width.py [--arch sd35_medium,flux1_dev,qwen25_vl_3b] [--threads 2] [--out runs/real_width.json]
    python benchmarks/real_width.py --small          # tiny widths, in this process: a check of the code path
    python benchmarks/real_width.py --arch wan22_t2v_a14b --cache runs/rw.jsonl   # resumable (measurements kept)

Each measurement is its own process (one at a time: a real-width step needs several GB): build the model at the
depth, LoRA (PolicyStates, rank of the recipe) or full fine-tuning, gradient checkpointing off or on, AdamW with its
state allocated, then one forward + backward (+ optimizer step) of one row. What the step adds at its peak is
counted two ways: live tensor bytes (a TorchDispatchMode recording every storage an op creates until Python frees
it: exact; used for the extrapolation) and the resident size (Linux VmHWM, reset before the step, minus the resident size before it;
glibc maps every allocation above 64 KiB on its own, MALLOC_MMAP_THRESHOLD_, so it follows the live memory: a check).

The gradients are allocated (zeros) before the measured step, as after any first step, so what the step adds is the
activations kept for the backward pass plus the backward's temporaries (gradient checkpointing: the recomputed
block).

Extrapolation (an upper-bound model, stated in docs/scaling.md): peak = weights (+ persistent buffers, + the LoRA
adapter) + old/ref states + gradients and AdamW state of every trained tensor + the optimizer step's temporaries + rows
x what one row's step adds; that last term is linear in the number of blocks of each kind (from the depth points) and,
where the measured row is shorter than the recipe's, in its tokens (per stream: the architecture's `row_scale`). The
SD3.5 row at 256 px checks the token scaling against a measurement. Several experts of one config (Wan 2.2 A14B):
each one's weights are held, gradients and AdamW state only for those the recipe trains, and a row goes through one
(one is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

GIB = 2**30
GPU_GIB = 80.0


def _vlm_family(arch):
    """The VLM policy family (mmrl.vlm.families) an architecture's `kind` names; None for a diffusion model. (Looked
    up here, not in mmrl.perf: the shared layers never import a recipe layer.)"""
    from mmrl.vlm.families import VLM_FAMILIES

    return VLM_FAMILIES.get(arch.kind)


def architecture(name: str, small: bool = False):
    """The registered architecture (the diffusion families register theirs when mmrl.diffusion.models is imported)."""
    import mmrl.ar_image.architecture  # noqa: F401  (registers Janus-Pro)
    import mmrl.diffusion.models  # noqa: F401
    from mmrl.perf.architectures import get_architecture

    return get_architecture(name, small)


def depth_points(arch) -> list[dict]:
    """The depths measured: 2 and 3 blocks of a single depth key; with several, 1 of each, then one more of each in
    turn (the first point is the base of the linear fit)."""
    keys = list(arch.depth)
    if len(keys) == 1:
        return [{keys[0]: 2}, {keys[0]: 3}]
    return [{k: 1 for k in keys}] + [{k: 1 + (k == more) for k in keys} for more in keys]


def measured_row(arch, small: bool) -> dict:
    """The row one measurement runs: the tiny-width row, the architecture's measured row, or its recipe's row."""
    return arch.small_row if small else (arch.measured_row or arch.row())


# ------------------------------------------------------------------------------------------------ one measurement


def _status_mib(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


def _build(name: str, depth: dict, small: bool):
    from dataclasses import replace

    import torch

    arch = architecture(name, small)
    build = {} if small else arch.measure_config
    model = replace(arch, config={**arch.config, **build}).build(depth, dtype=torch.float32 if small else torch.bfloat16)
    if isinstance(getattr(model, "patch_embedding", None), torch.nn.Conv3d):  # Wan's (see PatchAsMatmul)
        model.patch_embedding = patch_as_matmul(model.patch_embedding)
    return arch, model


def patch_as_matmul(conv):
    import torch
    from torch import nn

    class PatchAsMatmul(nn.Module):
        """A Conv3d whose stride equals its kernel (Wan's patch embedding) computed as a reshape and a matmul of the
        same weight and bias (the same values and parameter names; for the backward it keeps a reshaped copy of the
        latents, 0.2 MB at Wan2.2-A14B's row, where the convolution keeps the latents): oneDNN's bf16 Conv3d weight
        gradient on this CPU took over 2 minutes for 16 -> 5120 channels on 2 x 60 x 60 latents (milliseconds as a
        matmul)."""

        def __init__(self, conv: nn.Conv3d):
            super().__init__()
            if tuple(conv.kernel_size) != tuple(conv.stride) or conv.padding != (0, 0, 0):
                raise ValueError(f"PatchAsMatmul: kernel {conv.kernel_size} must equal stride {conv.stride}, no padding")
            self.weight, self.bias, self.kernel = conv.weight, conv.bias, tuple(conv.kernel_size)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, c, f, h, w = x.shape
            kt, kh, kw = self.kernel
            x = x.reshape(b, c, f // kt, kt, h // kh, kh, w // kw, kw).permute(0, 2, 4, 6, 1, 3, 5, 7)
            y = x.reshape(b, f // kt, h // kh, w // kw, -1) @ self.weight.reshape(self.weight.shape[0], -1).T
            return (y + self.bias).permute(0, 4, 1, 2, 3)

    return PatchAsMatmul(conv)


def _loss(arch, model, inputs: dict):
    """A scalar of the forward's output (diffusion transformers: the prediction; Z-Image: a list of them), the
    policy's response log-probability (a VLM), or the architecture's own `loss` (Janus)."""
    if arch.loss is not None:
        return arch.loss(model, inputs)
    if _vlm_family(arch) is None:
        out = model(**inputs)
        out = out.sample if hasattr(out, "sample") else out[0]
        return sum(o.float().pow(2).mean() for o in out) if isinstance(out, list) else out.float().pow(2).mean()
    from mmrl.vlm.batch import token_logprobs

    kw = dict(inputs)
    t = kw.pop("response_tokens")
    logits = model(**kw, use_cache=False, logits_to_keep=t + 1).logits[:, :t]
    return -token_logprobs(logits, kw["input_ids"][:, -t:], 1.0)[0].mean()


def measure(spec: dict) -> dict:
    """One training step of one row; the numbers the extrapolation needs (see the module docstring)."""
    import ctypes
    import gc

    import torch
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates
    from mmrl.training import attach_flops_meter
    from mmrl.vlm.families import freeze_vision_tower, lora_target_pattern

    torch.set_num_threads(spec["threads"])
    arch, model = _build(spec["arch"], spec["depth"], spec["small"])
    dtype = next(model.parameters()).dtype
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if spec["mode"] == "lora":
        r = arch.step["lora_rank"]
        # a VLM: the recipe's pattern (language model, + the family's vision blocks with train_vision)
        targets = (lora_target_pattern(model.config, arch.lora_targets, arch.step.get("train_vision", False))
                   if _vlm_family(arch) else arch.lora_regex or list(arch.lora_targets))
        states = PolicyStates(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0))
    else:
        model.requires_grad_(True)
        if arch.full_trains:  # the recipe's full fine-tuning trains these modules only
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith(arch.full_trains))
        if _vlm_family(arch) and not arch.step.get("train_vision", True):
            freeze_vision_tower(model)
        states = PolicyStates(model, None)
    trainable = states.trainable_parameters()
    if spec["gc"]:
        if arch.config_class is not None:  # a transformers model (a VLM, Janus)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.enable_gradient_checkpointing()
    model.train()
    opt = torch.optim.AdamW(trainable, lr=1e-6)
    for p in trainable:  # the optimizer state the first step allocates (lr 0: the weights do not move)
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    opt.param_groups[0]["lr"] = 1e-6
    opt.zero_grad(set_to_none=False)  # gradients stay allocated (counted apart): the step then adds activations only
    inputs = arch.inputs(model, spec["shape"], dtype)
    meter = attach_flops_meter(model)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    existing = [*model.parameters(), *model.buffers(), *(p.grad for p in trainable),
                *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)),
                *(v for v in inputs.values() if torch.is_tensor(v))]
    with _tensor_peak_mode(existing) as step:
        _loss(arch, model, inputs).backward()
    t_fb = time.perf_counter() - t0
    fb_peak = _status_mib("VmHWM")
    flops = meter.pop()
    with _tensor_peak_mode(existing) as opt_step:
        opt.step()
    return {**{k: spec[k] for k in ("arch", "depth", "mode", "gc")},
            "weights_gib": weights / GIB, "trainable": sum(p.numel() for p in trainable),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable) / GIB,
            "step_peak_gib": step.extra / GIB, "rss_step_gib": (fb_peak - before) / 1024,
            "opt_temp_gib": opt_step.extra / GIB, "fwd_bwd_s": t_fb, "tflops": flops / 1e12}


def _tensor_peak_mode(existing=()):
    """A TorchDispatchMode measuring the peak bytes of tensor storages created inside it and still alive: every op's
    outputs are recorded once per storage (views and in-place results share theirs) and subtracted when Python frees
    the storage; the storages of the `existing` tensors (weights, gradients, optimizer state, inputs: views of them,
    e.g. a transposed weight, are outputs too) are not new. Exact tensor bytes (what a GPU's caching allocator has to
    serve), unlike the resident size."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class TensorPeak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.extra = 0
            self._seen = WeakIdKeyDictionary()
            for t in existing:
                self._seen[t.untyped_storage()] = None

        def _free(self, n: int, _ref) -> None:
            self.live -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    if st not in self._seen:
                        n = st.nbytes()
                        self._seen[st] = weakref.ref(st, lambda ref, n=n: self._free(n, ref))
                        self.live += n
                        self.extra = max(self.extra, self.live)
            return out

    return TensorPeak()


# ------------------------------------------------------------------------------------------------ extrapolation


def _linear(points: list[dict], depth_keys: list[str], key: str) -> dict[str, float]:
    """{"fixed": a, depth key: per-block b} from measurements at the depth points (first = the base point)."""
    base = points[0]
    out = {}
    for k in depth_keys:
        other = next(p for p in points[1:] if p["depth"][k] != base["depth"][k])
        out[k] = (other[key] - base[key]) / (other["depth"][k] - base["depth"][k])
    out["fixed"] = base[key] - sum(out[k] * base["depth"][k] for k in depth_keys)
    return out


def extrapolate(arch, rows: list[dict], small: bool) -> list[dict]:
    """Rows of the memory table for one architecture (see the module docstring)."""
    depth_keys = list(arch.depth)
    full = dict(arch.depth)
    n_weights = arch.parameters() if not small else None
    scale = arch.row_scale if not small else {}
    table = []
    for mode in ("lora", "full"):
        if not any(r["mode"] == mode for r in rows):  # not measured (the architecture's measure_modes)
            continue
        for gc_on in (False, True):
            pts = [r for r in rows if r["mode"] == mode and r["gc"] == gc_on and not r.get("check")]
            act = _linear(pts, depth_keys, "step_peak_gib")  # activations + backward temporaries of one row
            per_row = act["fixed"] * scale.get("fixed", scale.get("*", 1.0)) + sum(
                act[k] * scale.get(k, scale.get("*", 1.0)) * full[k] for k in depth_keys)
            trainable_bytes = _linear(pts, depth_keys, "trainable_bytes")
            one = trainable_bytes["fixed"] + sum(trainable_bytes[k] * full[k] for k in depth_keys)  # per expert
            # several experts (Wan 2.2 A14B): weights and adapters of each, gradients and AdamW state of those the
            # recipe's SDE window reaches (step "trained_experts"), activations of one
            held, trained = arch.experts, arch.step.get("trained_experts", arch.experts)
            tb_held, tb = held * one, trained * one
            wlin = _linear(pts, depth_keys, "weights_gib")
            base = 2 * n_weights / GIB if n_weights else held * (wlin["fixed"] + sum(wlin[k] * full[k] for k in depth_keys))
            adapter = tb_held if mode == "lora" else 0.0  # the trained LoRA adapter's own weights
            opt_tmp = _linear(pts, depth_keys, "opt_temp_gib")
            opt_temp = trained * max(0.0, opt_tmp["fixed"] + sum(opt_tmp[k] * full[k] for k in depth_keys))
            tfl = _linear(pts, depth_keys, "tflops")
            tflops_row = tfl["fixed"] * scale.get("fixed", scale.get("*", 1.0)) + sum(
                tfl[k] * scale.get(k, scale.get("*", 1.0)) * full[k] for k in depth_keys)
            rows_real = arch.step["rows"]
            moments = 2 * tb  # AdamW: two moments in the trainable dtype
            for states_kind in (("adapters", "copies") if mode == "lora" else ("copies", "none")):
                if mode == "lora":  # "old" + "ref": two more adapters, or deep copies (old with its adapter)
                    extra = 2 * tb_held if states_kind == "adapters" else 2 * base + tb_held
                else:  # full: "old" + "ref" snapshots of the trainable weights, or neither kept
                    extra = 2 * tb_held if states_kind == "copies" else 0.0
                total = base + adapter + extra + tb + moments + opt_temp + rows_real * per_row
                table.append({"arch": arch.name, "mode": mode, "gc": gc_on, "old_ref": states_kind,
                              "weights_gib": base + adapter, "adapter_gib": adapter, "states_gib": extra,
                              "grads_gib": tb, "adam_gib": moments, "opt_temp_gib": opt_temp,
                              "act_per_row_gib": per_row, "rows": rows_real, "total_gib": total,
                              "fits_80gb": total <= GPU_GIB, "tflops_per_row_step": tflops_row})
    return table


# ------------------------------------------------------------------------------------------------ driver


def _key(spec: dict) -> str:  # a cached measurement is reused for equal specs and library versions (not code)
    from importlib.metadata import version

    keys, libs = ("arch", "depth", "mode", "gc", "shape", "small", "threads", "check"), ("torch", "diffusers", "peft")
    return json.dumps({**{k: spec.get(k) for k in keys}, **{m: version(m) for m in libs}}, sort_keys=True)


def _child(specs: list[dict], cache: Path | None = None) -> list[dict]:
    """The measurements of one architecture in a fresh process, one after the other (each builds its own model;
    with every allocation above 64 KiB mapped on its own, what one frees goes back to the OS before the next).
    Those found in `cache` (JSONL) are not repeated; each new one is appended to it as it finishes."""
    lines = cache.read_text().splitlines() if cache is not None and cache.is_file() else []
    done = {row["key"]: row["row"] for row in map(json.loads, filter(str.strip, lines))}
    todo = [s for s in specs if _key(s) not in done]
    done.update((_key(spec), row) for spec, row in zip(todo, _measure_in_child(todo, cache) if todo else []))
    return [done[_key(s)] for s in specs]


def _measure_in_child(specs: list[dict], cache: Path | None) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               OMP_NUM_THREADS=str(specs[0]["threads"]),
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(specs)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out = []
    for line in proc.stdout:  # one JSON line per measurement, as it finishes
        out.append(json.loads(line))
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with cache.open("a") as fh:
                fh.write(json.dumps({"key": _key(specs[len(out) - 1]), "row": out[-1]}) + "\n")
        print(f"  measured {out[-1]['arch']} {out[-1]['depth']} {out[-1]['mode']} gc={out[-1]['gc']}: "
              f"+{out[-1]['step_peak_gib']:.2f} GiB, {out[-1]['fwd_bwd_s']:.1f} s", file=sys.stderr, flush=True)
    err = proc.stderr.read()
    if proc.wait() or len(out) != len(specs):
        raise SystemExit(f"measurements of {specs[0]['arch']} failed:\n{err[-3000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="", help="comma-separated names (default: every registered architecture)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="tiny widths (checks the code path; numbers meaningless)")
    ap.add_argument("--out", default="", help="write every measurement and the table rows as JSON")
    ap.add_argument("--cache", default="", help="JSONL file of finished measurements: reused, and appended to as "
                                                "each one finishes (an interrupted run continues where it stopped)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import ctypes
        import gc

        for spec in json.loads(args.child):
            print(json.dumps(measure(spec)), flush=True)
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        return 0
    from _timing import machine, markdown_table

    import mmrl.ar_image.architecture  # noqa: F401  (the families register their architectures)
    import mmrl.diffusion.models  # noqa: F401
    from mmrl.perf.architectures import ARCHITECTURES

    names = [n for n in args.arch.split(",") if n] or list(ARCHITECTURES)
    archs = [architecture(n) for n in names]
    measured, table = [], []
    t_all = time.perf_counter()
    for arch in archs:
        depths, shape = depth_points(arch), measured_row(arch, args.small)
        specs = [{"arch": arch.name, "depth": depth, "mode": mode, "gc": gc_on, "shape": shape, "small": args.small,
                  "threads": args.threads}
                 for mode in arch.measure_modes for gc_on in (False, True) for depth in depths]
        if arch.kind == "sd3" and not args.small:  # token scaling checked: 256 px measured vs 512 px scaled
            specs.append({**specs[2 * len(depths)], "shape": dict(shape, height=256, width=256), "check": True})
        rows = [measure(s) for s in specs] if args.small else _child(specs, Path(args.cache) if args.cache else None)
        for spec, row in zip(specs, rows):
            row["check"] = spec.get("check", False)
        measured += rows
        table += extrapolate(architecture(arch.name, args.small), rows, args.small)
    cmd = " ".join(["python", "benchmarks/real_width.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"`{cmd}` - {machine(args.threads)}; {time.perf_counter() - t_all:.0f} s\n")
    print("Measured (one row, CPU, bf16 weights; what forward + backward adds at its peak: live tensor bytes, and "
          "the resident memory):\n")
    print(markdown_table(["arch", "depth", "mode", "GC", "weights GiB", "step adds GiB (tensors)",
                          "step adds GiB (RSS)", "AdamW step temp GiB", "fwd+bwd s", "TFLOP"],
                         [(r["arch"] + (" (256 px check)" if r.get("check") else ""),
                           " ".join(f"{k.split('.')[-1]}={v}" for k, v in r["depth"].items()), r["mode"],
                           "on" if r["gc"] else "off", f"{r['weights_gib']:.2f}", f"{r['step_peak_gib']:.3f}",
                           f"{r['rss_step_gib']:.3f}", f"{r['opt_temp_gib']:.3f}", f"{r['fwd_bwd_s']:.1f}", f"{r['tflops']:.3f}") for r in measured]))
    for arch in archs:
        check = next((r for r in measured if r["arch"] == arch.name and r.get("check")), None)
        if check is not None:
            base = next(r for r in measured if r["arch"] == arch.name and r["mode"] == "full" and not r["gc"]
                        and r["depth"] == check["depth"] and not r.get("check"))
            ratio = (256 // 16) ** 2 + 205, (512 // 16) ** 2 + 205
            predicted = base["step_peak_gib"] * ratio[0] / ratio[1]
            print(f"\ntoken scaling check ({arch.name}, full, GC off, depth {check['depth']}): activations at 256 px "
                  f"measured {check['step_peak_gib']:.3f} GiB, scaled from 512 px {predicted:.3f} GiB")
    print(f"\nExtrapolated peak per GPU at full depth, the recipe's micro-batch (rows), bf16 weights, one process "
          f"(no FSDP), against {GPU_GIB:.0f} GB:\n")
    print(markdown_table(["arch", "mode", "GC", "old/ref", "weights", "old/ref states", "grads", "AdamW", "opt temp",
                          "activations (rows x per row)", "total GiB", "fits 80 GB"],
                         [(t["arch"], t["mode"], "on" if t["gc"] else "off", t["old_ref"], f"{t['weights_gib']:.1f}",
                           f"{t['states_gib']:.1f}", f"{t['grads_gib']:.1f}", f"{t['adam_gib']:.1f}",
                           f"{t['opt_temp_gib']:.1f}", f"{t['rows']} x {t['act_per_row_gib']:.2f}",
                           f"{t['total_gib']:.1f}", "yes" if t["fits_80gb"] else "no") for t in table]))
    for arch in archs:
        if not any(t["arch"] == arch.name and t["mode"] == "full" for t in table):
            n = architecture(arch.name, args.small).parameters()
            print(f"\n{arch.name}: full fine-tuning not measured (measure_modes: its depth points do not fit this "
                  f"machine); its weights, gradients and AdamW moments alone (bf16, {n / 1e9:.1f}B parameters) are "
                  f"{8 * n / GIB:.1f} GiB, against {GPU_GIB:.0f} GB")
    print("\nFLOPs per training row (forward + backward, from the architecture, at the recipe's row shape): " + ", ".join(
        f"{t['arch']} {t['mode']} {t['tflops_per_row_step']:.2f} TFLOP" for t in table if not t["gc"]
        and t["old_ref"] in ("adapters", "none")))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"measured": measured, "table": table}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
