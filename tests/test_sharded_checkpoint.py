"""Sharded checkpoints (`dist.checkpoint: sharded`, torch.distributed.checkpoint) through the training spine's
`save_checkpoint` / `restore_checkpoint`, on a tiny SD3 transformer with LoRA ("default" + "old" adapters) and with full
fine-tuning ("old" + "ref" snapshots), AdamW + LR schedule, on 2 real CPU processes (gloo) and in one process.

Every checkpoint is written after 2 steps; the writer records the whole (gathered) policy states and AdamW state at
the save and after one more step. A resume must give back exactly the saved values (bitwise: the same bytes are read
back) and, after its own third step, the writer's third step (to 1e-6: FSDP and one process add up gradients in
another order). Covered: sharded 2 ranks -> 1 process, 1 process -> 2 ranks, 2 -> 2 ranks; the gathered format ("full",
what earlier versions wrote) 2 ranks -> 1 process and 1 process -> 2 ranks.

The 2-rank halves run this file as a script: ``python tests/test_sharded_checkpoint.py save|resume OUT``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from mmrl.config import RunConfig, TrainConfig
from mmrl.distributed import DistConfig, DistContext, full_optimizer_state_dict
from mmrl.run.consolidate import main as consolidate_main
from mmrl.run.files import load_state_file
from mmrl.testing import child_env, spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
MODES = ("lora", "full")
FORMATS = ("sharded", "full")
SAVE_AT = 2


@dataclass
class _Cfg(RunConfig):
    algorithm: str = "sharded_test"
    dist: DistConfig = field(default_factory=DistConfig)


def build_states(mode: str):
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from mmrl.adapters import PolicyStates

    torch.manual_seed(0)
    tr = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                               pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32)
    if mode == "full":
        tr.requires_grad_(True)
        return PolicyStates(tr, None, old=True, keep_ref_copy=True)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    return PolicyStates(tr, cfg, old=True)


def _inputs(i: int) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    return {"hidden_states": torch.randn(4, 4, 8, 8, generator=g), "encoder_hidden_states": torch.randn(4, 5, 32, generator=g),
            "pooled_projections": torch.randn(4, 32, generator=g), "timestep": torch.tensor([100.0, 300.0, 500.0, 700.0])}


def _setup(ctx: DistContext, mode: str, out: Path, fmt: str, resume: str = "auto"):
    from mmrl.run.checkpoint import FullOptimizerState
    from mmrl.run.directory import Run

    fsdp = ctx.enabled
    cfg = _Cfg(output_dir=str(out), train=TrainConfig(max_steps=SAVE_AT + 1, save_every=SAVE_AT, resume=resume),
               dist=DistConfig(strategy="fsdp" if fsdp else "none", checkpoint=fmt))
    with ctx.main_process_first():
        run = Run(cfg, write_config=ctx.is_main)
    states = build_states(mode)
    ctx.wrap_model(states.model, "fsdp" if fsdp else "none")
    if fsdp:
        states.refresh()
    opt = torch.optim.AdamW(states.trainable_parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    stateful = {"optimizer": FullOptimizerState(opt) if fsdp else opt, "lr_scheduler": sched}
    return run, states, opt, sched, stateful, fsdp


def _step(states, opt, sched, i: int) -> None:
    out = states.model(**_inputs(i)).sample
    out.pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    states.ema("default", "old", 0.5)  # "old" differs from "default" (and in full mode from "ref")


def _snapshot(states, opt) -> dict:
    """Whole values (a collective under FSDP): every kept state and the AdamW state by parameter name."""
    names = {id(p): n for n, p in states.model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    osd = full_optimizer_state_dict(opt)
    return {"states": states.state_dict()["states"],
            "optimizer": {names[id(params[i])]: {k: v.clone() for k, v in st.items()} for i, st in osd["state"].items()},
            "lr": opt.param_groups[0]["lr"]}


def _diff(a: dict, b: dict) -> float:
    worst = 0.0
    for section in ("states", "optimizer"):
        assert sorted(a[section]) == sorted(b[section]), section
        for k in a[section]:
            assert sorted(a[section][k]) == sorted(b[section][k]), (section, k)
            for j in a[section][k]:
                worst = max(worst, float((a[section][k][j].float() - b[section][k][j].float()).abs().max()))
    assert a["lr"] == b["lr"]
    return worst


def save_worker(ctx: DistContext, out: str) -> None:
    """Train 2 steps, save (step_2), record the values at the save and after a third step: every mode x format."""
    from mmrl.run.checkpoint import save_checkpoint

    for mode in MODES:
        for fmt in FORMATS:
            d = Path(out) / f"{mode}_{fmt}_w{ctx.world_size}"
            run, states, opt, sched, stateful, fsdp = _setup(ctx, mode, d, fmt)
            for i in range(1, SAVE_AT + 1):
                _step(states, opt, sched, i)
            save_checkpoint(ctx, run, SAVE_AT, states, stateful, fsdp=fsdp)
            at_save = _snapshot(states, opt)
            _step(states, opt, sched, SAVE_AT + 1)
            after = _snapshot(states, opt)
            if ctx.is_main:
                torch.save({"at_save": at_save, "after": after}, d / "reference.pt")
            ctx.barrier()


def resume_worker(ctx: DistContext, out: str, sources: str) -> None:
    """Resume every `<mode>_<fmt>_w<N>` directory named in `sources` (comma-separated) with this world size: the
    restored values equal the saved ones exactly, and one more step equals the writer's third step."""
    from mmrl.run.checkpoint import restore_checkpoint

    for name in sources.split(","):
        src = Path(out) / name
        mode, fmt = name.split("_")[:2]
        fmt = fmt if fmt in FORMATS else "full"  # (a consolidated checkpoint; the resumed run writes the full format)
        d = Path(out) / f"{name}_to_w{ctx.world_size}"
        run, states, opt, sched, stateful, _ = _setup(ctx, mode, d, fmt, str(src / "checkpoints" / f"step_{SAVE_AT}"))
        step, _ = restore_checkpoint(ctx, run, states, stateful)
        assert step == SAVE_AT
        ref = torch.load(src / "reference.pt", weights_only=False)
        got = _snapshot(states, opt)
        assert _diff(got, ref["at_save"]) == 0.0, f"{name} -> {ctx.world_size} rank(s): restored values differ"
        _step(states, opt, sched, SAVE_AT + 1)
        worst = _diff(_snapshot(states, opt), ref["after"])
        assert worst < 1e-6, f"{name} -> {ctx.world_size} rank(s): the step after the resume differs by {worst:.2e}"
        if ctx.is_main:
            print(f"[sharded] {name} -> {ctx.world_size} rank(s): restored exactly, next step within {worst:.1e}",
                  flush=True)


def _two_ranks(*args: str) -> None:
    proc = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"STDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    print(proc.stdout)


def _files(ckpt: Path) -> set[str]:
    return {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_sharded_and_gathered_checkpoints_resume_on_another_number_of_ranks(tmp_path):
    _two_ranks("save", str(tmp_path))
    one = DistContext()  # one process, no process group
    save_worker(one, str(tmp_path))

    for mode in MODES:  # what each format writes
        sharded = tmp_path / f"{mode}_sharded_w2" / "checkpoints" / "step_2"
        files = _files(sharded)
        assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "COMPLETE",
                "MANIFEST.json", "state.pt", "adapters/policy_states.json"} <= files
        assert set(json.loads((sharded / "MANIFEST.json").read_text())) == files - {"MANIFEST.json", "COMPLETE"}
        assert not any(f.endswith("/model.safetensors") for f in files)  # full weights: only as shards
        opt = load_state_file(sharded / "state.pt")["stateful"]["optimizer"]
        assert opt["sharded"] and "state" not in opt  # no optimizer tensor in state.pt
        gathered = _files(tmp_path / f"{mode}_full_w2" / "checkpoints" / "step_2")
        assert not any(f.startswith("sharded/") for f in gathered)
        index = json.loads((sharded / "adapters" / "policy_states.json").read_text())
        assert index.get("weights") == ("sharded" if mode == "full" else None)
    lora_files = _files(tmp_path / "lora_sharded_w2" / "checkpoints" / "step_2")
    assert {"adapters/default/adapter_model.safetensors", "adapters/old/adapter_model.safetensors"} <= lora_files

    # 2 ranks -> 1 process, sharded and gathered
    resume_worker(one, str(tmp_path), ",".join(f"{m}_{f}_w2" for m in MODES for f in FORMATS))
    # consolidated in one process: the files of the gathered format, bit for bit, and it resumes like them
    for mode in MODES:
        src = tmp_path / f"{mode}_sharded_w2"
        cons = tmp_path / f"{mode}_consolidated_w2"
        assert consolidate_main([str(src / "checkpoints/step_2"), str(cons / "checkpoints/step_2")]) == 0
        shutil.copy(src / "reference.pt", cons / "reference.pt")
        _same_checkpoint_content(cons / "checkpoints/step_2", tmp_path / f"{mode}_full_w2" / "checkpoints/step_2")
    resume_worker(one, str(tmp_path), ",".join(f"{m}_consolidated_w2" for m in MODES))
    # 1 process -> 2 ranks (sharded and gathered), 2 -> 2 ranks (sharded)
    _two_ranks("resume", str(tmp_path), ",".join([f"{m}_{f}_w1" for m in MODES for f in FORMATS]
                                                 + [f"{m}_sharded_w2" for m in MODES]))


def _same_checkpoint_content(a: Path, b: Path) -> None:
    """Checkpoints `a` and `b` hold the same files (config.yaml aside: it names the output directory) with equal
    tensors: the weight files byte for byte, state.pt's optimizer and schedule equal."""
    from safetensors.torch import load_file

    files = _files(a)
    assert files == _files(b), sorted(files ^ _files(b))
    for f in files:
        if f.endswith(".safetensors"):
            fa, fb = load_file(str(a / f)), load_file(str(b / f))
            assert sorted(fa) == sorted(fb) and all(torch.equal(fa[k], fb[k]) for k in fa), f
        elif f.endswith(".json") and f != "MANIFEST.json":
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f
    sa, sb = (load_state_file(c / "state.pt")["stateful"] for c in (a, b))
    assert sa["lr_scheduler"] == sb["lr_scheduler"]
    oa, ob = sa["optimizer"], sb["optimizer"]
    assert oa["param_groups"] == ob["param_groups"] and sorted(oa["state"]) == sorted(ob["state"])
    for i in oa["state"]:
        assert sorted(oa["state"][i]) == sorted(ob["state"][i])
        assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for k in oa["state"][i])


if __name__ == "__main__":
    if sys.argv[1] == "save":
        spawn_ranks(save_worker, sys.argv[2])
    else:
        spawn_ranks(resume_worker, sys.argv[2], sys.argv[3])


def _sharded_single_process_checkpoint(out: Path, states, step: int = 1) -> Path:
    """A complete sharded checkpoint of `states` (+ an AdamW with one step of state) written by this process through
    the spine's `save_checkpoint`."""
    from mmrl.run.checkpoint import save_checkpoint
    from mmrl.run.directory import Run

    run = Run(_Cfg(output_dir=str(out), train=TrainConfig(max_steps=step, save_every=step),
                   dist=DistConfig(checkpoint="sharded")))
    opt = torch.optim.AdamW(states.trainable_parameters(), lr=1e-3)
    for p in states.trainable_parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    save_checkpoint(DistContext(), run, step, states, {"optimizer": opt})
    return out / "checkpoints" / f"step_{step}"


def test_sharded_full_weights_load_into_diffusers_and_mmrl_eval(tmp_path):
    """Sharded full fine-tuning weights of an SD3 transformer: consolidated into model.safetensors they are what
    `SD3Transformer2DModel.from_pretrained` reads; `mmrl eval`'s apply_checkpoint reads the shards directly."""
    from diffusers import SD3Transformer2DModel

    from mmrl.eval.harness import apply_checkpoint

    states = build_states("full")
    with torch.no_grad():
        for i, p in enumerate(states.trainable_parameters()):
            p.add_(0.01 * (i + 1))
    ckpt = _sharded_single_process_checkpoint(tmp_path / "run", states)
    trained = {k: v.detach().clone() for k, v in states.model.named_parameters()}
    assert not (ckpt / "adapters" / "default").exists() and (ckpt / "sharded" / ".metadata").is_file()

    out = tmp_path / "full" / "step_1"
    proc = subprocess.run([sys.executable, "-m", "mmrl.run.consolidate", str(ckpt), str(out), "--weights-only"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)  # as docs/scaling.md
    assert proc.returncode == 0 and json.loads(proc.stdout) == {"out": str(out), "weights_only": True}, proc.stderr
    assert not (out / "state.pt").exists() and not (out / "COMPLETE").exists()  # weights only: not a checkpoint
    model_dir = tmp_path / "diffusers_dir"
    build_states("full").model.save_pretrained(model_dir)  # config.json + the untrained weights
    shutil.copy(out / "adapters" / "default" / "model.safetensors", model_dir / "diffusion_pytorch_model.safetensors")
    loaded = SD3Transformer2DModel.from_pretrained(model_dir)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.named_parameters())

    class _Flow:  # what apply_checkpoint touches of a FlowModel
        transformer = build_states("full").model
    model = _Flow()
    info = apply_checkpoint(model, ckpt / "adapters", "default")
    assert info["mode"] == "full" and info["weights"] == str(ckpt / "adapters" / "../sharded")
    assert all(torch.equal(v, trained[k]) for k, v in model.transformer.named_parameters())
    with pytest.raises(FileNotFoundError, match=r"no policy state 'nope' \(saved: \['default', 'old', 'ref'\]\)"):
        apply_checkpoint(_Flow(), ckpt / "adapters", "nope")


def test_sharded_full_weights_of_a_vlm_load_into_transformers(tmp_path):
    """Full fine-tuning of a tiny Qwen2-VL saved sharded, consolidated: `from_pretrained` of the model directory
    with the consolidated model.safetensors gives the trained weights (tied embeddings included)."""
    from transformers import Qwen2VLForConditionalGeneration

    from mmrl.adapters import PolicyStates
    from mmrl.tiny import build_tiny_qwen2_vl

    base = build_tiny_qwen2_vl(tmp_path / "base")
    model = Qwen2VLForConditionalGeneration.from_pretrained(base)
    model.requires_grad_(True)
    states = PolicyStates(model, None)
    with torch.no_grad():
        for i, p in enumerate(states.trainable_parameters()):
            p.add_(0.001 * (i + 1))
    ckpt = _sharded_single_process_checkpoint(tmp_path / "run", states)
    trained = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = tmp_path / "full" / "step_1"
    assert consolidate_main([str(ckpt), str(out)]) == 0
    assert (out / "COMPLETE").is_file() and (out / "state.pt").is_file()  # a whole, resumable checkpoint
    model_dir = tmp_path / "hf"
    shutil.copytree(base, model_dir)
    shutil.copy(out / "adapters" / "default" / "model.safetensors", model_dir / "model.safetensors")
    loaded = Qwen2VLForConditionalGeneration.from_pretrained(model_dir)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.named_parameters())


def test_consolidate_refuses_bad_input_in_one_line(tmp_path, capsys):
    states = build_states("lora")
    ckpt = _sharded_single_process_checkpoint(tmp_path / "run", states)
    assert consolidate_main([str(ckpt), str(tmp_path / "c")]) == 0
    for argv, match in (([str(tmp_path / "c"), str(tmp_path / "d")], "not a checkpoint directory"),
                        ([str(ckpt), str(tmp_path / "c")], "exists: choose a new output directory")):
        assert consolidate_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and match in err, err
    (ckpt / "sharded" / "__0_0.distcp").write_bytes(b"torn")
    assert consolidate_main([str(ckpt), str(tmp_path / "e")]) == 2
    assert "is corrupt" in capsys.readouterr().err
