"""Tests for jaxrl_post.rewards: gsm8k / math / reasoning-gym scorers, dispatch, custom functions and
the RewardManager (worker pool with timeouts, error counting, score placement)."""

import pickle
import textwrap
import time

import numpy as np
import pytest

from jaxrl_post.rewards import (
    RewardFunctionError,
    RewardManager,
    default_compute_score,
    gsm8k,
    load_custom_reward_fn,
    math_reward,
    reasoning_gym_reward,
)


# ------------------------------------------------------------------------------------------ gsm8k
@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("3 + 4 = 7 eggs.\n#### 18", "18", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("She pays #### $18.00", "18", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### $-5", "-5", 1.0),
        ("The final answer is #### 42.", "42", 1.0),
        ("#### 17 wait, no.\n#### 18", "18", 1.0),  # the last "####" counts
        ("#### 18.5", "18", 0.0),
        ("#### 19", "18", 0.0),
        ("The answer is 18", "18", 0.0),  # strict needs "####"
        ("#### eighteen", "18", 0.0),
        ("#### 0.5", ".5", 1.0),
        ("#### 1,234,567", "1234567", 1.0),
    ],
)
def test_gsm8k_strict(response, gt, expected):
    assert gsm8k.compute_score(response, gt) == expected


def test_gsm8k_no_tail_clipping():
    # verl clips to the last 300 characters; we search the whole response.
    response = "#### 18\n" + "and then some rambling text. " * 40
    assert len(response) > 1000
    assert gsm8k.compute_score(response, "18") == 1.0


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("5 + 3 = 8. So the answer is 8.", "8", 1.0),
        ("It costs $1,234.50 in total.", "1234.5", 1.0),
        ("The temperature is -3 degrees", "-3", 1.0),
        ("Answer: 7, not 8", "7", 0.0),  # last number is 8
        ("no numbers here", "7", 0.0),
        ("#### 12", "12", 1.0),
        ("5-3=2", "2", 1.0),
    ],
)
def test_gsm8k_flexible(response, gt, expected):
    assert gsm8k.compute_score(response, gt, method="flexible") == expected


def test_gsm8k_format_score_and_score():
    assert gsm8k.compute_score("#### 3", "4", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "4", format_score=0.1) == 0.0  # no answer -> 0, not format score
    assert gsm8k.compute_score("#### 4", "4", score=2.0) == 2.0
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 4", "4", method="loose")


def test_gsm8k_parse_number():
    from fractions import Fraction

    assert gsm8k.parse_number("1,000") == 1000
    assert gsm8k.parse_number("-$18.00") == -18
    assert gsm8k.parse_number("42.") == 42
    assert gsm8k.parse_number("2.25") == Fraction(9, 4)
    assert gsm8k.parse_number("abc") is None
    assert gsm8k.parse_number("1 2") is None


# ------------------------------------------------------------------------------------------ math
@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("Thus \\boxed{0.5}", "\\frac12", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
        ("\\boxed{(1,2)}", "(1, 2)", 1.0),
        ("\\boxed{2}", "3", 0.0),
        ("first \\boxed{3} then corrected \\boxed{2}", "2", 1.0),  # last boxed counts
        ("The answer is 2", "2", 0.0),  # no boxed answer
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\fbox{7}", "\\boxed{7}", 1.0),  # boxed ground truth accepted
        ("\\boxed{\\frac{1}{2}", "\\frac12", 0.0),  # unbalanced braces -> no answer
    ],
)
def test_math_reward(response, gt, expected):
    assert math_reward.compute_score(response, gt) == expected


def test_last_boxed_only_string():
    assert math_reward.last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\boxed{\\frac{2}{3}}"
    assert math_reward.last_boxed_only_string("none") is None
    assert math_reward.remove_boxed("\\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"


# ------------------------------------------------------------------------------------------ reasoning gym
def _rg_rows(task, config, n=4, seed=7, prompt_format="answer_tag"):
    from jaxrl_post.data.sources import reasoning_gym_rows

    return reasoning_gym_rows(task, size=n, seed=seed, config=config, prompt_format=prompt_format)


@pytest.mark.parametrize(
    "task, config",
    [
        ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
        ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 2}),
        ("leg_counting", {"max_animals": 3}),
        ("word_sorting", {}),
        ("spell_backward", {}),
    ],
)
def test_reasoning_gym_task_scorer(task, config):
    import reasoning_gym

    for row in _rg_rows(task, config):
        info = row["extra_info"]
        gt = row["reward_model"]["ground_truth"]
        ds = row["data_source"]
        assert ds == f"reasoning_gym/{task}"
        right = f"Let me think.\n<answer>{gt}</answer>"
        assert default_compute_score(ds, right, gt, info) == 1.0
        # the task's own scorer decides, e.g. partial credit or none for a wrong answer
        wrong = "<answer>definitely not it</answer>"
        own = reasoning_gym.create_dataset(task, **info["config"]).score_answer("definitely not it", info["entry"])
        assert default_compute_score(ds, wrong, gt, info) == pytest.approx(own)
        assert default_compute_score(ds, wrong, gt, info) < 1.0
        assert default_compute_score(ds, gt, gt, info) == 0.0  # no <answer> tag -> no answer


def test_reasoning_gym_regenerates_entry_from_seed_and_index():
    row = _rg_rows("chain_sum", {"min_terms": 2, "max_terms": 2})[2]
    gt = row["reward_model"]["ground_truth"]
    info = {k: v for k, v in row["extra_info"].items() if k != "entry"}
    assert reasoning_gym_reward.compute_score(f"<answer>{gt}</answer>", gt, info, row["data_source"]) == 1.0
    wrong = str(int(gt) + 1)
    assert reasoning_gym_reward.compute_score(f"<answer>{wrong}</answer>", gt, info, row["data_source"]) < 1.0


def test_reasoning_gym_task_from_data_source_only():
    # no extra_info: the task's default scorer with the ground truth as the entry's answer
    assert default_compute_score("reasoning_gym/chain_sum", "<answer>12</answer>", "12", None) == 1.0
    assert default_compute_score("reasoning_gym/chain_sum", "<answer>13</answer>", "12", None) == 0.0
    with pytest.raises(ValueError, match="task"):
        reasoning_gym_reward.compute_score("<answer>1</answer>", "1", {}, "reasoning_gym")


def test_reasoning_gym_answer_formats():
    ex = reasoning_gym_reward.extract_model_answer
    assert ex("a <answer> 5 </answer> b <answer>6</answer>", "answer_tag") == "6"
    assert ex("no tag", "answer_tag") is None
    assert ex("The sum is:\n\n 42.\n", "last_line") == "42"
    assert ex("x\n<answer>3</answer>", "tag_or_last_line") == "3"
    assert ex("x\n4", "tag_or_last_line") == "4"
    assert ex("43 - 76 = -33.", "last_number") == "-33"
    assert ex("The total is 1,234 apples, not 12", "last_number") == "12"
    assert ex("The total is 1,234.", "last_number") == "1234"
    assert ex("no digits", "last_number") is None
    with pytest.raises(ValueError, match="answer_format"):
        ex("x", "bogus")
    row = _rg_rows("chain_sum", {"min_terms": 2, "max_terms": 2}, prompt_format="last_line")[0]
    gt = row["reward_model"]["ground_truth"]
    assert row["extra_info"]["answer_format"] == "last_line"
    assert default_compute_score(row["data_source"], f"Adding up.\n{gt}", gt, row["extra_info"]) == 1.0
    row = _rg_rows("chain_sum", {"min_terms": 2, "max_terms": 2}, prompt_format="plain")[1]
    gt = row["reward_model"]["ground_truth"]
    assert row["extra_info"]["answer_format"] == "last_number"
    assert row["prompt"][-1]["content"] == row["extra_info"]["entry"]["question"]  # no instruction added
    info = row["extra_info"]
    assert default_compute_score(row["data_source"], f"The answer is {gt}.", gt, info) == 1.0
    assert default_compute_score(row["data_source"], f"The answer is {int(gt) + 1}.", gt, info) == 0.0


# ------------------------------------------------------------------------------------------ dispatch
def test_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("gsm8k", "#### 5", "6") == 0.0
    assert default_compute_score("lighteval/MATH", "\\boxed{5}", "5") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    with pytest.raises(NotImplementedError) as e:
        default_compute_score("my/unknown_source", "x", "y")
    msg = str(e.value)
    assert "my/unknown_source" in msg and "openai/gsm8k" in msg and "lighteval/MATH" in msg
    assert "reasoning_gym/<task>" in msg


# ------------------------------------------------------------------------------------------ custom fn
CUSTOM_SRC = textwrap.dedent(
    """
    import os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        if "RAISE" in solution_str:
            raise RuntimeError("boom")
        if "HANG" in solution_str:
            time.sleep(1000)
        if "CRASH" in solution_str:
            os._exit(3)
        if "BADTYPE" in solution_str:
            return "not a number"
        ok = float(solution_str.strip() == ground_truth)
        return {"score": ok + bonus, "acc": ok, "length": len(solution_str)}

    def helper():
        pass

    NOT_CALLABLE = 3
    """
)


@pytest.fixture()
def custom_file(tmp_path):
    p = tmp_path / "my_reward.py"
    p.write_text(CUSTOM_SRC)
    return str(p)


def test_load_custom_reward_fn(custom_file, tmp_path):
    assert load_custom_reward_fn(None) is None
    fn = load_custom_reward_fn(custom_file, "compute_score")
    assert fn("x", "7", "7", None) == {"score": 1.0, "acc": 1.0, "length": 1}
    fn2 = load_custom_reward_fn(custom_file, "compute_score", reward_kwargs={"bonus": 0.5})
    assert fn2("x", "7", "8", None)["score"] == 0.5
    clone = pickle.loads(pickle.dumps(fn2))  # re-imports the file by path
    assert clone("x", "7", "7", None)["score"] == 1.5

    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_custom_reward_fn(str(tmp_path / "nope.py"))
    with pytest.raises(AttributeError) as e:
        load_custom_reward_fn(custom_file, "missing_fn")
    assert "missing_fn" in str(e.value) and "compute_score" in str(e.value) and "helper" in str(e.value)
    with pytest.raises(TypeError, match="NOT_CALLABLE"):
        load_custom_reward_fn(custom_file, "NOT_CALLABLE")
    bad = tmp_path / "broken.py"
    bad.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match="broken.py"):
        load_custom_reward_fn(str(bad))


# ------------------------------------------------------------------------------------------ manager
class CharTokenizer:
    """Token id = ord(char); id 0 is a special (pad) token dropped with skip_special_tokens."""

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(t) for t in s if not (skip_special_tokens and t == 0)) for s in seqs]


def _batch(texts, R, ground_truths, data_source="custom", garbage="Z"):
    """DataProto with the texts as responses; masked positions hold `garbage` (must not be decoded)."""
    from jaxrl_post.batch.protocol import DataProto

    B = len(texts)
    resp = np.full((B, R), ord(garbage), np.int32)
    mask = np.zeros((B, R), np.int32)
    for i, t in enumerate(texts):
        resp[i, : len(t)] = [ord(c) for c in t]
        mask[i, : len(t)] = 1
    return DataProto.from_dict(
        tensors={"responses": resp, "response_mask": mask},
        non_tensors={
            "data_source": np.array([data_source] * B, dtype=object),
            "ground_truth": np.array(ground_truths, dtype=object),
            "extra_info": np.array([{}] * B, dtype=object),
        },
    )


def test_manager_in_process_placement_and_extras(custom_file):
    fn = load_custom_reward_fn(custom_file)
    texts = ["7", "12", "", "99", "RAISE", "BADTYPE"]
    gts = ["7", "12", "1", "98", "1", "1"]
    data = _batch(texts, R=8, ground_truths=gts)
    mgr = RewardManager(fn, CharTokenizer(), num_workers=0)
    out = mgr.compute(data)
    expected = np.array([1, 1, 0, 0, 0, 0], np.float32)
    np.testing.assert_array_equal(out.scores, expected)
    assert out.token_level_scores.shape == (6, 8) and out.token_level_scores.dtype == np.float32
    want = np.zeros((6, 8), np.float32)
    want[0, 0] = 1.0  # "7": last valid token at 0
    want[1, 1] = 1.0  # "12": last valid token at 1
    np.testing.assert_array_equal(out.token_level_scores, want)
    assert out.metrics["reward/num_errors"] == 2.0  # RAISE and BADTYPE
    assert out.metrics["reward/num_timeouts"] == 0.0
    np.testing.assert_array_equal(out.extra_infos["acc"], [1, 1, 0, 0, np.nan, np.nan])
    np.testing.assert_array_equal(out.extra_infos["length"], [1, 2, 0, 2, np.nan, np.nan])
    assert out.metrics["reward/extra/acc/mean"] == pytest.approx(0.5)
    assert any("boom" in e for e in out.errors)
    scores, metrics = mgr(data)
    np.testing.assert_array_equal(scores, want)
    assert metrics["reward/num_errors"] == 2.0


def test_manager_score_on_last_valid_token_default_fn():
    # GSM8K rows through default_compute_score; varying lengths; garbage after the valid tokens
    texts = ["#### 5", "so #### 12", "#### 3"]
    data = _batch(texts, R=12, ground_truths=["5", "12", "4"], data_source="openai/gsm8k", garbage="9")
    mgr = RewardManager(None, CharTokenizer(), num_workers=0)
    scores, metrics = mgr(data)
    want = np.zeros((3, 12), np.float32)
    want[0, len(texts[0]) - 1] = 1.0
    want[1, len(texts[1]) - 1] = 1.0
    np.testing.assert_array_equal(scores, want)  # garbage "9"s were not decoded ("#### 59..." would fail)
    assert metrics["reward/num_errors"] == 0


def test_manager_pool_raise_hang_crash(custom_file):
    fn = load_custom_reward_fn(custom_file)
    texts = ["7", "RAISE", "HANG", "8", "CRASH", "9", "HANG"]
    gts = ["7", "x", "x", "8", "x", "0", "x"]
    data = _batch(texts, R=6, ground_truths=gts)
    # 4 of 7 calls fail: allowed here (max_error_fraction=1.0), to see each kind counted
    with RewardManager(fn, CharTokenizer(), num_workers=2, timeout_s=1.0, max_error_fraction=1.0) as mgr:
        t0 = time.monotonic()
        out = mgr.compute(data)
        first = time.monotonic() - t0
        np.testing.assert_array_equal(out.scores, [1, 0, 0, 1, 0, 0, 0])
        assert out.metrics["reward/num_timeouts"] == 2.0
        assert out.metrics["reward/num_errors"] == 4.0  # RuntimeError + worker died + 2 timeouts
        assert any("exit code 3" in e for e in out.errors)
        assert out.token_level_scores[3, 0] == 1.0
        # the pool recovered: a second batch is scored normally
        out2 = mgr.compute(_batch(["5", "6"], R=3, ground_truths=["5", "5"]))
        np.testing.assert_array_equal(out2.scores, [1, 0])
        assert out2.metrics["reward/num_errors"] == 0 and out2.metrics["reward/num_timeouts"] == 0
        # over the default limit (half the batch): the first failure, with the worker's traceback
        mgr.max_error_fraction = 0.5
        with pytest.raises(RewardFunctionError) as e:
            mgr.compute(_batch(["5", "RAISE", "RAISE"], R=5, ground_truths=["5", "x", "x"], data_source="my/src"))
        msg = str(e.value)
        assert "failed on 2 of 3 responses (67%" in msg and "max_error_fraction=0.5" in msg
        assert "row 1 (data_source='my/src')" in msg and "in worker processes: RuntimeError: boom" in msg
        assert "my_reward.py" in msg and "Traceback of that call (reward worker)" in msg
        assert 'raise RuntimeError("boom")' in msg  # the worker's traceback, source line included
    assert first < 60, f"batch with hung calls took {first:.1f}s"


def test_manager_rejects_unpicklable_fn_with_workers():
    with pytest.raises(TypeError, match="picklable"):
        RewardManager(lambda *a: 1.0, CharTokenizer(), num_workers=1)
    # in process, a lambda is fine
    mgr = RewardManager(lambda *a: 0.25, CharTokenizer(), num_workers=0)
    scores, _ = mgr(_batch(["ab"], R=3, ground_truths=["x"]))
    assert scores[0, 1] == 0.25
