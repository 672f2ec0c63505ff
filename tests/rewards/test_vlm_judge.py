"""VLM judge against a fake OpenAI-compatible server started on 127.0.0.1 inside the test."""

import threading

import pytest
import torch

from mmrl.rewards import load
from mmrl.rewards.remote import RemoteRewardError, decode_image_base64
from mmrl.rewards.vlm_judge import DEFAULT_JUDGE_PROMPT, VLMJudge, parse_final_score
from mmrl.testing import chat_completions_server

# caption -> the judge's fixed reply
REPLIES = {
    "a red cube": "Elements: red (colour): yes; cube (object): yes.\nFinal Score: 4",
    "two cats": "Only one cat is visible.\n**Final Score:** 2.5",
    "a poem": "I cannot rate this image.",
    "overflow": "Final Score: 7",
}


def _fake_openai(check_images, barrier=None, fail_first=0):
    """A tiny chat-completions server: validates the request shape, answers REPLIES[caption]."""
    state = {"calls": 0, "errors": [], "fail_left": fail_first, "auth": set()}
    lock = threading.Lock()

    def handle(req, headers):
        with lock:
            state["calls"] += 1
            state["auth"].add(headers.get("Authorization"))
            failing = state["fail_left"] > 0
            state["fail_left"] -= failing
        if failing:
            return 503, "overloaded"
        try:
            assert req["model"] == "judge-7b" and req["temperature"] == 0.0 and req["max_tokens"] == 64
            (msg,) = req["messages"]
            assert msg["role"] == "user"
            img_part, text_part = msg["content"]
            assert img_part["type"] == "image_url" and text_part["type"] == "text"
            url = img_part["image_url"]["url"]
            assert url.startswith("data:image/png;base64,")
            check_images(decode_image_base64(url))
            text = text_part["text"]
            assert "Final Score: X" in text
            caption = text.rsplit("Prompt: ", 1)[1]
            if barrier is not None:
                barrier.wait(timeout=10)  # only passes if requests arrive concurrently
        except Exception as exc:  # noqa: BLE001
            state["errors"].append(repr(exc))
            return 400, repr(exc)
        return 200, REPLIES[caption]

    httpd, url = chat_completions_server(handle)
    return httpd, state, url


def _images(n):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 8, 8), generator=g).float() / 255


def test_doctests():
    import doctest

    import mmrl.rewards.vlm_judge as V

    res = doctest.testmod(V)
    assert res.attempted >= 1 and res.failed == 0


def test_parse_final_score():
    assert parse_final_score("blah\nFinal Score: 3") == 3.0
    assert parse_final_score("final score = 4.25 (out of 5)") == 4.25
    assert parse_final_score("Final Score: 2\n...revised. Final Score: 5") == 5.0
    assert parse_final_score("score 4") is None and parse_final_score("") is None


def test_scores_parse_errors_and_request_shape(monkeypatch):
    imgs = _images(4)
    seen = []
    httpd, state, base_url = _fake_openai(lambda t: seen.append(t))
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
    try:
        judge = load("vlm_judge", base_url=base_url, model="judge-7b", api_key_env="MY_JUDGE_KEY", max_tokens=64)
        assert isinstance(judge, VLMJudge)
        out = judge(imgs, prompts=["a red cube", "two cats", "a poem", "overflow"])
        assert not state["errors"], state["errors"]
        # 4/5, 2.5/5, unparseable -> 0, 7/5 clamped to 1
        torch.testing.assert_close(out.scores, torch.tensor([0.8, 0.5, 0.0, 1.0]))
        assert out.details["raw_score"][[0, 1, 3]].tolist() == [4.0, 2.5, 7.0]
        assert torch.isnan(out.details["raw_score"][2])
        assert out.details["parse_error"] == ["", "", "no 'Final Score: x' in the reply", ""]
        assert out.details["response"][1] == REPLIES["two cats"]
        assert state["auth"] == {"Bearer sk-test"} and state["calls"] == 4
        # every image arrived losslessly (PNG of uint8-grid pixels), in some order
        assert len(seen) == 4 and all(any(torch.equal(t, im) for im in imgs) for t in seen)
        with pytest.raises(ValueError, match="needs prompts"):
            judge(imgs)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_requests_run_concurrently():
    barrier = threading.Barrier(4)
    httpd, state, base_url = _fake_openai(lambda t: None, barrier=barrier)
    try:
        judge = VLMJudge(base_url, "judge-7b", api_key="k", max_tokens=64, max_workers=4, timeout=20, retries=0)
        out = judge(_images(4), prompts=["a red cube"] * 4)
        assert not state["errors"]
        torch.testing.assert_close(out.scores, torch.full((4,), 0.8))
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_retries_5xx_then_succeeds_and_on_error():
    httpd, state, base_url = _fake_openai(lambda t: None, fail_first=2)
    try:
        judge = VLMJudge(base_url, "judge-7b", api_key="", api_key_env="", max_tokens=64, max_workers=1,
                         retries=3, backoff=0.01)
        assert judge(_images(1), prompts=["two cats"]).scores.tolist() == [0.5]
        assert state["calls"] == 3 and state["auth"] == {None}  # no key -> no Authorization header
        state["fail_left"] = 10
        with pytest.raises(RemoteRewardError, match=r"vlm_judge: .*HTTP 503: overloaded"):
            VLMJudge(base_url, "judge-7b", max_tokens=64, retries=1, backoff=0.01)(_images(1), prompts=["x"])
        soft = VLMJudge(base_url, "judge-7b", max_tokens=64, retries=0, on_error="zero")
        out = soft(_images(2), prompts=["x", "y"])
        assert out.scores.tolist() == [0.0, 0.0] and out.details["parse_error"][0].startswith("request failed")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_validation():
    with pytest.raises(ValueError, match="base_url"):
        VLMJudge("localhost:8000", "m")
    with pytest.raises(ValueError, match="{prompt}"):
        VLMJudge("http://127.0.0.1:1/v1", "m", prompt_template="no placeholder")
    assert "{prompt}" in DEFAULT_JUDGE_PROMPT and "Final Score" in DEFAULT_JUDGE_PROMPT
