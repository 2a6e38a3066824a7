"""`trainer.validation_data_dir` (verl): every scored validation response is written to `<dir>/<step>.jsonl`."""

import json
import textwrap

import numpy as np
import pytest

from configs import grpo

REWARD_SRC = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(len(solution_str) % 3 == 0), "acc": float(len(solution_str) % 2 == 0)}
    """
)


@pytest.mark.slow
def test_validation_data_dir_writes_every_scored_response(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_SRC)
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.validation_data_dir = str(tmp_path / "gens")
    c.custom_reward_function.path = str(reward)
    c.rollout.val_kwargs.n = 2
    c.rollout.val_kwargs.do_sample = True
    c.rollout.val_kwargs.temperature = 1.0
    trainer = RLTrainer(c, console_write=lambda line: None)
    try:
        metrics = trainer.validate()
    finally:
        trainer.close()
    path = tmp_path / "gens" / "0.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert not (tmp_path / "gens" / "0.jsonl.tmp").exists()
    n_prompts = int(c.data.reasoning_gym.val_size)
    assert len(rows) == 2 * n_prompts == metrics["val-aux/reasoning_gym/basic_arithmetic/num_samples"]
    for r in rows:  # the score and extras are the reward of the written text (recomputed here)
        assert r["score"] == float(len(r["output"]) % 3 == 0)
        assert r["acc"] == float(len(r["output"]) % 2 == 0)
        assert r["step"] == 0 and r["data_source"] == "reasoning_gym/basic_arithmetic"
        assert r["raw_prompt"][-1]["role"] == "user" and r["raw_prompt"][-1]["content"] in r["input"]
        assert r["gts"] is not None
    uids = [r["uid"] for r in rows]
    assert sorted(np.unique(uids, return_counts=True)[1]) == [2] * n_prompts  # n responses per prompt
    by_uid = {}
    for r in rows:
        by_uid.setdefault(r["uid"], set()).add(r["input"])
    assert all(len(v) == 1 for v in by_uid.values())  # one prompt per uid
    acc = np.mean([r["acc"] for r in rows])
    np.testing.assert_allclose(metrics["val-core/reasoning_gym/basic_arithmetic/acc/mean@2"], acc, rtol=1e-9)


@pytest.mark.slow
def test_rollout_data_dir_writes_every_scored_training_response(tmp_path):
    """`trainer.rollout_data_dir` (verl): each step's training responses, scored, in `<dir>/<step>.jsonl`."""
    from jaxrl_post.rl.trainer import RLTrainer

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_SRC)
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.rollout_data_dir = str(tmp_path / "rollouts")
    c.trainer.total_training_steps = 2
    c.trainer.val_at_end = False
    c.custom_reward_function.path = str(reward)
    trainer = RLTrainer(c, console_write=lambda line: None)
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows_per_step = int(c.data.train_batch_size) * int(c.rollout.n)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for step in (1, 2):
        rows = [json.loads(line) for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == rows_per_step
        for r in rows:  # the score is the reward of the written text (recomputed here)
            assert r["score"] == float(len(r["output"]) % 3 == 0) and r["step"] == step
            assert r["raw_prompt"][-1]["content"] in r["input"] and r["gts"] is not None
            assert 1 <= r["response_length"] <= int(c.data.max_response_length)
        assert sorted(np.unique([r["uid"] for r in rows], return_counts=True)[1]) == [int(c.rollout.n)] * (
            rows_per_step // int(c.rollout.n)
        )
        m = next(m for m in metrics if m.get("training/global_step", m.get("step")) == step)
        np.testing.assert_allclose(np.mean([r["score"] for r in rows]), m["critic/score/mean"], rtol=1e-6)
        np.testing.assert_allclose(np.mean([r["response_length"] for r in rows]), m["response_length/mean"], rtol=1e-6)
        assert "timing_s/dump_rollout_generations" in m
    assert not list((tmp_path / "rollouts").glob("*.tmp"))
