"""VLM policy families beyond Qwen: mmrl's HF rollout engine against transformers' own `generate`, same work, on the
tiny GLM-4.1V and InternVL checkpoints (`mmrl.tiny.build_tiny_glm4v`, `build_tiny_internvl`).

    .venv/bin/python benchmarks/vlm_families_rollout.py [--repeats 5] [--threads 1] [--new-tokens 32]

Per family: one prompt with one 60 x 90 image (GLM: a 4 x 6 patch grid, 6 image tokens; InternVL: 2 tiles + a
thumbnail), greedy decoding of `--new-tokens` tokens with the engine's banned vision tokens and no early stop on
either side (`HFRolloutEngine.generate` on one request; `model.generate(do_sample=False, bad_words_ids=...)` on the
same ids and pixels; both given a banned token as EOS), interleaved (`_timing.interleaved`, one warm-up round), ms min / median / max,
and whether the tokens are equal (they must be). Prints a Markdown table and the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from _timing import interleaved, machine, markdown_table, speedup

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAMILIES = ("glm4v", "internvl")


def compare(path: Path, repeats: int, new_tokens: int = 32):
    """(times {"mmrl", "transformers"}, tokens equal, generated token count) for one tiny checkpoint."""
    from PIL import Image

    from mmrl.vlm.common import encode_prompt, load_policy, messages_from_text, render_prompt
    from mmrl.vlm.families import family_of_config
    from mmrl.vlm.rollout import GenRequest, HFRolloutEngine, SamplingParams

    model, processor = load_policy(path)
    g = torch.Generator().manual_seed(0)
    image = Image.fromarray((torch.rand(60, 90, 3, generator=g) * 255).byte().numpy())
    text = render_prompt(processor, messages_from_text("<image>What color is it?"))
    enc = encode_prompt(processor, text, [image])
    # EOS = a banned vision token on both sides, never generated: both decode exactly `new_tokens` tokens
    never = HFRolloutEngine(model, processor).banned[0]
    engine = HFRolloutEngine(model, processor, eos_token_ids=[never])
    ids = torch.tensor([enc.input_ids])
    extra = ({"mm_token_type_ids": (ids == model.config.image_token_id).long()}
             if family_of_config(model.config).name == "glm4v" else {})  # GLM's forward takes them, InternVL's not
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    out = {}

    def ours():
        out["mmrl"] = engine.generate([GenRequest(prompt_text=enc.text, images=[image])], sampling)[0].response_ids

    def theirs():
        with torch.no_grad():
            res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **enc.mm, **extra,
                                 do_sample=False, max_new_tokens=new_tokens, eos_token_id=never,
                                 bad_words_ids=[[b] for b in engine.banned])
        out["transformers"] = res[0, ids.shape[1]:].tolist()

    times = interleaved({"mmrl": ours, "transformers": theirs}, repeats=repeats, warmup=1)
    return times, out["mmrl"] == out["transformers"], len(out["mmrl"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    import mmrl.tiny as tiny

    torch.set_num_threads(args.threads)
    print(f"`python benchmarks/vlm_families_rollout.py {' '.join(argv if argv is not None else sys.argv[1:])}` - "
          f"{machine(args.threads)}\n", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            path = getattr(tiny, f"build_tiny_{name}")(Path(tmp) / name, seed=0)
            times, equal, n = compare(path, args.repeats, args.new_tokens)
            rows.append((name, str(n), times["mmrl"].fmt(1e3, 0), times["transformers"].fmt(1e3, 0),
                         speedup(times["transformers"], times["mmrl"]), "yes" if equal else "NO"))
    print("Greedy rollout of one prompt with one 60 x 90 image, tiny checkpoints; ms min / median / max, interleaved\n")
    print(markdown_table(["family", "new tokens", "mmrl HFRolloutEngine", "transformers generate",
                          "transformers / mmrl", "same tokens"], rows))
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
