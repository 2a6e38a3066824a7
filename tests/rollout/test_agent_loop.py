"""Agent loop: a scripted "model" (fixed token ids per turn) through real tools and environments; the response
layout (model tokens, observation tokens, loss_mask holes, log-probs) checked against hand-written text."""

import re

import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits, rollout_metrics
from jaxrl_post.rollout.chat_suffix import TemplateNotAppendOnlyError
from jaxrl_post.rollout.environments import Environment, GuessNumberEnv, ToolEnv, guess_number_score
from jaxrl_post.rollout.sampling import SamplingParams
from jaxrl_post.rollout.tool_parser import get_tool_parser
from jaxrl_post.rollout.tools import ToolExecutor, resolve_tools

EOT = "<|im_end|>"
TOK = build_char_tokenizer()


def enc(text):
    return [int(i) for i in TOK(text, add_special_tokens=False)["input_ids"]]


class ScriptedGenerator:
    """Stands in for `Generator`: row `id=K` (read from its prompt) answers the next text of `scripts[K]`;
    log-prob of token t at step s is -(t + s / 100). Records every context it was given."""

    def __init__(self, scripts):
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.contexts = {k: [] for k in scripts}

    def generate(self, batch, params, seed=None):
        ids = np.asarray(batch.batch["input_ids"])
        mask = np.asarray(batch.batch["attention_mask"]).astype(bool)
        m = params.max_new_tokens
        resp = np.full((len(ids), m), params.pad_token_id, np.int32)
        exists = np.zeros((len(ids), m), np.int32)
        lp = np.zeros((len(ids), m), np.float32)
        for j in range(len(ids)):
            ctx = ids[j][mask[j]].tolist()
            k = int(re.search(r"id=(\d+)", TOK.decode(ctx)).group(1))
            self.contexts[k].append(ctx)
            toks = enc(self.scripts[k].pop(0))[:m]
            resp[j, : len(toks)], exists[j, : len(toks)] = toks, 1
            lp[j, : len(toks)] = [-(t + s / 100) for s, t in enumerate(toks)]
        return DataProto({"responses": resp, "response_attention_mask": exists, "rollout_log_probs": lp})


def _prompts(n_rows, p=1200, **extra):
    nt = {"raw_prompt": [[{"role": "user", "content": f"id={i} what is 6*7?"}] for i in range(n_rows)]}
    nt["extra_info"] = [{"index": i} for i in range(n_rows)]
    nt.update(extra)
    return DataProto({"input_ids": np.zeros((n_rows, p), np.int32)}, nt)


def _params(r):
    return SamplingParams(max_new_tokens=r, eos_token_ids=(TOK.convert_tokens_to_ids(EOT),), pad_token_id=2)


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def executor():
    with ToolExecutor(resolve_tools("calculator"), num_workers=1, timeout_s=10.0) as ex:
        yield ex


def _tool_loop(gen, executor, **limits):
    lim = MultiTurnLimits(**limits)
    factory = lambda row: ToolEnv(executor, get_tool_parser("hermes"), lim.max_parallel_calls, 40, "left")
    return AgentLoop(gen, TOK, factory, lim, tools=[t.schema for t in executor.tools.values()])


def test_tool_calls_layout_by_hand(executor):
    scripts = {
        0: [f"Let me compute. {CALL}{EOT}", f"The answer is 42.{EOT}"],
        1: [f"<tool_call>{{oops</tool_call>{EOT}", f"42{EOT}"],
        2: [f'<tool_call>{{"name": "calc", "arguments": {{}}}}</tool_call>{EOT}', f"42{EOT}"],
        3: [f"42{EOT}"],
        4: [f"{CALL}{CALL}{EOT}", f"42 and 42{EOT}"],
    }
    gen = ScriptedGenerator(scripts)
    loop = _tool_loop(gen, executor, max_parallel_calls=1)
    assert loop.inject_tools  # the char template ignores tools=: the Hermes tool prompt goes to a system message
    r = 300
    out = loop.generate(_prompts(5), _params(r), seed=0)
    b = out.batch
    obs = lambda *texts: "".join(f"\n<|im_start|>tool\n{t}{EOT}" for t in texts) + "\n<|im_start|>assistant\n"
    malformed = "Error: malformed tool call: tool call is not valid JSON: Expecting property name enclosed in"
    unknown = "Error: unknown tool 'calc'; available: ['calculator']"
    want = {  # (text, trained) pieces in order
        0: [(scripts[0][0], 1), (obs("42"), 0), (scripts[0][1], 1)],
        1: [(scripts[1][0], 1), (obs(malformed[:40] + "...(truncated)"), 0), (scripts[1][1], 1)],
        2: [(scripts[2][0], 1), (obs(unknown[:40] + "...(truncated)"), 0), (scripts[2][1], 1)],
        3: [(scripts[3][0], 1)],
        4: [(scripts[4][0], 1), (obs("42"), 0), (scripts[4][1], 1)],  # max_parallel_calls=1: second call dropped
    }
    for i, pieces in want.items():
        ids = [t for text, _ in pieces for t in enc(text)]
        loss = [m for text, m in pieces for _ in enc(text)]
        k = len(ids)
        assert b["responses"][i, :k].tolist() == ids, TOK.decode(b["responses"][i])
        assert b["loss_mask"][i, :k].tolist() == loss
        assert b["response_attention_mask"][i].tolist() == [1] * k + [0] * (r - k)
        assert b["loss_mask"][i, k:].sum() == 0 and (b["responses"][i, k:] == 2).all()
        # log-probs: the scripted values on model tokens (step index restarts each turn), 0 on observations
        want_lp, pos = np.zeros(r, np.float32), 0
        for text, m in pieces:
            toks = enc(text)
            if m:
                want_lp[pos : pos + len(toks)] = [-(t + s / 100) for s, t in enumerate(toks)]
            pos += len(toks)
        np.testing.assert_array_equal(b["rollout_log_probs"][i], want_lp)
        # the context of each later turn is exactly prompt + the response so far (model tokens as sampled)
        prompt = b["prompts"][i][b["attention_mask"][i, : b["prompts"].shape[1]] == 1].tolist()
        for turn, ctx in enumerate(gen.contexts[i]):
            before = sum(len(enc(t)) for t, _ in pieces[: 2 * turn])
            assert ctx == prompt + ids[:before]
    assert not b["truncated"].any()
    # the prompt: the injected tool prompt, then the user message, rendered by the template
    text0 = TOK.decode(b["prompts"][0][b["attention_mask"][0, :1200] == 1])
    assert text0.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text0
    assert text0.endswith("<|im_start|>user\nid=0 what is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    # positions continue through the response; attention covers observation tokens
    pos = b["position_ids"]
    np.testing.assert_array_equal(np.diff(pos[:, 1200:], axis=1), 1)
    nt = out.non_tensor_batch
    assert nt["num_turns"].tolist() == [3, 3, 3, 1, 3]
    assert nt["tool_calls"].tolist() == [1, 1, 1, 0, 1]
    assert nt["tool_errors"].tolist() == [0, 1, 1, 0, 0]
    assert nt["extra_info"][0] == {
        "index": 0,
        "turn_scores": [],
        "tool_rewards": [0.0],
        "num_turns": 3,
        "tool_calls": 1,
    }
    m = rollout_metrics(out, loop.last_stats)
    n_obs = ((b["response_attention_mask"] == 1) & (b["loss_mask"] == 0)).sum()
    assert m["num_turns/mean"] == pytest.approx(13 / 5) and (m["num_turns/min"], m["num_turns/max"]) == (1, 3)
    assert m["tool_calls/mean"] == pytest.approx(4 / 5)
    assert (m["tool/errors"], m["tool/format_errors"], m["tool/timeouts"]) == (2, 2, 0)
    assert m["response/observation_fraction"] == pytest.approx(n_obs / b["response_attention_mask"].sum())
    assert loop.last_stats["tool_calls"] == 4


def test_budget_and_turn_limits(executor):
    r = 120
    scripts = {
        0: ["x" * 200],  # no EOS within the budget: truncated after r model tokens
        1: [f"{CALL}{EOT}"] * 5,  # keeps calling: the observation that no longer fits is cut, truncated
        2: [f"{CALL}{EOT}"] * 5,
    }
    gen = ScriptedGenerator(scripts)
    out = _tool_loop(gen, executor).generate(_prompts(3), _params(r))
    b = out.batch
    assert b["response_attention_mask"][0].sum() == r and b["loss_mask"][0].sum() == r and b["truncated"][0]
    turn = len(enc(scripts[1][0]))
    o = len(enc(f"\n<|im_start|>tool\n42{EOT}\n<|im_start|>assistant\n"))
    full = r // (turn + o)  # whole turns + observations that fit
    assert b["response_attention_mask"][1].sum() == r and b["truncated"][1]
    assert b["loss_mask"][1].sum() == full * turn + min(turn, r - full * (turn + o))
    # max_assistant_turns=2: two model turns and the observation between them
    gen = ScriptedGenerator(scripts)
    out = _tool_loop(gen, executor, max_assistant_turns=2).generate(_prompts(3), _params(3 * r))
    assert out.batch["response_attention_mask"][2].sum() == 2 * turn + o and not out.batch["truncated"][2]
    assert out.non_tensor_batch["num_turns"][2] == 3
    # max_user_turns=1: one observation, then the trajectory ends after the next model turn
    gen = ScriptedGenerator(scripts)
    out = _tool_loop(gen, executor, max_user_turns=1).generate(_prompts(3), _params(3 * r))
    assert out.batch["response_attention_mask"][2].sum() == 2 * turn + o


def test_guess_number_env_feedback_and_turn_scores():
    eot = EOT
    scripts = {0: [f"<guess>50</guess>{eot}", f"<guess>25</guess>{eot}", f"hmm{eot}", f"<guess>37</guess>{eot}"]}
    gen = ScriptedGenerator(scripts)
    loop = AgentLoop(gen, TOK, lambda row: GuessNumberEnv(1, 100), MultiTurnLimits())
    prompts = _prompts(1, p=300)
    prompts.non_tensor_batch["extra_info"][0] = {"secret": 37}
    prompts.non_tensor_batch.pop("raw_prompt")
    # GuessNumberEnv writes its own first message; the id marker goes into a system message via a wrapper
    loop.env_factory = lambda row: _Marked(GuessNumberEnv(1, 100))
    out = loop.generate(prompts, _params(200))
    text = TOK.decode(out.batch["responses"][0][out.batch["response_attention_mask"][0] == 1])
    assert text == (
        f"<guess>50</guess>{eot}\n<|im_start|>user\n50 is too high.{eot}\n<|im_start|>assistant\n"
        f"<guess>25</guess>{eot}\n<|im_start|>user\n25 is too low.{eot}\n<|im_start|>assistant\n"
        f"hmm{eot}\n<|im_start|>user\nAnswer with <guess>N</guess>.{eot}\n<|im_start|>assistant\n"
        f"<guess>37</guess>{eot}"
    )
    info = out.non_tensor_batch["extra_info"][0]
    assert info["turn_scores"] == [0.0, 0.0, 0.0, 1.0] and info["num_turns"] == 7
    assert guess_number_score("guess", text, None, info) == 1.0


class _Marked(Environment):
    def __init__(self, env):
        self.env = env

    def reset(self, row):
        return [{"role": "system", "content": "id=0"}, *self.env.reset(row)]

    def step(self, action):
        return self.env.step(action)


def _trimming_tokenizer():
    """The char tokenizer with a template that shortens earlier assistant turns (not append-only)."""
    import copy

    t = copy.deepcopy(build_char_tokenizer())
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:3] }}{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return t


def test_refuses_a_template_that_is_not_append_only():
    tok = _trimming_tokenizer()
    gen = ScriptedGenerator({0: [f"<guess>50</guess>{EOT}", f"x{EOT}"]})
    loop = AgentLoop(gen, tok, lambda row: _Marked(GuessNumberEnv()), MultiTurnLimits())
    prompts = _prompts(1, p=300)
    prompts.non_tensor_batch["extra_info"][0] = {"secret": 3}
    with pytest.raises(TemplateNotAppendOnlyError, match="changes the rendering of the assistant turn"):
        loop.generate(prompts, _params(100))


def test_prompt_too_long_is_refused(executor):
    loop = _tool_loop(ScriptedGenerator({0: []}), executor)
    with pytest.raises(ValueError, match=r"row 0: the prompt \(env.reset.* has .* > data.max_prompt_length=64"):
        loop.generate(_prompts(1, p=64), _params(10))
    from jaxrl_post.errors import ConfigError

    with pytest.raises(ConfigError):  # main prints a ConfigError as one `error:` line, not a traceback
        loop.generate(_prompts(1, p=64), _params(10))


def test_multi_turn_config_errors_name_the_keys():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from configs import grpo, grpo_tools
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.config_check import validate_config

    for variant in (None, "guess"):
        validate_config(grpo_tools.get_config(variant), n_devices=1)
    c = grpo.get_config("tiny")
    c.rollout.multi_turn.enable = True
    validate_config(c, n_devices=1)
    c.rollout.multi_turn.max_assistant_turns = 0
    c.rollout.multi_turn.tool_response_truncate_side = "top"
    c.rollout.multi_turn.format = "xml"
    c.rollout.multi_turn.env = "chess"
    c.rollout.multi_turn.max_error_fraction = 2.0
    c.rollout.sampling_mask_replay = True
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    msg = str(e.value)
    for key in (
        "rollout.multi_turn.max_assistant_turns=0",
        "rollout.multi_turn.tool_response_truncate_side='top'",
        "rollout.multi_turn.format='xml'",
        "rollout.multi_turn.env='chess'",
        "rollout.multi_turn.max_error_fraction=2.0",
        "rollout.sampling_mask_replay=True",
    ):
        assert key in msg, key


def test_failing_tool_past_the_error_budget_raises():
    """A tool that raises on every call: error observations, counted; past max_error_fraction the batch raises."""
    import os

    from jaxrl_post.rollout.tools import ToolError, ToolErrorBudget

    fixtures = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tool_fixtures.py")
    tools = resolve_tools(f"calculator,{fixtures}:raiser")
    call = '<tool_call>{"name": "raiser", "arguments": {"text": "a"}}</tool_call>' + EOT
    scripts = {0: [call, f"ok{EOT}"], 1: [f"{CALL}{EOT}", f"ok{EOT}"]}
    with ToolExecutor(tools, num_workers=1, timeout_s=10.0) as ex:
        lim = MultiTurnLimits()
        factory = lambda row: ToolEnv(ex, get_tool_parser("hermes"), 1, 200, "left")
        schemas = [t.schema for t in tools]
        lenient = AgentLoop(
            ScriptedGenerator(scripts), TOK, factory, lim, tools=schemas, error_budget=ToolErrorBudget(0.5)
        )
        out = lenient.generate(_prompts(2, p=1600), _params(400))  # 1 of 2 calls failed: not more than half
        text = TOK.decode(out.batch["responses"][0][out.batch["loss_mask"][0] == 0])
        assert "Error: RuntimeError: tool failed on a" in text
        assert lenient.last_stats["tool_errors"] == 1 and out.non_tensor_batch["tool_errors"].tolist() == [1, 0]
        scripts = {0: [call, f"ok{EOT}"], 1: [call, f"ok{EOT}"]}
        strict = AgentLoop(
            ScriptedGenerator(scripts), TOK, factory, lim, tools=schemas, error_budget=ToolErrorBudget(0.5)
        )
        with pytest.raises(ToolError, match="2 of 2 tool calls failed.*First failure: tool 'raiser': Error: Runtime"):
            strict.generate(_prompts(2, p=1600), _params(400))


def test_other_stop_token_ends_the_trajectory():
    """<|endoftext|> stops generation but is not the template's end of turn: the trajectory ends there (no
    observation, not truncated); stop tokens without the template's end of turn are refused."""
    eot, eos_text = TOK.convert_tokens_to_ids(EOT), TOK.convert_tokens_to_ids("<|endoftext|>")
    gen = ScriptedGenerator({0: ["<guess>5</guess><|endoftext|>"]})
    loop = AgentLoop(gen, TOK, lambda row: _Marked(GuessNumberEnv()), MultiTurnLimits())
    assert loop.turn_end_ids((eot, eos_text)) == {eot}
    prompts = _prompts(1, p=300)
    prompts.non_tensor_batch["extra_info"][0] = {"secret": 3}
    params = SamplingParams(max_new_tokens=50, eos_token_ids=(eot, eos_text), pad_token_id=eot)
    out = loop.generate(prompts, params)
    k = len(enc("<guess>5</guess><|endoftext|>"))
    assert out.batch["response_attention_mask"][0].sum() == k and out.batch["loss_mask"][0].sum() == k
    assert not out.batch["truncated"][0] and out.non_tensor_batch["num_turns"][0] == 1
    with pytest.raises(ValueError, match="none of the stop tokens"):
        loop.turn_end_ids((eos_text,))
