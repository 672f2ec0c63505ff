"""Every shell command shown in README.md and docs/*.md is executed by a test, so the docs cannot drift.

What counts as a shell command: every line of a ```bash / ```sh / ```shell / ```console block (continuation lines
joined, comments dropped) and every `$ ` line of any fenced block. Each one must be named in ``COMMANDS`` below
with how it is run:

- ``RUN``: executed exactly as written, by bash, in a scratch copy of the checkout (a temp dir holding symlinks to
  the repo's files; what the command writes stays there), offline (`HF_HUB_OFFLINE=1`, `pip --no-index`), with
  this venv's bin/ first on PATH and `.venv` pointing at this venv. A `$ ` line followed by output lines is an
  example of output: those lines must appear in what the command prints (`...` matches anything), and the exit
  code is free; any other command must exit 0.
- ``Short("...", why)``: the real command is too long or needs what this machine lacks (a GPU, real weights, the
  network); the short form is run instead. It must keep every config file and override key (`key=value`, the value
  may differ) of the documented command, so the documented keys are still checked.
- ``ByTest("tests/x.py::test_y", why)``: another test runs it (its name is checked to exist).

Commands of one page run in page order in one scratch dir (a later command may use what an earlier one wrote);
consecutive plain `mmrl config check ...` commands without output to match run in one interpreter (`mmrl.cli.main`
on each, its exit code and output kept apart), so their torch import is paid once.
A new command in the docs that is not in ``COMMANDS`` fails with the line to add; an entry that no page shows any
more fails too. Besides running them, every command (also the ones in `code spans` and synopsis blocks such as
`mmrl eval CONFIG [--checkpoint DIR]`) is checked for cheap, static validity: an `mmrl` subcommand, option or
`key=value` override that does not exist, a missing script or `--flag`, a Makefile target or a pip extra that does
not exist fails `test_every_documented_command_names_real_things`.

`mmrl ... --help` is documentation too: `test_every_help_example_names_real_things` prints the help of every
subcommand and lints every example its texts show (an `mmrl ...` command, and each `key=value` override as
`mmrl <subcommand> <override>`) with the same static check.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmrl.testing import child_env

# the extraction and static-check helpers live in tests/_docs_commands.py (tests/ is not a package: loaded by path)
_spec = importlib.util.spec_from_file_location("_docs_commands", Path(__file__).with_name("_docs_commands.py"))
_lib = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _lib  # dataclasses look their module up there
_spec.loader.exec_module(_lib)
ROOT, DOC_FILES, DocCommand = _lib.ROOT, _lib.DOC_FILES, _lib.DocCommand
shell_commands, documented_commands, output_matches = _lib.shell_commands, _lib.documented_commands, _lib.output_matches
strip_comment, lint_command, inline_commands = _lib.strip_comment, _lib.lint_command, _lib.inline_commands
help_texts, help_examples = _lib.help_texts, _lib.help_examples


class _Run:
    def __repr__(self):
        return "RUN"


RUN = _Run()


@dataclasses.dataclass(frozen=True)
class Short:
    command: str
    why: str


@dataclasses.dataclass(frozen=True)
class ByTest:
    test: str
    why: str


# where a short form needs a few images: 4 PNGs of two sizes under samples/ (the reward CLI accepts mixed sizes)
_MAKE_IMAGES = ("python -c \"from PIL import Image; import pathlib; p = pathlib.Path('samples'); p.mkdir(exist_ok=True); "
                "[Image.new('RGB', (32 + 16 * (i % 2), 32), (60 * i, 90, 200)).save(p / f'{i}.png') for i in range(4)]\"")
_TINY_VLM = "rollout.prompts_per_step=2 rollout.group_size=2 warm_start.steps=1 data.eval_size=4 log.eval_every=0"
_TINY_DIFF = "train.save_every=0 rollout.num_steps=2 rollout.prompts_per_step=1 rollout.group_size=2"
_NO_GPU = "no GPU and no real weights here: the real config with the documented overrides is validated instead"

# The one table: documented command (as extracted: continuation lines joined, comment dropped) -> how it is run.
COMMANDS: dict[str, object] = {
    # README.md, docs/index.md
    "make demo": ByTest("tests/test_docs_commands.py::test_make_demo_target_runs_mmrl_demo",
                        "the full demo takes minutes; `make -n demo` is checked to run `mmrl demo`, and each demo's "
                        "result has its own slow test"),
    "make test": Short("make -n test", "the whole suite is what CI runs; here a dry run checks the target exists"),
    "make install TORCH=cpu": ByTest("tests/test_newcomer.py::test_make_with_torch_cpu_installs_the_cpu_build_first",
                                     "a fresh .venv downloads torch: the test checks the commands make would run"),
    "make install": ByTest("tests/test_newcomer.py::test_make_install_writes_its_stamp_only_after_pip_and_the_check_pass",
                           "a fresh .venv installs several GB: the test runs the target with stand-in pip and python"),
    # docs/architecture.md
    "python benchmarks/golden_metrics.py list": RUN,
    # docs/config-keys.md
    "mmrl train configs/diffusion/flow_grpo_tiny.yaml sample.group_size=8": RUN,
    # docs/development.md
    "make test-fast": Short("make -n test-fast", "runs the suite; a dry run checks the target exists"),
    "make bench": Short("make -n bench", "every benchmark takes many minutes; a dry run checks the target; "
                                         "tests/test_benchmarks.py tests the scripts' parts"),
    "make test-vllm": Short("make -n test-vllm", "builds a second venv with vLLM's CPU build (a download of several "
                                                 "GB); a dry run checks the target and what it runs"),
    "mmrl tiny /tmp/tiny": Short("mmrl tiny tiny", "into the scratch dir instead of /tmp"),
    ".venv/bin/mkdocs build --strict": RUN,
    ".venv/bin/mkdocs serve": ByTest("tests/test_docs_commands.py::test_mkdocs_serve_serves_the_site",
                                     "a server: started on a free port, fetched, stopped"),
    # docs/async.md
    "mmrl train configs/vlm/grpo_tiny_shapes.yaml rollout.worker=process rollout.max_staleness=1": ByTest(
        "tests/vlm/test_grpo_async.py::test_stale_batches_resume_exactly_with_in_flight_batches_saved",
        "the test runs the tiny VLM with a rollout process and stale batches, then resumes it"),
    "mmrl train configs/diffusion/flow_grpo_tiny.yaml rollout.worker=process rollout.max_staleness=1 "
    "algo.old_logprobs=recompute algo.rollout_correction.is_level=token": ByTest(
        "tests/test_async_rollout.py::test_docs_async_commands_short_forms", "the command for 3 small steps"),
    "torchrun --standalone --nproc_per_node 2 -m mmrl.cli train configs/vlm/grpo_tiny_shapes.yaml dist.strategy=ddp "
    "rollout.worker=process rollout.max_staleness=1": ByTest(
        "tests/vlm/test_grpo_async.py::test_torchrun_ddp_each_rank_with_its_rollout_process",
        "the same launch on 2 ranks, each with its rollout process"),
    "torchrun --standalone --nproc_per_node 2 -m mmrl.cli train configs/vlm/grpo_tiny_shapes.yaml "
    "rollout.worker=ranks dist.rollout_ranks=1 rollout.max_staleness=1": ByTest(
        "tests/vlm/test_grpo_ranks.py::test_stale_batches_on_a_rollout_rank_resume_exactly",
        "the test runs this launch (the tiny model built once, a few steps), stops it at a checkpoint and resumes"),
    "torchrun --nnodes 2 --node-rank R --nproc_per_node 2 --master-addr HOST --master-port 29500 -m mmrl.cli train "
    "CONFIG rollout.worker=ranks dist.rollout_ranks=2": ByTest(
        "tests/vlm/test_grpo_ranks.py::test_two_trainer_ranks_with_rollout_ranks_resume_exactly",
        "two machines are not available; the same world of 4 ranks is tested with 4 local processes"),
    "python benchmarks/async_rollout.py --recipes vlm_grpo,flow_grpo --steps 40,20 --repeats 3 --mode process": ByTest(
        "tests/test_benchmarks.py::test_async_rollout_quick_mode_runs_every_variant",
        "the full pass takes 9 minutes: the quick mode runs every variant (both modes)"),
    "python benchmarks/async_rollout.py --recipes vlm_grpo,flow_grpo --steps 40,20 --repeats 3 --mode ranks": ByTest(
        "tests/test_benchmarks.py::test_async_rollout_quick_mode_runs_every_variant",
        "the full pass takes 8 minutes: the quick mode runs every variant (both modes)"),
    # docs/reward-training.md
    "mmrl reward train configs/reward/bt_clip_tiny.yaml": RUN,
    "python benchmarks/preference_loop.py": ByTest(
        "tests/test_benchmarks.py::test_preference_loop_quick_mode_runs_every_stage",
        "5 seeds take minutes: the test runs every stage with --quick (a few pairs, 1-2 steps)"),
    "mmrl reward score learned_pref --weights runs/reward_bt_tiny/reward --images runs/reward_bt_demo/images "
    "--prompts runs/reward_bt_demo/image_prompts.txt --out runs/reward_bt_demo/scores.csv": RUN,
    # docs/prompt-rewriter.md
    # docs/ar-image.md
    "mmrl train configs/ar_image/janus_grpo_tiny_shapes.yaml": Short(
        "mmrl train configs/ar_image/janus_grpo_tiny_shapes.yaml train.max_steps=1 train.save_every=0 "
        "rollout.prompts_per_step=2 rollout.group_size=2 update.micro_batch_size=4", "40 steps: 1 small step"),
    "python benchmarks/janus_color_demo.py": ByTest(
        "tests/test_benchmarks.py::test_janus_color_demo_runs_both_arms_and_evaluates",
        "6 runs of 40 steps take minutes: the test runs the script with 1 seed and 6 steps"),
    "mmrl train configs/joint/rewriter_tiny.yaml": Short(
        "mmrl train configs/joint/rewriter_tiny.yaml train.max_steps=1 train.save_every=0 warm_start.steps=2 "
        "rollout.prompts_per_step=2 rollout.group_size=2 update.mini_batch_size=4 update.micro_batch_size=4 "
        "renderer.num_steps=2 log.eval_max_prompts=2 log.sample_every=0", "about 5 minutes: 1 small step"),
    # docs/real-recipes.md (prompt rewriter)
    "mmrl train configs/joint/rewriter_qwen25vl_3b_sd35_pickscore.yaml model.path=/models/Qwen2.5-VL-3B-Instruct "
    "renderer.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/pickscore/train.txt "
    "data.eval_prompts=data/pickscore/test.txt": ByTest(
        "tests/joint/test_rewriter.py::test_real_recipe_runs_on_tiny_models_of_the_same_layout",
        _NO_GPU.split(":")[0] + ": the test runs a step of this config on tiny models of the same layout"),
    # docs/performance.md (GPU check), docs/scaling.md (sharded checkpoints)
    "python benchmarks/gpu_check.py --out runs/gpu_check --steps 3": ByTest(
        "tests/test_scale_benchmarks.py::test_gpu_check_small_runs_every_recipe",
        "needs a CUDA device: the test runs the same script with --small on CPU"),
    "python benchmarks/gpu_check.py --small --steps 1 --out runs/gpu_check_small": ByTest(
        "tests/test_scale_benchmarks.py::test_gpu_check_small_runs_every_recipe", "the test runs this command"),
    "python -m mmrl.run.consolidate runs/nft/checkpoints/step_40 runs/nft-full/step_40": ByTest(
        "tests/test_sharded_checkpoint.py::test_sharded_and_gathered_checkpoints_resume_on_another_number_of_ranks",
        "needs a sharded run: the test consolidates the checkpoint of a 2-rank run and resumes from it"),
    "python -m mmrl.run.consolidate runs/nft/checkpoints/step_40 runs/nft-weights/step_40 --weights-only": ByTest(
        "tests/test_sharded_checkpoint.py::test_sharded_full_weights_load_into_diffusers_and_mmrl_eval",
        "needs a sharded run: the test consolidates one with --weights-only and loads the weights into diffusers"),
    # docs/dpo-nft.md
    "mmrl train configs/diffusion/nft_tiny.yaml": Short(
        f"mmrl train configs/diffusion/nft_tiny.yaml train.max_steps=1 {_TINY_DIFF}", "minutes: 1 small step"),
    "mmrl train configs/diffusion/dpo_tiny_online.yaml": Short(
        f"mmrl train configs/diffusion/dpo_tiny_online.yaml train.max_steps=1 {_TINY_DIFF}", "minutes: 1 small step"),
    "python -m mmrl.diffusion.dpo make-shapes-pairs data/shapes_pairs 32": Short(
        "python -m mmrl.diffusion.dpo make-shapes-pairs data/shapes_pairs 4", "4 pairs instead of 32"),
    "mmrl train configs/diffusion/dpo_tiny_offline.yaml": Short(
        "mmrl train configs/diffusion/dpo_tiny_offline.yaml train.max_steps=1 train.save_every=0 "
        "rollout.prompts_per_step=2", "minutes: 1 small step on the pairs written above"),
    "python benchmarks/compare_diffusion_algos.py": Short(
        "python benchmarks/compare_diffusion_algos.py --quick --seeds 0 --only flow_grpo dgpo --out runs/compare",
        "10 algorithms x 5 seeds, about an hour: 2 steps of Flow-GRPO and DGPO, one seed"),
    "mmrl train configs/diffusion/awm_tiny.yaml": Short(
        f"mmrl train configs/diffusion/awm_tiny.yaml train.max_steps=1 {_TINY_DIFF}", "1 small step"),
    # docs/editing.md
    "mmrl eval configs/diffusion/flow_grpo_edit_tiny.yaml --samples-per-prompt 4": Short(
        "mmrl eval configs/diffusion/flow_grpo_edit_tiny.yaml --samples-per-prompt 1 --max-prompts 2 "
        "rollout.eval_num_steps=2", "16 edits x 4 samples take minutes: 2 edits, 1 sample, 2 sampling steps"),
    "mmrl train configs/diffusion/flow_grpo_edit_tiny.yaml": ByTest(
        "tests/diffusion/test_editing.py::test_edit_training_and_eval_end_to_end",
        "60 steps take half an hour: the test trains the edit config 2 steps on a tiny Kontext, then evaluates it"),
    "mmrl eval configs/diffusion/flow_grpo_edit_tiny.yaml --checkpoint runs/flow_grpo_edit_tiny --samples-per-prompt 4":
        ByTest("tests/diffusion/test_editing.py::test_edit_training_and_eval_end_to_end",
               "the test evaluates the checkpoint of the run it trained"),
    # docs/export.md
    "mmrl export runs/flow_grpo_tiny --format diffusers-lora --out exports/lora": Short(
        "mmrl train configs/diffusion/flow_grpo_tiny.yaml train.max_steps=1 train.save_every=1 rollout.num_steps=2 "
        "rollout.prompts_per_step=1 rollout.group_size=2 && "
        "mmrl export runs/flow_grpo_tiny --format diffusers-lora --out exports/lora",
        "needs a run: 1 small step of the tiny config first"),
    "mmrl export runs/flow_grpo_tiny --format diffusers --out exports/pipeline": RUN,
    "mmrl export runs/flow_grpo_tiny --format kohya --out exports/comfyui": RUN,
    "mmrl export runs/vlm_grpo_tiny_shapes --format transformers --out exports/vlm": Short(
        f"mmrl train configs/vlm/grpo_tiny_shapes.yaml train.max_steps=1 train.save_every=1 {_TINY_VLM} && "
        "mmrl export runs/vlm_grpo_tiny_shapes --format transformers --out exports/vlm",
        "needs a run: the tiny VLM is built and trained 1 small step first"),
    # docs/flow-grpo.md
    "mmrl train configs/diffusion/flow_grpo_tiny.yaml": Short(
        f"mmrl train configs/diffusion/flow_grpo_tiny.yaml train.max_steps=1 {_TINY_DIFF}", "minutes: 1 small step"),
    "mmrl train configs/diffusion/flow_grpo_sd35_pickscore.yaml model.path=/models/sd3.5-medium": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml model.path=/models/sd3.5-medium", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_sd35_ocr.yaml model.path=/models/sd3.5-medium": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_ocr.yaml model.path=/models/sd3.5-medium", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_flux_pickscore.yaml model.path=/models/FLUX.1-dev": Short(
        "mmrl config check configs/diffusion/flow_grpo_flux_pickscore.yaml model.path=/models/FLUX.1-dev", _NO_GPU),
    "python benchmarks/flow_grpo_step.py": Short(
        "python benchmarks/flow_grpo_step.py --models tiny --steps 2 --prompts 2 --decode-repeats 0",
        "the medium model takes minutes: the tiny one, 2 steps"),
    "torchrun --standalone --nproc_per_node 4 -m mmrl.cli train configs/diffusion/flow_grpo_sd35_pickscore.yaml "
    "model.path=/models/sd3.5-medium dist.strategy=ddp": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml model.path=/models/sd3.5-medium "
        "dist.strategy=ddp", _NO_GPU + "; tests/diffusion/test_flow_grpo.py::test_torchrun_cli_two_processes_then_resume_with_one "
                                       "runs the same torchrun launch on the tiny config"),
    "accelerate launch --multi_gpu --num_processes 4 -m mmrl.cli train configs/diffusion/flow_grpo_sd35_pickscore.yaml "
    "model.path=/models/sd3.5-medium dist.strategy=ddp": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml model.path=/models/sd3.5-medium "
        "dist.strategy=ddp", _NO_GPU + " (accelerate launch with --multi_gpu needs GPUs)"),
    "mmrl train configs/diffusion/flow_grpo_sd35_pickscore.yaml model.path=/models/sd3.5-medium": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml model.path=/models/sd3.5-medium", _NO_GPU),
    # docs/install-and-cli.md
    "pip install -e .": Short("pip install --dry-run --no-index --no-build-isolation -e .",
                              "offline: a dry run resolves every dependency against this venv"),
    'pip install -e ".[ocr]"': Short('pip install --dry-run --no-index --no-build-isolation -e ".[ocr]"',
                                     "offline dry run"),
    'pip install -e ".[vllm]"': Short('pip install --dry-run --no-index --no-deps --no-build-isolation -e ".[vllm]"',
                                      "vLLM is not in this venv (its own venv: CPU vLLM pins another torch); the extra "
                                      "is checked to exist by test_every_documented_command_names_real_things"),
    'pip install -e ".[dev]"': Short('pip install --dry-run --no-index --no-build-isolation -e ".[dev]"',
                                     "offline dry run"),
    "mmrl --version": RUN,
    "mmrl train configs/diffusion/flow_grpo_tiny.yaml train.max_steps=20 optim.lr=3e-4": Short(
        f"mmrl train configs/diffusion/flow_grpo_tiny.yaml train.max_steps=1 optim.lr=3e-4 {_TINY_DIFF}",
        "1 small step"),
    "mmrl config dump flow_grpo > my.yaml": RUN,
    "mmrl config check my.yaml model.path=/models/sd35m": RUN,
    "mmrl train configs/diffusion/flow_grpo_tiny.yaml train.lrr=1": RUN,
    "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml "
    "reward.components.pickscore.weights=/ckpt/PickScore_v1": RUN,
    "mmrl config check configs/diffusion/flow_grpo_tiny.yaml reward.components.pickscore.weigths=/x": RUN,
    # docs/multiturn.md
    "mmrl train configs/vlm/multiturn_grid_tiny.yaml": Short(
        "mmrl train configs/vlm/multiturn_grid_tiny.yaml train.max_steps=1 train.save_every=0 "
        "rollout.prompts_per_step=2 rollout.group_size=2 warm_start.steps=1 env.eval_episodes=4 log.eval_every=0",
        "1 small step"),
    "mmrl train configs/vlm/multiturn_math_tiny.yaml": Short(
        "mmrl train configs/vlm/multiturn_math_tiny.yaml train.max_steps=1 train.save_every=0 "
        "rollout.prompts_per_step=2 rollout.group_size=2", "1 small step"),
    "mmrl train configs/vlm/multiturn_grid_qwen25vl_3b.yaml": Short(
        "mmrl config check configs/vlm/multiturn_grid_qwen25vl_3b.yaml", _NO_GPU),
    # docs/real-recipes.md: real models and data are not here; each config with the page's overrides is validated
    "mmrl train configs/ar_image/janus_grpo_janus_pro_7b_hps.yaml model.path=/models/Janus-Pro-7B "
    "data.train_prompts=data/geneval_and_t2i_data_final.jsonl": Short(
        "mmrl config check configs/ar_image/janus_grpo_janus_pro_7b_hps.yaml model.path=/models/Janus-Pro-7B "
        "data.train_prompts=data/geneval_and_t2i_data_final.jsonl", _NO_GPU),
    "mmrl train configs/ar_image/janus_grpo_janus_pro_7b_hps_cot.yaml model.path=/models/Janus-Pro-7B "
    "data.train_prompts=data/geneval_and_t2i_data_final.jsonl": Short(
        "mmrl config check configs/ar_image/janus_grpo_janus_pro_7b_hps_cot.yaml model.path=/models/Janus-Pro-7B "
        "data.train_prompts=data/geneval_and_t2i_data_final.jsonl", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_sd35_pickscore.yaml "
    "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml "
        "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_sd35_dina_lrm.yaml model.path=/models/stable-diffusion-3.5-medium "
    "data.train_prompts=data/pickscore_sfw/train.txt data.eval_prompts=data/pickscore_sfw/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_dina_lrm.yaml model.path=/models/stable-diffusion-3.5-medium "
        "data.train_prompts=data/pickscore_sfw/train.txt data.eval_prompts=data/pickscore_sfw/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_sd35_hpsv3.yaml model.path=/models/stable-diffusion-3.5-medium "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_hpsv3.yaml model.path=/models/stable-diffusion-3.5-medium "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_qwen_image_edit_editreward.yaml model.path=/models/Qwen-Image-Edit-2511": Short(
        "mmrl config check configs/diffusion/flow_grpo_qwen_image_edit_editreward.yaml "
        "model.path=/models/Qwen-Image-Edit-2511", _NO_GPU),
    "mmrl train configs/vlm/grpo_glm41v_9b_geo3k.yaml model.path=/models/GLM-4.1V-9B-Thinking model.lora.rank=64 "
    "data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet": Short(
        "mmrl config check configs/vlm/grpo_glm41v_9b_geo3k.yaml model.path=/models/GLM-4.1V-9B-Thinking model.lora.rank=64 "
        "data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet", _NO_GPU),
    "mmrl train configs/vlm/grpo_internvl35_1b_geo3k.yaml model.path=/models/InternVL3_5-1B-MPO-hf "
    "data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet": Short(
        "mmrl config check configs/vlm/grpo_internvl35_1b_geo3k.yaml model.path=/models/InternVL3_5-1B-MPO-hf "
        "data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_sd35_ocr.yaml "
    "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/ocr/train.txt data.eval_prompts=data/ocr/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_ocr.yaml "
        "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/ocr/train.txt data.eval_prompts=data/ocr/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_flux_pickscore.yaml "
    "model.path=/models/FLUX.1-dev data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_flux_pickscore.yaml "
        "model.path=/models/FLUX.1-dev data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/nft_sd35_ocr.yaml "
    "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/ocr/train.txt data.eval_prompts=data/ocr/test.txt": Short(
        "mmrl config check configs/diffusion/nft_sd35_ocr.yaml "
        "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/ocr/train.txt data.eval_prompts=data/ocr/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/nft_sd35_pickscore.yaml "
    "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/nft_sd35_pickscore.yaml "
        "model.path=/models/stable-diffusion-3.5-medium data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/dpo_sd35_pickapic.yaml "
    "model.path=/models/stable-diffusion-3.5-medium data.preference_file=data/pickapic_v2/train.parquet data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/dpo_sd35_pickapic.yaml "
        "model.path=/models/stable-diffusion-3.5-medium data.preference_file=data/pickapic_v2/train.parquet data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/vlm/grpo_qwen25vl_3b_geo3k.yaml "
    "model.path=/models/Qwen2.5-VL-3B-Instruct data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet": Short(
        "mmrl config check configs/vlm/grpo_qwen25vl_3b_geo3k.yaml "
        "model.path=/models/Qwen2.5-VL-3B-Instruct data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet", _NO_GPU),
    "mmrl train configs/vlm/grpo_qwen25vl_7b_geo3k.yaml "
    "model.path=/models/Qwen2.5-VL-7B-Instruct data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet": Short(
        "mmrl config check configs/vlm/grpo_qwen25vl_7b_geo3k.yaml "
        "model.path=/models/Qwen2.5-VL-7B-Instruct data.path=/data/geometry3k/data/train-00000-of-00001.parquet data.val_path=/data/geometry3k/data/test-00000-of-00001.parquet", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_wan21_t2v.yaml model.path=/models/Wan2.1-T2V-1.3B-Diffusers "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_wan21_t2v.yaml model.path=/models/Wan2.1-T2V-1.3B-Diffusers "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_wan21_videoalign.yaml model.path=/models/Wan2.1-T2V-1.3B-Diffusers "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_wan21_videoalign.yaml model.path=/models/Wan2.1-T2V-1.3B-Diffusers "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_hunyuan15_t2v.yaml model.path=/models/HunyuanVideo-1.5-480p_t2v "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_hunyuan15_t2v.yaml model.path=/models/HunyuanVideo-1.5-480p_t2v "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_wan22_t2v_a14b.yaml model.path=/models/Wan2.2-T2V-A14B-Diffusers "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_wan22_t2v_a14b.yaml model.path=/models/Wan2.2-T2V-A14B-Diffusers "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_ltx2_t2av.yaml model.path=/models/LTX-2 "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_ltx2_t2av.yaml model.path=/models/LTX-2 "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_flux2_dev.yaml model.path=/models/FLUX.2-dev "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_flux2_dev.yaml model.path=/models/FLUX.2-dev "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_flux_unified_reward_think.yaml model.path=/models/FLUX.1-dev "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_flux_unified_reward_think.yaml model.path=/models/FLUX.1-dev "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_flux2_klein_pickscore.yaml model.path=/models/FLUX.2-klein-9B "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_flux2_klein_pickscore.yaml model.path=/models/FLUX.2-klein-9B "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_z_image_pickscore.yaml model.path=/models/Z-Image "
    "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt": Short(
        "mmrl config check configs/diffusion/flow_grpo_z_image_pickscore.yaml model.path=/models/Z-Image "
        "data.train_prompts=data/pickscore/train.txt data.eval_prompts=data/pickscore/test.txt", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_qwen_image_ocr.yaml model.path=/models/Qwen-Image": Short(
        "mmrl config check configs/diffusion/flow_grpo_qwen_image_ocr.yaml model.path=/models/Qwen-Image", _NO_GPU),
    "mmrl train configs/diffusion/flow_grpo_qwen_image_edit_pickscore.yaml model.path=/models/Qwen-Image-Edit-2511":
        Short("mmrl config check configs/diffusion/flow_grpo_qwen_image_edit_pickscore.yaml "
              "model.path=/models/Qwen-Image-Edit-2511", _NO_GPU),
    "mmrl train configs/vlm/multiturn_grid_qwen25vl_3b.yaml "
    "model.path=/models/Qwen2.5-VL-3B-Instruct": Short(
        "mmrl config check configs/vlm/multiturn_grid_qwen25vl_3b.yaml "
        "model.path=/models/Qwen2.5-VL-3B-Instruct", _NO_GPU),
    # docs/reward-hacking.md
    "mmrl train configs/diffusion/flow_grpo_tiny_judges.yaml": ByTest(
        "tests/diffusion/test_guard.py::test_hacking_demo_fires_on_jpeg_and_stays_quiet_when_regularised",
        "two 10-step trainings with evaluations: the test runs both (the first with log.hacking.stop=true, ending "
        "at the alarm) and checks the page's claims"),
    "mmrl train configs/diffusion/flow_grpo_tiny_judges.yaml algo.kl.coef=1.0 output_dir=runs/flow_grpo_tiny_judges_kl":
        ByTest("tests/diffusion/test_guard.py::test_hacking_demo_fires_on_jpeg_and_stays_quiet_when_regularised",
               "the regularised run of the same test: no alarm in 10 steps"),
    # docs/rewards.md
    "mmrl reward list": RUN,
    "mmrl reward score jpeg_compressibility --images samples/ --out scores.csv": Short(
        f"{_MAKE_IMAGES} && mmrl reward score jpeg_compressibility --images samples/ --out scores.csv",
        "needs images in samples/: four are drawn first"),
    "mmrl reward score pickscore --weights /models/PickScore_v1 --kw processor=/models/CLIP-ViT-H-14 "
    "--images imgs/ --prompts prompts.txt --out scores.csv": ByTest(
        "tests/rewards/test_reward_cli.py::test_score_directory_with_prompts_matches_local",
        "no PickScore weights here: the test scores a directory with a prompt file through the same options"),
    "mmrl reward serve pickscore --weights /models/PickScore_v1 --port 8008": ByTest(
        "tests/rewards/test_reward_cli.py::test_python_m_mmrl_cli_reward_serve",
        "a server, and no PickScore weights here: the test serves a reward from the CLI and scores through it"),
    "MMRL_REWARD_TOKEN=change-me mmrl reward serve pickscore --weights /models/PickScore_v1 --host 0.0.0.0 "
    "--port 8008": ByTest("tests/rewards/test_reward_cli.py::test_python_m_mmrl_cli_reward_serve_with_a_token_from_the_"
                          "environment", "a server, and no PickScore weights here: the test serves from the CLI with "
                          "the token in MMRL_REWARD_TOKEN"),
    # docs/labeling.md
    "mmrl label samples/ --out preferences.jsonl": ByTest(
        "tests/label/test_label_cli.py::test_python_m_mmrl_cli_label_serves_the_page_and_a_rerun_with_a_token_continues",
        "a server until Ctrl-C: the test starts the command on a folder of samples, labels through the printed URL, "
        "stops it with SIGINT and starts it again"),
    "MMRL_LABEL_TOKEN=change-me mmrl label samples/ --out preferences.jsonl --host 0.0.0.0 --port 8009": ByTest(
        "tests/label/test_label_cli.py::test_python_m_mmrl_cli_label_serves_the_page_and_a_rerun_with_a_token_continues",
        "a server on every interface: the test's rerun takes the token from MMRL_LABEL_TOKEN on 127.0.0.1 (the token "
        "rules do not depend on the address) and test_a_wide_bind_without_a_token... checks the refusal"),
    "mmrl reward env create oldsix --packages \"six==1.16.0\" --reuse-site-packages": ByTest(
        "tests/rewards/test_reward_env.py::test_env_create_writes_its_manifest_lists_it_and_refuses_a_second_create",
        "offline here (pip --no-index): the test runs this command with --packages naming a six 1.16.0 wheel built "
        "locally (and --dir in a temp dir)"),
    "mmrl reward env list": RUN,
    "mmrl tiny tiny_models": RUN,
    "mmrl reward score clip_score --weights tiny_models/clip --images samples/ --prompts prompts.txt": Short(
        "printf 'a red circle\\na blue square\\na green circle\\na red square\\n' > prompts.txt && "
        "mmrl reward score clip_score --weights tiny_models/clip --images samples/ --prompts prompts.txt",
        "needs one prompt per image of samples/ (drawn above): a prompt file is written first"),
    # docs/scaling.md
    "torchrun --standalone --nproc_per_node 2 -m mmrl.cli train configs/diffusion/flow_grpo_tiny.yaml": ByTest(
        "tests/test_newcomer.py::test_torchrun_without_a_strategy_trains_data_parallel",
        "the test runs this launch (2 CPU processes, gloo, 2 short steps) and checks the start-up line"),
    "torchrun --standalone --nproc_per_node 4 -m mmrl.cli train configs/diffusion/flow_grpo_sd35_pickscore.yaml "
    "dist.strategy=ddp": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml dist.strategy=ddp", _NO_GPU),
    "accelerate launch --multi_gpu --num_processes 4 -m mmrl.cli train configs/diffusion/flow_grpo_sd35_pickscore.yaml "
    "dist.strategy=ddp": Short(
        "mmrl config check configs/diffusion/flow_grpo_sd35_pickscore.yaml dist.strategy=ddp", _NO_GPU),
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m mmrl.cli train CONFIG "
    "dist.strategy=ddp": ByTest("tests/test_distributed.py::test_torchrun_two_processes",
                                "two nodes are not available; the launch path is tested with 2 local processes"),
    "torchrun --standalone --nproc_per_node 2 -m mmrl.distributed": RUN,
    "torchrun --standalone --nproc_per_node 2 -m mmrl.cli train configs/diffusion/flow_grpo_wan_tiny.yaml "
    "dist.sequence_parallel=2": ByTest(
        "tests/test_sequence_parallel.py::test_torchrun_cli_flow_grpo_wan_split_over_two_processes",
        "the test runs this launch on the tiny Wan it builds (model.path) for one step"),
    # docs/video.md
    "mmrl tiny runs/tiny": ByTest("tests/diffusion/test_video_end_to_end.py::test_docs_video_commands_two_processes_"
                                  "resume_and_eval", "the video test builds the tiny models with `mmrl tiny` first"),
    "mmrl train configs/diffusion/flow_grpo_wan_tiny.yaml": ByTest(
        "tests/diffusion/test_video_end_to_end.py::test_docs_video_commands_two_processes_resume_and_eval",
        "the test trains this config on 2 processes under torchrun, then resumes it on one"),
    "mmrl eval configs/diffusion/flow_grpo_wan_tiny.yaml --checkpoint runs/flow_grpo_wan_tiny": ByTest(
        "tests/diffusion/test_video_end_to_end.py::test_docs_video_commands_two_processes_resume_and_eval",
        "the test evaluates the checkpoint of the run it trained"),
    # docs/vlm-grpo.md
    ".venv/bin/mmrl train configs/vlm/grpo_tiny_shapes.yaml": Short(
        f".venv/bin/mmrl train configs/vlm/grpo_tiny_shapes.yaml train.max_steps=1 train.save_every=0 {_TINY_VLM}",
        "2 minutes: builds the tiny VLM, then 1 small step"),
    ".venv/bin/mmrl eval runs/vlm_grpo_tiny_shapes": RUN,
    ".venv/bin/mmrl train configs/vlm/grpo_tiny_shapes.yaml train.max_steps=300 algo.advantage=rloo": Short(
        f".venv/bin/mmrl train configs/vlm/grpo_tiny_shapes.yaml algo.advantage=rloo train.max_steps=2 "
        f"train.save_every=0 {_TINY_VLM}", "resumes the run above for 1 more step with rloo"),
    "torchrun --standalone --nproc_per_node 4 -m mmrl.cli train configs/vlm/grpo_qwen25vl_3b_geo3k.yaml "
    "dist.strategy=ddp": Short("mmrl config check configs/vlm/grpo_qwen25vl_3b_geo3k.yaml dist.strategy=ddp", _NO_GPU),
    "torchrun --standalone --nproc_per_node 2 -m mmrl.cli train configs/vlm/grpo_tiny_shapes.yaml dist.strategy=ddp "
    "output_dir=runs/ddp train.max_steps=2 rollout.prompts_per_step=4 rollout.group_size=4 "
    "algo.dynamic_sampling=true": ByTest("tests/vlm/test_grpo.py::test_torchrun_ddp_train_then_resume_on_one_process",
                                         "the test runs this launch and the resume below"),
    "mmrl train configs/vlm/grpo_tiny_shapes.yaml output_dir=runs/ddp train.max_steps=3 ...": ByTest(
        "tests/vlm/test_grpo.py::test_torchrun_ddp_train_then_resume_on_one_process", "the resume of the launch above"),
}

# a page whose commands train something: its test is marked slow
SLOW_PAGES = {"dpo-nft.md", "flow-grpo.md", "install-and-cli.md", "multiturn.md", "vlm-grpo.md", "development.md",
              "export.md", "rewards.md", "editing.md"}



def test_extraction_joins_continuations_drops_comments_and_reads_console_output():
    text = ("x\n```bash\n# only a comment\nmmrl train a.yaml \\\n    k=v   # why\nmake demo\n```\n"
            "```\n$ mmrl bad\nmmrl: error: unknown [...] here\n\n```\n```python\nprint('$ no')\n```\n"
            "```\nmmrl eval CONFIG [--x]\n```\n")
    got = shell_commands(text, "p.md")
    assert got == [DocCommand("p.md", 4, "mmrl train a.yaml k=v"), DocCommand("p.md", 6, "make demo"),
                   DocCommand("p.md", 9, "mmrl bad", ("mmrl: error: unknown [...] here",))]
    assert strip_comment("echo 'a # b' # c") == "echo 'a # b'"
    assert output_matches(("mmrl: error: unknown [...] here",), "x\nmmrl: error: unknown key 'a' here\n") == []
    assert output_matches(("mmrl: error: unknown [...] here",), "mmrl: error: other") == [
        "mmrl: error: unknown [...] here"]


# ---------------------------------------------------------------------------------------------------- the table
def _test_exists(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def _configs_and_keys(command: str) -> set[str]:
    """The config files and the overridden keys (`train.max_steps`, not its value) of a command."""
    return {t.split("=")[0] for t in shlex.split(command)
            if t.endswith(".yaml") or re.match(r"^[a-z_]+(\.[a-z_0-9]+)+=", t)}


def test_every_documented_command_is_in_the_table_and_every_entry_is_documented():
    docs = documented_commands()
    shown = {c.command for c in docs}
    unmapped = [c for c in docs if c.command not in COMMANDS]
    assert not unmapped, "\n".join(
        [f"{c.file}:{c.line}: shell command not in COMMANDS of tests/test_docs_commands.py: {c.command!r}"
         for c in unmapped] +
        ["Add one line per command to COMMANDS: `'<command>': RUN` (run as written, must be quick and offline), "
         "`'<command>': Short('<quick form>', '<why>')`, or `'<command>': ByTest('tests/x.py::test_y', '<why>')`."])
    stale = sorted(set(COMMANDS) - shown)
    assert not stale, f"entries in COMMANDS that no page shows any more (remove or update them): {stale}"
    for command, how in COMMANDS.items():
        if isinstance(how, ByTest):
            assert _test_exists(how.test), f"{command!r}: {how.test} does not exist"
        elif isinstance(how, Short):
            kept = _configs_and_keys(command) - _configs_and_keys(how.command)
            assert not kept or command.endswith("..."), \
                f"{command!r}: the short form drops the documented {sorted(kept)}"
            assert how.why
            for part in re.split(r"\s&&\s", how.command):
                problems = lint_command(part)
                assert not problems, f"short form of {command!r}: {problems}"
        else:
            assert how is RUN, f"{command!r}: {how!r} is not RUN, Short(...) or ByTest(...)"


# ---------------------------------------------------------------------------------------------------- running
def scratch_checkout(tmp: Path) -> Path:
    """A temp dir that looks like the checkout (symlinks to its top-level files) with `.venv` = this venv."""
    work = tmp / "checkout"
    work.mkdir()
    for p in ROOT.iterdir():
        if p.name not in {".venv", "runs", "data", "site", ".git"} and not p.name.endswith(".egg-info"):
            (work / p.name).symlink_to(p)
    (work / ".venv").symlink_to(Path(sys.prefix))
    return work


def run_shell(command: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = child_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _pages_with_commands():
    pages = sorted({c.file for c in documented_commands()})
    return [pytest.param(p, marks=[pytest.mark.slow] if Path(p).name in SLOW_PAGES else [], id=p) for p in pages]


_CONFIG_CHECKS = """
import contextlib, io, json, sys, traceback
from mmrl.cli import main
results = []
for argv in json.loads(sys.stdin.read()):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = main(argv)
        except SystemExit as exc:  # (argparse's errors; as a process would exit)
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # a crash fails this command, with its traceback, and the next ones still run
            code = 1
            traceback.print_exc()
    results.append([code, buf.getvalue()])
print("\\n" + json.dumps(results))
"""


def _config_check_argv(command: str) -> list[str] | None:
    """The argv after `mmrl` of a plain `mmrl config check ...` command (no shell syntax), else None."""
    if not command.startswith("mmrl config check ") or any(ch in command for ch in "|&;<>$`()\\\n*?[]{}~#"):
        return None  # (shell syntax, globs, expansions: bash must see it)
    return shlex.split(command)[1:]


def run_config_checks(argvs: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    """Consecutive `mmrl config check` commands in one interpreter (`mmrl.cli.main` on each argv in turn, its output
    captured): the same code as the console script, with the interpreter's start and torch's import paid once for
    the lot instead of once per command (docs/real-recipes.md alone validates 27 configs)."""
    env = child_env()
    proc = subprocess.run([sys.executable, "-c", _CONFIG_CHECKS], input=json.dumps(argvs), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(code, out) for code, out in json.loads(proc.stdout.splitlines()[-1])]


@pytest.mark.parametrize("page", _pages_with_commands())
def test_page_commands_run(page, tmp_path):
    work = scratch_checkout(tmp_path)
    todo = []  # (documented command, command run) in page order
    for c in (c for c in documented_commands() if c.file == page):
        how = COMMANDS.get(c.command)
        if how is None or isinstance(how, ByTest):
            continue  # unmapped: reported by the table test; ByTest: run there
        todo.append((c, c.command if how is RUN else how.command))
    i = 0
    while i < len(todo):
        # a run of consecutive config checks (no output to match: only their exit codes count) in one interpreter
        j = i
        while j < len(todo) and not todo[j][0].expected and _config_check_argv(todo[j][1]) is not None:
            j += 1
        t0 = time.perf_counter()
        if j - i > 1:
            batch = todo[i:j]
            results = run_config_checks([_config_check_argv(command) for _, command in batch], work)
        else:
            j = i + 1
            batch = todo[i:j]
            proc = run_shell(batch[0][1], work)
            results = [(proc.returncode, proc.stdout + proc.stderr)]
        print(f"[docs] {time.perf_counter() - t0:6.1f} s  {len(batch)} command(s) from {batch[0][0].file}:"
              f"{batch[0][0].line} on  {batch[0][1][:100]}")
        for (c, command), (code, output) in zip(batch, results):
            where = f"{c.file}:{c.line}: `{command}`"
            if c.expected:
                missing = output_matches(c.expected, output)
                assert not missing, f"{where} no longer prints {missing}; it printed:\n{output[-3000:]}"
            else:
                assert code == 0, f"{where} exited {code}:\n{output[-3000:]}"
        i = j


def test_make_demo_target_runs_mmrl_demo(tmp_path):
    """`make demo` = install, then `mmrl demo` (dry run: the demo itself is run by the slow demo tests)."""
    proc = run_shell("make -n demo", scratch_checkout(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\S*bin/mmrl demo$", proc.stdout, re.M), proc.stdout


def test_mkdocs_serve_serves_the_site(tmp_path):
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = scratch_checkout(tmp_path)
    env = child_env()
    server = subprocess.Popen([str(Path(sys.executable).parent / "mkdocs"), "serve", "-a", f"127.0.0.1:{port}"],
                              cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, page = time.time() + 120, ""
        while time.time() < deadline and "<html" not in page.lower():
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            except OSError:
                time.sleep(0.5)
        assert "mmrl" in page and "<html" in page.lower()
    finally:
        server.terminate()
        server.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------- static check

def test_lint_catches_renamed_keys_options_targets_and_extras():
    assert lint_command("mmrl train configs/diffusion/flow_grpo_tiny.yaml train.max_steps=2") == []
    assert "no recipe has" not in " ".join(lint_command("mmrl train configs/diffusion/flow_grpo_tiny.yaml train.lr=1"))
    assert lint_command("mmrl train configs/diffusion/flow_grpo_tiny.yaml train.lr=1")  # the renamed key
    assert lint_command("mmrl eval CONFIG [--checkpoint DIR] [--state default|old]") == []
    assert lint_command("mmrl eval CONFIG --chekpoint DIR") == ["`mmrl eval` has no option --chekpoint"]
    assert lint_command("mmrl config dump ALGO") == []
    assert lint_command("mmrl rewards list")[0].startswith("`mmrl` has no subcommand 'rewards'")
    assert lint_command("torchrun --nproc_per_node N -m mmrl.cli train CONFIG dist.strategy=ddp") == []
    assert lint_command("torchrun --nproc_per_node N -m mmrl.cli train CONFIG dist.stratgy=ddp")
    assert lint_command("make tset") == ["Makefile has no target tset"]
    assert lint_command('pip install -e ".[ocr,nosuch]"') == ["pyproject.toml has no extra [nosuch]"]
    assert lint_command("python benchmarks/flow_grpo_step.py --threads 1") == []
    assert lint_command("python benchmarks/flow_grpo_step.py --thread 1") == [
        "benchmarks/flow_grpo_step.py has no option --thread"]
    assert lint_command("python -m mmrl.no_such_module") == ["no module mmrl.no_such_module"]


def test_every_documented_command_names_real_things():
    problems = []
    for f in DOC_FILES:
        text = f.read_text()
        # a `$ ` line shown with its output is an example of an error on purpose: its run checks that output
        commands = [c.command for c in shell_commands(text) if not c.expected] + inline_commands(text)
        problems += [f"{f.relative_to(ROOT)}: `{c}`: {p}" for c in commands for p in lint_command(c)]
    assert not problems, "\n".join(problems)


def test_every_help_example_names_real_things(capsys):
    """`mmrl train --help` suggested `train.lr=1e-4` (the key is optim.lr) and `mmrl eval --help`
    `sample.eval_num_steps=20` (rollout.eval_num_steps): every example of every help text is linted."""
    from mmrl.cli import build_parser

    paths = sorted({path for path, _ in help_texts()})
    for path in paths:  # every subcommand's --help prints and exits 0
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([*path[1:], "--help"])
        assert done.value.code == 0 and "usage: " + " ".join(path) in capsys.readouterr().out
    examples = help_examples()
    assert ("mmrl train --help", "mmrl train train.max_steps=10") in examples  # the extraction finds them
    problems = [f"{where}: `{c}`: {p}" for where, c in examples for p in lint_command(c)]
    assert not problems, "\n".join(problems)
