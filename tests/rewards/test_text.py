"""Rule-based text rewards: extraction, math accuracy (math_verify + fallback), choices, format, IoU, geo3k."""

import doctest
import threading

import pytest
import torch

import mmrl.rewards.answers as A
import mmrl.rewards.text as T
from mmrl.rewards import available, load


def test_doctests():
    # the string helpers (answers.py, re-exported by text.py) and the reward callables (text.py)
    results = [doctest.testmod(m, optionflags=doctest.ELLIPSIS) for m in (A, T)]
    assert all(r.attempted > 0 for r in results)
    assert sum(r.attempted for r in results) >= 15 and sum(r.failed for r in results) == 0


# ----------------------------------------------------------------------------- extraction


def test_extract_boxed_nested_and_last_wins():
    assert T.extract_boxed(r"first \boxed{1}, finally \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert T.extract_boxed(r"\boxed{\sqrt{\frac{a}{b}} + {c}}") == r"\sqrt{\frac{a}{b}} + {c}"
    assert T.extract_boxed(r"\fbox{7}") == "7"
    assert T.extract_boxed(r"\boxed{unclosed") is None
    assert T.extract_boxed("nothing") is None


def test_extract_tagged_and_final_answer_priority():
    assert T.extract_tagged("<answer>a</answer> then <answer> b </answer>") == "b"
    assert T.extract_tagged("<ans>x</ans>", "ans") == "x"
    assert T.extract_tagged("<answer>open") is None
    # boxed > tag > last number
    assert T.extract_final_answer(r"<answer>5</answer> \boxed{6} 7") == "6"
    assert T.extract_final_answer("<answer>5</answer> 7") == "5"
    assert T.extract_final_answer("x=3, so 1,250 units") == "1,250"
    assert T.extract_final_answer("no numbers") is None
    assert T.extract_final_answer("no numbers", fallback="text") == "no numbers"
    # conversational completions: last message's content
    assert T.extract_final_answer([{"role": "assistant", "content": r"\boxed{9}"}]) == "9"


def test_normalize_and_parse_number():
    assert T.normalize_answer(r"$\text{ 12 }$.") == "12"
    assert T.normalize_answer(r"\left[ 0, 1 \right]") == "[0,1]"
    assert T.normalize_answer(r"30^\circ") == "30"
    assert T.normalize_answer("0042") == "42"
    assert T.normalize_answer("0.5") == "0.5"  # the zero before the point stays
    assert T.normalize_answer("Paris", lowercase=True) == "paris"
    assert T.parse_number("12,345.5") == 12345.5
    assert T.parse_number(r"-\frac{3}{4}") == -0.75
    assert T.parse_number("50%") == 50.0
    assert T.parse_number("1/0") is None


# ----------------------------------------------------------------------------- math accuracy


def test_math_equal_latex_fraction_vs_decimal_uses_math_verify():
    assert T.math_equal(r"\frac{1}{2}", "0.5")
    assert T.math_equal("0.5", r"\frac{1}{2}")
    assert T.math_equal(r"2\sqrt{2}", r"\sqrt{8}")  # only symbolic comparison gets this one
    assert not A._string_equal(r"2\sqrt{2}", r"\sqrt{8}", 1e-6)
    assert not T.math_equal(r"\frac{1}{3}", "0.5")
    assert not T.math_equal(None, "1")


def test_math_equal_string_fallback_numbers_within_tolerance():
    assert T.math_equal("1,000", "1000")
    assert T.math_equal("3.0000001", "3", tol=1e-6)
    assert not T.math_equal("3.01", "3", tol=1e-6)


def test_math_equal_off_main_thread_is_safe():
    # math_verify's SIGALRM timeout cannot run off the main thread; our wrapper must still answer
    out = {}

    def run():
        out["a"] = T.math_equal(r"\frac{1}{2}", "0.5")
        out["b"] = T.math_equal(r"2\sqrt{2}", r"\sqrt{8}")
        out["c"] = T.math_equal("2", "3")

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out == {"a": True, "b": True, "c": False}


def test_math_equal_power_towers_return_fast_in_any_thread():
    # sympy would hold the GIL for ever on 9^(9^(9^9)); no timeout can stop that, so it is screened out
    import time

    assert T.math_equal("2^{10}", "1024")
    out = {}

    def run():
        t0 = time.monotonic()
        out["v"] = (T.math_equal(r"9^{9^{9^{9}}}", "1"), T.math_equal("10^{10^{10}}", "10"), T.math_equal("2**3**4", "1"))
        out["t"] = time.monotonic() - t0

    run()
    assert out["v"] == (False, False, False) and out["t"] < 2
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert out["v"] == (False, False, False) and out["t"] < 2


def test_math_accuracy_reward_model_reads_metadata():
    r = load("math_accuracy")
    assert r.kind == "text"
    completions = [r"so \boxed{\frac{1}{2}}", "<answer>0.75</answer>", "The result is 42.", r"\boxed{\dfrac{3}{4}}"]
    metadata = [{"answer": "0.5"}, {"solution": r"We get \boxed{\frac34}"}, {"ground_truth": "41"}, {"answer": "0.75"}]
    out = r(completions=completions, metadata=metadata)
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert out.details["extracted"] == [r"\frac{1}{2}", "0.75", "42", r"\dfrac{3}{4}"]


def test_missing_ground_truth_key_error_names_keys():
    r = load("math_accuracy")
    with pytest.raises(ValueError, match=r"metadata\[1\] has no ground-truth key 'answer' or 'solution' or 'ground_truth'; got keys \['label'\]"):
        r(completions=["1", "2"], metadata=[{"answer": "1"}, {"label": "2"}])
    with pytest.raises(ValueError, match="needs ground truth"):
        r(completions=["1"])
    with pytest.raises(ValueError, match="'label'"):
        load("math_accuracy", answer_key="label")(completions=["1"], metadata=[{"answer": "1"}])
    assert load("math_accuracy", answer_key="label")(completions=["1"], metadata=[{"label": "1"}]).scores.item() == 1.0


def test_trl_style_callables_take_dataset_columns():
    assert T.math_accuracy([r"\boxed{2}", "3"], solution=["2", "2"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="no ground truth"):
        T.math_accuracy(["1"])
    with pytest.raises(ValueError, match="one entry per completion"):
        T.math_accuracy(["1", "2"], answer=["1"])


# ----------------------------------------------------------------------------- multiple choice / numbers / exact


@pytest.mark.parametrize("text,letter", [
    ("(B)", "B"), ("B", "B"), ("B.", "B"), ("B) because it is red", "B"), ("The answer is B", "B"),
    ("the answer is (c).", None), ("Answer: D", "D"), (r"\boxed{E}", "E"), (r"\boxed{\text{(A)}}", "A"),
    ("<answer>C</answer>", "C"), ("Option (A) is wrong, so (D)", "D"), ("Final choice:\nA. 30 degrees", "A"),
    ("A cat sat.", None), ("I don't know", None),
])
def test_extract_choice_variants(text, letter):
    assert T.extract_choice(text) == letter


def test_multiple_choice_reward():
    r = load("multiple_choice")
    out = r(completions=["The answer is (B).", "C", "I pick A", "B. since"],
            metadata=[{"answer": "B"}, {"answer": "(C)"}, {"answer": "A"}, {"answer": "b"}])
    # "I pick A" has no recognised pattern -> 0
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert out.details["extracted"] == ["B", "C", None, "B"]
    # letters beyond E when configured
    assert load("multiple_choice", letters="ABCDEFG")(completions=["(F)"], metadata=[{"answer": "F"}]).scores.item() == 1.0


def test_number_match_and_exact_match():
    r = load("number_match")
    out = r(completions=["total 1,024 items", r"\boxed{-0.50}", "about 3.1", "none"],
            metadata=[{"answer": "1024"}, {"answer": "-1/2"}, {"answer": "#### 3"}, {"answer": "1"}])
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert load("number_match", tol=0.05)(completions=["3.1"], metadata=[{"answer": 3}]).scores.item() == 1.0
    e = load("exact_match")
    out = e(completions=["<answer> New York. </answer>", "new york city", r"\boxed{\text{Blue}}"],
            metadata=[{"answer": "new york"}, {"answer": "New York"}, {"answer": "blue"}])
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert load("exact_match", lowercase=False)(completions=["blue"], metadata=[{"answer": "Blue"}]).scores.item() == 0.0


# ----------------------------------------------------------------------------- format


def test_format_default_positive_and_negative():
    r = load("format")
    texts = [
        "<think>reason</think>\n\\boxed{3}",            # boxed
        "<think>a\nb</think> <answer>3</answer>",       # tag
        "  <think>x</think><answer>3</answer>  ",       # surrounding whitespace is fine
        "\\boxed{3}",                                   # no think
        "<think>x</think>",                             # no answer
        "<think>x</think><answer>3</answer> trailing",  # text after the answer tag
        "<think>x<answer>3</answer>",                   # think never closed
    ]
    assert r(completions=texts).scores.tolist() == [1, 1, 1, 0, 0, 0, 0]


def test_format_geo3k_style_and_custom_regex():
    g = load("format", style="geo3k")
    # verl geo3k: fullmatch "<think>.*</think>.*\\boxed\{.*\}.*"; must START with <think>
    assert g(completions=["<think>a</think> so \\boxed{1} done", " <think>a</think>\\boxed{1}",
                          "<think>a</think><answer>1</answer>"]).scores.tolist() == [1, 0, 0]
    c = load("format", pattern=r"Answer: \d+")
    assert c(completions=["Answer: 12", "Answer: x"]).scores.tolist() == [1, 0]
    with pytest.raises(ValueError, match="style"):
        load("format", style="nope")


# ----------------------------------------------------------------------------- IoU


def test_box_iou_hand_computed():
    assert T.box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    # overlap 5x10 = 50; union 100 + 100 - 50 = 150
    assert T.box_iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(1 / 3)
    assert T.box_iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0
    assert T.box_iou([5, 5, 0, 0], [0, 0, 5, 5]) == 0.0  # inverted box


def test_iou_reward_parsing_and_threshold():
    completions = ["<answer>[0, 0, 10, 10]</answer>", "The box is 5, 0, 15, 10.", "[0,0,4,4] then [0, 0, 2, 5]",
                   "no box"]
    metadata = [{"answer": [0, 0, 10, 10]}, {"answer": "[0, 0, 10, 10]"}, {"answer": [0, 0, 2, 10]}, {"answer": [0, 0, 1, 1]}]
    out = load("iou")(completions=completions, metadata=metadata)
    # third: last list [0,0,2,5] vs [0,0,2,10]: inter 10, union 20 -> 0.5
    assert out.scores.tolist() == pytest.approx([1.0, 1 / 3, 0.5, 0.0])
    assert out.details["box"][1] == [5.0, 0.0, 15.0, 10.0] and out.details["box"][3] is None
    thr = load("iou", threshold=0.5)(completions=completions, metadata=metadata)
    assert thr.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert thr.details["iou"].tolist() == pytest.approx([1.0, 1 / 3, 0.5, 0.0])
    with pytest.raises(ValueError, match="not a box"):
        load("iou")(completions=["[0,0,1,1]"], metadata=[{"answer": "cat"}])


# ----------------------------------------------------------------------------- geo3k / accuracy_format


def test_geo3k_weights_and_details():
    r = load("geo3k")
    completions = [
        "<think>angles sum</think> The answer is \\boxed{30}",  # acc 1, fmt 1 -> 1.0
        "\\boxed{30}",                                          # acc 1, fmt 0 -> 0.9
        "<think>hm</think> \\boxed{45}",                        # acc 0, fmt 1 -> 0.1
        "<think>hm</think> it is 30",                           # no box: acc 0 (verl reads only \boxed), fmt 0
    ]
    out = r(completions=completions, metadata=[{"answer": "30"}] * 4)
    assert out.scores.tolist() == pytest.approx([1.0, 0.9, 0.1, 0.0])
    assert out.details["accuracy"].tolist() == [1, 1, 0, 0]
    assert out.details["format"].tolist() == [1, 0, 1, 0]
    w = load("geo3k", accuracy_weight=0.5, format_weight=0.5)(completions=completions, metadata=[{"answer": "30"}] * 4)
    assert w.scores.tolist() == pytest.approx([1.0, 0.5, 0.5, 0.0])


def test_accuracy_format_with_other_accuracy():
    r = load("accuracy_format", accuracy="multiple_choice", format_style="think_answer", accuracy_weight=1.0,
             format_weight=0.5)
    out = r(completions=["<think>x</think><answer>B</answer>", "(B)", "<think>x</think><answer>C</answer>"],
            metadata=[{"answer": "B"}] * 3)
    assert out.scores.tolist() == pytest.approx([1.5, 1.0, 0.5])
    assert out.details["accuracy/extracted"] == ["B", "B", "C"]
    with pytest.raises(ValueError, match="accuracy must be one of"):
        load("accuracy_format", accuracy="bogus")


def test_registered_names():
    for name in ["math_accuracy", "multiple_choice", "number_match", "exact_match", "format", "iou", "geo3k",
                 "accuracy_format"]:
        assert name in available()
        assert load(name).kind == "text"


def test_text_reward_requires_completions():
    with pytest.raises(ValueError, match="completions"):
        load("format")(images=torch.zeros(1, 3, 4, 4))
