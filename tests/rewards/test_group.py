"""Group-wise and pairwise rewards (`mmrl.rewards.group`): ranks and win rates by hand, the pairwise VLM judge
against a fake OpenAI-compatible server on 127.0.0.1, use inside a composite and in a rollout scorer."""

import doctest
import threading

import pytest
import torch

from mmrl import rewards
from mmrl.rewards import group as group_mod
from mmrl.rewards.group import is_group_reward, parse_winner, resolve_group_ids, win_rates
from mmrl.rewards.remote import decode_image_base64
from mmrl.testing import chat_completions_server

P = ["a red circle on a blue background", "a yellow square on a black background"]


def _grey(levels):
    """Images of constant grey levels (brightness ranks them for the `_test_brightness`-like scorers below)."""
    return torch.stack([torch.full((3, 8, 8), float(v)) for v in levels])


class Brightness(rewards.RewardModel):
    name = "_test_brightness"

    def __init__(self, device=None):
        pass

    def score_images(self, images, prompts, metadata):
        return rewards.RewardOutput(images.float().mean(dim=(1, 2, 3)), {})


rewards.register("_test_brightness")(Brightness)


def test_doctest():
    assert doctest.testmod(group_mod).failed == 0


def test_group_ids_from_ids_metadata_prompts_or_one_group():
    assert resolve_group_ids(3, group_ids=[7, 3, 7]).tolist() == [0, 1, 0]
    assert resolve_group_ids(3, ["a", "b"], [{"group": 5}, {"group": 5}, {"group": 1}]).tolist() == [0, 0, 1]
    assert resolve_group_ids(3, ["x", "y", "x"]).tolist() == [0, 1, 0]
    assert resolve_group_ids(2).tolist() == [0, 0]
    with pytest.raises(ValueError, match="group_ids"):
        resolve_group_ids(3, group_ids=[1, 2])


def test_group_rank_by_hand_with_ties_and_singletons():
    r = rewards.load("group_rank", scorer="_test_brightness")
    # group "a": brightness .1 .5 .5 .9 -> ranks 0, 1.5, 1.5, 3 over n - 1 = 3; group "b": a single image -> 0.5
    out = r(_grey([0.1, 0.5, 0.9, 0.5, 0.3]), ["a", "a", "a", "a", "b"])
    assert out.scores.tolist() == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.5])
    assert out.details["score"].tolist() == pytest.approx([0.1, 0.5, 0.9, 0.5, 0.3])
    assert is_group_reward(r) and r.name == "group_rank(_test_brightness)"


def test_pairwise_winrate_bradley_terry():
    imgs, prompts = _grey([0.2, 0.6, 0.4]), ["a"] * 3
    hard = rewards.load("pairwise_winrate", judge="bradley_terry", scorer="_test_brightness", hard=True)
    rank = rewards.load("group_rank", scorer="_test_brightness")
    assert torch.equal(hard(imgs, prompts).scores, rank(imgs, prompts).scores)  # hard judge = rank
    soft = rewards.load("pairwise_winrate", judge="bradley_terry", scorer="_test_brightness", temperature=0.1)
    s = soft(imgs, prompts).scores
    p = lambda a, b: torch.sigmoid(torch.tensor((a - b) / 0.1)).item()  # noqa: E731
    want = [(p(0.2, 0.6) + p(0.2, 0.4)) / 2, (p(0.6, 0.2) + p(0.6, 0.4)) / 2, (p(0.4, 0.2) + p(0.4, 0.6)) / 2]
    assert s.tolist() == pytest.approx(want, abs=1e-6)
    assert s.sum().item() == pytest.approx(1.5, abs=1e-6)  # win rates of a group of n sum to n / 2
    both = rewards.load("pairwise_winrate", judge="bradley_terry", scorer="_test_brightness", temperature=0.1,
                        both_orders=True)
    assert torch.allclose(both(imgs, prompts).scores, s, atol=1e-6)  # a symmetric judge: both orders agree
    with pytest.raises(ValueError, match=r"unknown judge 'oracle'; valid: \['bradley_terry', 'unified_reward', "
                                         r"'vlm_pairwise'\]"):
        rewards.load("pairwise_winrate", judge="oracle")


def test_win_rates_matrix():
    prefer = torch.tensor([[0.0, 1.0, 0.25], [0.0, 0.0, 0.5], [0.75, 0.5, 0.0]])
    assert win_rates(prefer, torch.tensor([0, 0, 0])).tolist() == pytest.approx([0.625, 0.25, 0.625])
    assert win_rates(prefer, torch.tensor([0, 0, 1])).tolist() == pytest.approx([1.0, 0.0, 0.5])


def test_inside_a_composite_and_refused_by_the_async_scorer():
    from mmrl.diffusion.scoring import AsyncRewardScorer

    comp = rewards.load({"_test_brightness": 1.0, "group_rank": {"weight": 0.5, "scorer": "_test_brightness"}})
    out = comp(_grey([0.1, 0.3, 0.2, 0.4]), ["a", "a", "b", "b"])
    assert out.details["group_rank"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out.scores.tolist() == pytest.approx([0.1, 0.8, 0.2, 0.9])
    assert is_group_reward(comp)
    with pytest.raises(ValueError, match="group reward"):
        AsyncRewardScorer(comp)


def _fake_pairwise_server(replies=None):
    """Chat completions that prefer the brighter of two images ("Image 1 is better" / "Image 2 is better"), or the
    fixed reply of a caption in `replies`; validates that each request carries two images then the text."""
    state = {"calls": 0, "errors": []}
    lock = threading.Lock()

    def handle(req, headers):
        with lock:
            state["calls"] += 1
        try:
            (msg,) = req["messages"]
            a, b, text = msg["content"]
            assert a["type"] == b["type"] == "image_url" and text["type"] == "text"
            assert "Image 1" in text["text"] and "Image 2" in text["text"]
            caption = text["text"].rsplit("Prompt: ", 1)[1]
            la, lb = (decode_image_base64(x["image_url"]["url"]).float().mean().item() for x in (a, b))
            reply = (replies or {}).get(caption) or ("Image 1 is better" if la > lb else "Image 2 is better")
        except Exception as exc:  # noqa: BLE001
            state["errors"].append(repr(exc))
            return 400, repr(exc)
        return 200, f"Reasoning...\n{reply}"

    httpd, url = chat_completions_server(handle)
    return httpd, state, url


def test_vlm_pairwise_judge_win_rates():
    httpd, state, url = _fake_pairwise_server({"tie": "Both are equally good."})
    try:
        r = rewards.load("pairwise_winrate", judge="vlm_pairwise", base_url=url, model="judge", max_workers=4)
        imgs = _grey([0.2, 0.8, 0.5, 0.1, 0.9, 0.3, 0.4])
        prompts = ["a"] * 4 + ["b"] * 2 + ["tie"]
        out = r(imgs, prompts)
        # group a: brightness .2 .8 .5 .1 -> wins 1, 3, 2, 0 of 3; group b: .9 beats .3; "tie" alone: 0.5
        assert out.scores.tolist() == pytest.approx([1 / 3, 1.0, 2 / 3, 0.0, 1.0, 0.0, 0.5])
        assert state["calls"] == 6 + 1 and not state["errors"]  # 6 pairs in group a, 1 in b, none for a singleton
        r2 = rewards.load("pairwise_winrate", judge="vlm_pairwise", base_url=url, model="judge", both_orders=True)
        assert r2(imgs[:2], ["tie", "tie"]).scores.tolist() == [0.5, 0.5]  # no winner named: a tie each way
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_vlm_pairwise_think_reads_only_the_answer_and_reports_per_pair():
    """A Think judge's reply cut off inside <think> ends on a line naming Image 1: `think=True` reads only the
    <answer> (a tie, with the reason); a stated tie carries no parse error; the replies come back per pair."""
    httpd, state, url = _fake_pairwise_server({"cut": "<think>\nImage 1: 9+8=17", "tie": "Both are equally good."})
    try:
        imgs = _grey([0.2, 0.8])
        plain = rewards.load("pairwise_winrate", judge="vlm_pairwise", base_url=url, model="judge")
        assert plain(imgs, ["cut", "cut"]).scores.tolist() == [1.0, 0.0]  # the last line of the reasoning
        think = rewards.load("pairwise_winrate", judge="vlm_pairwise", base_url=url, model="judge", think=True)
        out = think(imgs, ["cut", "cut"])
        assert out.scores.tolist() == [0.5, 0.5]
        assert out.details["pair_parse_error"] == ["no <answer>...</answer> in the reply"]
        assert out.details["pair_response"] == ["Reasoning...\n<think>\nImage 1: 9+8=17"]
        assert out.details["pair_index"].tolist() == [[0, 1]]
        assert plain(imgs, ["tie", "tie"]).details["pair_parse_error"] == [""]
        assert not state["errors"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_parse_winner():
    assert parse_winner("Image 1 looks sharper.\nImage 2 is better") == 2
    assert parse_winner("<think>Image 2 has artifacts</think><answer>Image 1</answer>") == 1
    assert parse_winner("Image 1 and Image 2 are equal") is None and parse_winner("") is None


def test_shapes_geneval_reward():
    import random

    from mmrl.pipelines.shapes_check import parse_shapes_prompt, scene_for_prompt

    rng = random.Random(0)
    scenes = [scene_for_prompt(parse_shapes_prompt(p), rng) for p in P]
    imgs = torch.stack([torch.tensor(list(s.image.getdata()), dtype=torch.float32).reshape(64, 64, 3).permute(2, 0, 1)
                        for s in scenes]) / 255
    r = rewards.load("shapes_geneval")
    assert r(imgs, P).scores.tolist() == [1.0, 1.0]  # exact scenes pass every asked check
    # the scenes swapped: each prompt's object, colour and background are all wrong
    assert r(imgs.flip(0), P).scores.tolist() == [0.0, 0.0]
    # a flat image of the right background colour: object/colour/count fail, background passes -> 1 of 4 checks
    blue = torch.tensor([30, 60, 220], dtype=torch.float32).view(3, 1, 1).expand(3, 64, 64) / 255
    assert r(blue[None], P[:1]).scores.tolist() == [0.25]
    assert rewards.load("shapes_geneval", mode="correct")(blue[None], P[:1]).scores.tolist() == [0.0]
    with pytest.raises(ValueError, match="shapes grammar"):
        r(imgs[:1], ["a photo of a cat"])
