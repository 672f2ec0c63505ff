"""UnifiedReward run locally (`mmrl.rewards.unified_reward`) on the tiny judges (`mmrl.tiny.build_tiny_unified_reward`,
a Qwen2.5-VL, and `build_tiny_unified_reward_qwen3vl`; random weights: random replies): loading and its errors, each
mode, batched generation = one turn at a time, each backbone's image preprocessing, and the parsing of hand-written
replies in each of the authors' formats (pointwise, pairwise, Think), malformed ones included. Parity with the
authors' code: benchmarks/parity/unified_reward.py, unified_reward_qwen3vl.py (docs/rewards.md)."""

import json
import math

import pytest
import torch

from mmrl import rewards
from mmrl.rewards.base import to_pil_list
from mmrl.rewards.group import is_group_reward, pairwise_verdict
from mmrl.rewards.unified_reward import PROMPTS, UnifiedRewardPairwiseJudge
from mmrl.rewards.vlm_judge import judge_content, pointwise_verdict
from mmrl.tiny import build_tiny_unified_reward, build_tiny_unified_reward_qwen3vl

PROMPTS_ = ["a red circle on a blue background", "two yellow stars", "a photo of a cat", "a green square"]


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_unified_reward(tmp_path_factory.mktemp("ur") / "tiny_unified_reward", seed=0)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_unified_reward_qwen3vl(tmp_path_factory.mktemp("ur3") / "tiny_unified_reward_qwen3vl", seed=0)


def _images(n, size=56):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255


# ------------------------------------------------------------------------------------------ parsing


def test_pointwise_replies_in_the_authors_format():
    # UnifiedReward-qwen's pointwise reply: the caption's elements, then "Final Score:" on a 1-5 scale
    reply = ("red circle (object): 1\nblue background (attribute): 1\n"
             "The image shows a red circle on a blue background with sharp edges.\nFinal Score: 4")
    assert pointwise_verdict(reply, 5.0) == (0.8, 4.0, "")
    assert pointwise_verdict("circle (object): 1\n**Final Score:** 3.5", 5.0) == (0.7, 3.5, "")
    assert pointwise_verdict("Final Score: 7", 5.0)[:2] == (1.0, 7.0)  # out of range: clamped, the raw kept
    for malformed in ("circle (object): 1\nFinal Score: N/A", "The image is good.", ""):
        score, raw, error = pointwise_verdict(malformed, 5.0)
        assert score == 0.0 and math.isnan(raw) and error == "no 'Final Score: x' in the reply"


def test_pairwise_replies_in_the_authors_format():
    # UnifiedReward-qwen's pairwise reply ends with one of its three conclusions
    assert pairwise_verdict("Image 1 shows the stars clearly.\nImage 1 is better.") == (1.0, "")
    assert pairwise_verdict("Image 1 is blurry, the second is sharp.\nImage 2 is better.") == (0.0, "")
    assert pairwise_verdict("Both match the caption.\nBoth images are equally good.") == (0.5, "")
    assert pairwise_verdict("I cannot compare these.") == (0.5, "no single winner named")
    assert pairwise_verdict("") == (0.5, "no single winner named")


def test_think_replies_read_only_the_answer():
    think = ("<think>\n1. Semantic consistency: Image 1 (9/10) - two stars; Image 2 (6/10) - one star\n"
             "Total score:\nImage 1: 9+8+8=25\nImage 2: 6+8+5=19\n</think>\n<answer>Image 1 is better</answer>")
    assert pairwise_verdict(think, require_answer=True) == (1.0, "")
    assert pairwise_verdict(think.replace("<answer>Image 1", "<answer>Image 2"), require_answer=True) == (0.0, "")
    # cut off by max_new_tokens inside the reasoning: its last line names Image 2, but there is no answer
    cut = think.split("</think>")[0].rsplit("\n", 1)[0]
    assert cut.endswith("Image 2: 6+8+5=19")
    assert pairwise_verdict(cut, require_answer=True) == (0.5, "no <answer>...</answer> in the reply")
    assert pairwise_verdict("<think>x</think><answer>neither</answer>", require_answer=True) == \
        (0.5, "no single winner named")


# ------------------------------------------------------------------------------------------ the local judge


def test_pointwise_on_the_tiny_judge(judge_path):
    r = rewards.load("unified_reward", weights=str(judge_path), max_new_tokens=12, batch_size=4)
    assert (r.name, r.needs_prompts, r.score_range) == ("unified_reward", True, (0.0, 1.0))
    assert r.judge.generation_config.do_sample is False and r.judge.generation_config.repetition_penalty == 1.05
    out = r(_images(3), PROMPTS_[:3])
    # random weights: random text, never a "Final Score" -> 0 with the reason, the raw reply kept
    assert out.scores.tolist() == [0.0, 0.0, 0.0] and torch.isnan(out.details["raw_score"]).all()
    assert out.details["parse_error"] == ["no 'Final Score: x' in the reply"] * 3
    assert all(isinstance(t, str) and t for t in out.details["response"])
    again = r(_images(3), PROMPTS_[:3])
    assert again.details["response"] == out.details["response"]  # greedy: deterministic
    # a reply that parses is scored: the same images with a judge whose replies are scripted
    r.judge.replies = lambda turns: [f"x (object): 1\nFinal Score: {k + 2}" for k in range(len(turns))]
    assert r(_images(3), PROMPTS_[:3]).scores.tolist() == pytest.approx([0.4, 0.6, 0.8])


def test_turns_carry_the_images_then_the_authors_prompt(judge_path):
    r = rewards.load("unified_reward", weights=judge_path, max_new_tokens=1)
    seen = []
    r.judge.replies = lambda turns: seen.extend(turns) or ["Final Score: 5"] * len(turns)
    r(_images(2), PROMPTS_[:2])
    assert [c["type"] for c in seen[0]] == ["image", "text"]
    assert seen[1][1]["text"] == PROMPTS["pointwise"].format(prompt=PROMPTS_[1])
    assert seen[1][1]["text"].endswith("Text Caption: [two yellow stars]")


def test_batched_generation_equals_one_turn_at_a_time(judge_path):
    """Left-padded batches (prompts of different lengths, images of different sizes) give every turn the reply it
    gets alone."""
    pils = [to_pil_list(_images(1, size))[0] for size in (56, 84, 56, 112)]
    turns = [judge_content([im], PROMPTS["pointwise"].format(prompt=p)) for im, p in zip(pils, PROMPTS_)]
    one = rewards.load("unified_reward", weights=judge_path, max_new_tokens=24, batch_size=1)
    many = rewards.load("unified_reward", weights=judge_path, max_new_tokens=24, batch_size=4)
    assert many.judge.replies(turns) == one.judge.replies(turns)
    judge = UnifiedRewardPairwiseJudge(weights=judge_path, think=True, max_new_tokens=24, batch_size=3)
    first, second = torch.tensor([0, 0, 1]), torch.tensor([1, 2, 2])
    p, det = judge.compare(_images(3), ["two yellow stars"] * 3, None, first, second)
    judge.judge.batch_size = 1
    p1, det1 = judge.compare(_images(3), ["two yellow stars"] * 3, None, first, second)
    assert det["response"] == det1["response"] and torch.equal(p, p1)
    assert det["parse_error"] == ["no <answer>...</answer> in the reply"] * 3 and p.tolist() == [0.5] * 3


def test_pairwise_and_think_modes_are_group_win_rates(judge_path):
    r = rewards.load("unified_reward", weights=judge_path, mode="pairwise", max_new_tokens=6)
    assert r.name == "unified_reward(pairwise)" and is_group_reward(r)
    imgs, prompts = _images(4), ["a", "a", "a", "b"]
    out = r(imgs, prompts)
    assert out.details["pairs"] == 3 and len(out.details["pair_response"]) == 3
    assert out.details["pair_index"].tolist() == [[0, 1], [0, 2], [1, 2]]
    # scripted verdicts by pair: (0, 1) image 1 wins, (0, 2) a stated tie, (1, 2) image 2 wins
    verdicts = iter(["Image 1 is better.", "Both images are equally good.", "Image 2 is better."])
    r.judge.judge.replies = lambda turns: [next(verdicts) for _ in turns]
    out = r(imgs, prompts)
    # image 0: 1 + 0.5 of 2; image 1: 0 + 0; image 2: 0.5 + 1; image 3 alone in its group: 0.5
    assert out.scores.tolist() == pytest.approx([0.75, 0.0, 0.75, 0.5])
    assert out.details["pair_parse_error"] == ["", "", ""]
    think = rewards.load("unified_reward", weights=judge_path, mode="think", max_new_tokens=6)
    assert think.name == "unified_reward(think)" and think.judge.think
    assert think.judge.prompt_template == PROMPTS["think"]
    # the same judge by name inside pairwise_winrate
    same = rewards.load("pairwise_winrate", judge="unified_reward", weights=judge_path, think=True, max_new_tokens=6)
    assert same(imgs, prompts).details["pair_response"] == think(imgs, prompts).details["pair_response"]


def test_wrong_path_or_layout_is_one_line(tmp_path, judge_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as exc:
        rewards.load("unified_reward", weights=str(missing))
    assert str(exc.value) == (f"unified_reward: weights path '{missing}' does not exist; download a UnifiedReward "
                              "checkpoint (e.g. the Hugging Face repository CodeGoat24/UnifiedReward-qwen-7b) yourself "
                              "and pass its local path (nothing is downloaded automatically)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^unified_reward: no config.json in '.*empty'; expected a Qwen2.5-VL "
                                                r"or Qwen3-VL checkpoint directory"):
        rewards.load("unified_reward", weights=tmp_path / "empty")
    (tmp_path / "clip").mkdir()
    (tmp_path / "clip" / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(ValueError, match=r"^unified_reward: '.*clip' holds a 'clip' model \(config.json model_type\); "
                                         r"expected 'qwen2_5_vl' \(Qwen2.5-VL\) or 'qwen3_vl' \(Qwen3-VL\), a "
                                         r"UnifiedReward checkpoint"):
        rewards.load("unified_reward", weights=tmp_path / "clip")
    with pytest.raises(ValueError, match=r"^unified_reward: mode must be one of pointwise, pairwise, think; got 'rank'"):
        rewards.load("unified_reward", weights=judge_path, mode="rank")
    with pytest.raises(ValueError, match=r"prompt_template must be one of .* or a string containing '\{prompt\}'"):
        rewards.load("unified_reward", weights=judge_path, prompt_template="no caption")


@pytest.mark.parametrize("model_type", ["llava", "llava_qwen", "llava_onevision"])
def test_llava_onevision_judges_are_refused_in_one_line(tmp_path, model_type):
    """UnifiedReward-7b / -7b-v1.5 / -Think-7b are LLaVA-NeXT checkpoints: one line saying why they do not load."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type,
                                                      "architectures": ["LlavaQwenForCausalLM"]}))
    with pytest.raises(ValueError) as exc:
        rewards.load("unified_reward", weights=tmp_path)
    assert str(exc.value) == (
        f"unified_reward: '{tmp_path}' holds a {model_type!r} model (config.json model_type): UnifiedReward's "
        "LLaVA-OneVision judges (UnifiedReward-7b, -7b-v1.5, -Think-7b) exist only in the original LLaVA-NeXT format, "
        "which only the authors' llava package loads; use a Qwen2.5-VL or Qwen3-VL UnifiedReward checkpoint "
        "(e.g. CodeGoat24/UnifiedReward-2.0-qwen3vl-8b)")


def test_qwen3vl_judge_pointwise_and_pairwise(qwen3_path):
    """A Qwen3-VL checkpoint (UnifiedReward-2.0-qwen3vl, -Think-qwen3vl) loads by its config.json model_type into
    transformers' Qwen3-VL class and runs the authors' vLLM-client inference: greedy, 4096 new tokens by default,
    their Qwen3-VL Think prompt."""
    from transformers import Qwen3VLForConditionalGeneration

    default = rewards.load("unified_reward", weights=qwen3_path)
    assert default.judge.model_type == "qwen3_vl" and isinstance(default.judge.model, Qwen3VLForConditionalGeneration)
    gen = default.judge.generation_config
    assert (gen.max_new_tokens, gen.do_sample, gen.repetition_penalty) == (4096, False, 1.0)
    r = rewards.load("unified_reward", weights=qwen3_path, max_new_tokens=8)
    out = r(_images(1), PROMPTS_[:1])
    assert out.scores.tolist() == [0.0] and out.details["parse_error"] == ["no 'Final Score: x' in the reply"]
    assert isinstance(out.details["response"][0], str) and out.details["response"][0]
    r.judge.replies = lambda turns: ["x (object): 1\nFinal Score: 3"] * len(turns)
    assert r(_images(1), PROMPTS_[:1]).scores.tolist() == pytest.approx([0.6])
    pair = rewards.load("unified_reward", weights=qwen3_path, mode="pairwise", max_new_tokens=8)
    out = pair(_images(2), ["a", "a"])
    assert out.details["pairs"] == 1 and isinstance(out.details["pair_response"][0], str)
    pair.judge.judge.replies = lambda turns: ["Image 2 is better."] * len(turns)
    assert pair(_images(2), ["a", "a"]).scores.tolist() == [0.0, 1.0]
    think = UnifiedRewardPairwiseJudge(weights=qwen3_path, think=True, max_new_tokens=1)
    assert think.prompt_template == PROMPTS["pref_grpo_think"]  # = their qwen3_infer_cot_image_generation.py text


def _processor_images(judge, image):
    """The images the judge's processor receives for one pointwise turn of `image`."""
    seen, processor = [], judge.processor

    class Spy:
        def __getattr__(self, name):
            return getattr(processor, name)

        def __call__(self, **kwargs):
            seen.extend(kwargs["images"])
            return processor(**kwargs)

    judge.processor = Spy()
    judge.replies([judge_content([image], "x")])
    judge.processor = processor
    return seen


def test_each_backbone_preprocesses_images_as_its_authors_code(judge_path, qwen3_path):
    """Qwen2.5-VL: qwen_vl_utils' resize (their transformers scripts); Qwen3-VL: a JPEG of quality 95 at the image's
    own size, the processor resizing it (their vLLM client)."""
    import io

    import numpy as np
    from PIL import Image

    from mmrl.pipelines.images import resize_for_qwen

    image = to_pil_list(_images(1, 70))[0]
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95)
    jpeg = np.asarray(Image.open(buf).convert("RGB"))
    q3 = rewards.load("unified_reward", weights=qwen3_path, max_new_tokens=1).judge
    (seen,) = _processor_images(q3, image)
    assert seen.size == (70, 70) and np.array_equal(np.asarray(seen), jpeg)
    q25 = rewards.load("unified_reward", weights=judge_path, max_new_tokens=1).judge
    (seen,) = _processor_images(q25, image)
    assert seen.size == (56, 56) and np.array_equal(np.asarray(seen), np.asarray(resize_for_qwen(image)))


def test_http_judges_ask_the_same_turn_by_prompt_name(judge_path):
    """`vlm_judge` / `vlm_pairwise` (a UnifiedReward served over HTTP) take the authors' prompts by name and send the
    turn the local judge generates from: the images, then the same text."""
    http = rewards.load("vlm_judge", base_url="http://127.0.0.1:1/v1", model="UnifiedReward-qwen-7b",
                        prompt_template="pointwise")
    image = _images(1)[0]
    body = http.request_body(image, "two yellow stars")
    local = rewards.load("unified_reward", weights=judge_path, max_new_tokens=1)
    seen = []
    local.judge.replies = lambda turns: seen.extend(turns) or ["Final Score: 5"]
    local(image[None], ["two yellow stars"])
    (img_part, text_part), (local_img, local_text) = body["messages"][0]["content"], seen[0]
    assert img_part["type"] == "image_url" and local_img["type"] == "image" and text_part == local_text
    pair = rewards.load("pairwise_winrate", judge="vlm_pairwise", base_url="http://127.0.0.1:1/v1", model="m",
                        prompt_template="pref_grpo_think", think=True)
    assert pair.judge.prompt_template == PROMPTS["pref_grpo_think"] and pair.judge.think


def test_reward_score_cli_writes_each_reply(tmp_path, judge_path):
    """`mmrl reward score unified_reward`: a row per image with the score, the raw reply and the parse error."""
    import argparse

    from mmrl.rewards.cli import add_reward_subparsers

    (tmp_path / "imgs").mkdir()
    for i, image in enumerate(to_pil_list(_images(2))):
        image.save(tmp_path / "imgs" / f"{i}.png")
    (tmp_path / "prompts.txt").write_text("a red circle\ntwo cats\n")
    parser = argparse.ArgumentParser(prog="mmrl")
    add_reward_subparsers(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "scores.jsonl"
    args = parser.parse_args(["reward", "score", "unified_reward", "--weights", str(judge_path), "--kw",
                              "max_new_tokens=6", "--images", str(tmp_path / "imgs"), "--prompts",
                              str(tmp_path / "prompts.txt"), "--out", str(out)])
    assert args.func(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["a red circle", "two cats"] and [r["score"] for r in rows] == [0.0, 0.0]
    assert all(r["parse_error"] == "no 'Final Score: x' in the reply" and r["response"] for r in rows)
