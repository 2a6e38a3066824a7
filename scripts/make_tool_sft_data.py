"""SFT warm-start data for the tool-use GRPO run: whole calculator trajectories of `configs/grpo_tools.py`'s task.

    python scripts/make_tool_sft_data.py --out-dir runs/tool_sft
    python -m jaxrl_post.main --config=configs/sft.py:tools
    python -m jaxrl_post.main --config=configs/grpo_tools.py --config.model.path=runs/sft_tools

Each row of `<out-dir>/train.jsonl` / `val.jsonl` is TRL's conversational format (`{"messages": [...]}`, read by
`jaxrl_post/data/sft.py`; loss on the assistant turns) holding one trajectory as the agent loop would hold it:

1. system: the config's `data.system_prompt` plus the tool-call parser's tool prompt, from
   `AgentLoop.initial_messages` of the agent loop `builders.build_agent_loop` makes for the config (SmolLM2's
   template ignores `tools=`, so the tool list goes into the system message);
2. user: the RL prompt of `builders.load_split_rows` (reasoning-gym rows, the config's task options and prompt
   format) drawn with `--seed` instead of the config's seeds; prompts of the config's validation set
   (`builders.load_data_rows`) and repeated prompts are dropped;
3. assistant: a Hermes call `<tool_call>\\n{"name": "calculator", "arguments": {"expression": ...}}\\n</tool_call>`
   with the item's expression (reasoning-gym's `metadata.expression`);
4. tool: the observation the config's `ToolEnv` answers that turn with (the call parsed by the config's parser,
   run by the `calculator` tool in the tool worker, capped as in the rollout);
5. assistant: `<answer>N</answer>`, N the ground truth, which must equal the tool's output.

The SFT tokenization of such a row equals the ids the agent loop holds for the same trajectory, with the loss on
the two assistant turns' tokens through `<|im_end|>` (`tests/scripts/test_make_tool_sft_data.py`).

The draw's item indices (`--seed` .. `--seed` + drawn - 1) must not overlap the config's training or validation
items (`reasoning_gym_rows`: item i comes from `Random(seed + i)`). Prints a table and a JSON line of counts and
token lengths (SmolLM2 tokens of the whole trajectory, of its prompt and of its response).

Raises SystemExit: an overlapping `--seed`, a template that reads `tools=` (the SFT data path renders none), a tool
output that differs from the ground truth, a trajectory longer than the config's prompt / response budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

DEFAULT_CONFIG = os.path.join(_REPO, "configs", "grpo_tools.py")
DEFAULT_SEED = 1_000_000  # far from configs/grpo_tools.py's items (train seed 42, 2000 items; val from 2042)


def user_text(prompt: list[dict]) -> str:
    """The last user message's content of a row's prompt."""
    return [m["content"] for m in prompt if m["role"] == "user"][-1]


def rl_val_prompts(cfg) -> set[str]:
    """User texts of the config's validation prompts, as the RL trainer loads them (`builders.load_data_rows`:
    held out from training, topped up to `val_size`)."""
    from jaxrl_post.rl.data_rows import load_data_rows

    data = load_data_rows(cfg)
    return set() if data.val is None else {user_text(r["prompt"]) for r in data.val.rows}


def item_ranges(cfg) -> dict[str, tuple[int, int]]:
    """Item index ranges `[lo, hi)` of the config's reasoning-gym training and validation rows (validation: up to
    16 x val_size, the most `load_data_rows` draws when topping up)."""
    from jaxrl_post.data.sources import disjoint_seed

    rg = cfg.data.reasoning_gym
    val_seed = rg.val_seed if rg.val_seed is not None else disjoint_seed(rg.seed, rg.size)
    return {
        "train": (int(rg.seed), int(rg.seed) + int(rg.size)),
        "val": (int(val_seed), int(val_seed) + 16 * int(rg.val_size)),
    }


def draw_rows(cfg, seed: int, size: int) -> list[dict]:
    """`size` RL prompt rows of the config's training spec drawn with `seed` (`builders.load_split_rows`)."""
    from jaxrl_post.rl.data_rows import load_split_rows

    c = cfg.copy_and_resolve_references()
    c.data.reasoning_gym.seed, c.data.reasoning_gym.size = int(seed), int(size)
    return list(load_split_rows(c, val=False).rows)


def select_prompts(cfg, seed: int, n: int, exclude: set[str]) -> tuple[list[dict], dict[str, int]]:
    """The first `n` rows drawn from `seed` whose user text is neither in `exclude` nor repeated, and counts
    (`drawn`, `dropped_rl_val`, `dropped_repeated`). Draws more (twice as many) until `n` are kept."""
    size = n + 16
    while True:
        rows = draw_rows(cfg, seed, size)
        kept, seen, stats = [], set(), dict(drawn=len(rows), dropped_rl_val=0, dropped_repeated=0)
        for r in rows:
            text = user_text(r["prompt"])
            if text in exclude:
                stats["dropped_rl_val"] += 1
            elif text in seen:
                stats["dropped_repeated"] += 1
            else:
                seen.add(text)
                kept.append(r)
                if len(kept) == n:
                    stats["drawn"] = int(r["extra_info"]["index"]) + 1
                    return kept, stats
        if size > 64 * (n + 16):
            raise SystemExit(f"only {len(kept)} distinct held-out prompts in {size} items; the task is too small")
        size *= 2


def tool_call_text(name: str, arguments: dict) -> str:
    """A Hermes tool call as the tool prompt shows it: `<tool_call>\\n{json}\\n</tool_call>`."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def build_trajectories(loop, rows: list[dict]) -> list[list[dict]]:
    """One message list per row: `loop.initial_messages` of the row's prompt, the calculator call, the tool
    message the loop's `ToolEnv` answers with, the answer.

    Raises SystemExit naming the row: the call is not run as one good call, the tool's output differs from the
    ground truth, or the environment does not end the trajectory after the answer."""
    envs = [loop.env_factory(r) for r in rows]
    starts = [loop.initial_messages(list(env.reset({"raw_prompt": r["prompt"]}))) for env, r in zip(envs, rows)]
    calls = [
        tool_call_text("calculator", {"expression": r["extra_info"]["entry"]["metadata"]["expression"]}) for r in rows
    ]
    env_cls = type(envs[0])
    results = env_cls.step_batch(envs, calls)
    answers = [answer_text(r["reward_model"]["ground_truth"]) for r in rows]
    ends = env_cls.step_batch(envs, answers)
    out = []
    for r, start, call, res, answer, end in zip(rows, starts, calls, results, answers, ends):
        where = f"item {r['extra_info']['index']} ({user_text(r['prompt'])[:60]!r})"
        if res.info.get("tool_calls") != 1 or res.info.get("tool_errors") or len(res.messages) != 1 or res.done:
            raise SystemExit(f"{where}: the call {call!r} was not run as one good call: {res}")
        tool = res.messages[0]
        if tool["role"] != "tool" or tool["content"] != r["reward_model"]["ground_truth"]:
            raise SystemExit(
                f"{where}: the tool answered {tool!r}; the ground truth is {r['reward_model']['ground_truth']!r}"
            )
        if not end.done or end.messages:
            raise SystemExit(f"{where}: the environment does not end the trajectory after the answer: {end}")
        out.append(
            [*start, {"role": "assistant", "content": call}, dict(tool), {"role": "assistant", "content": answer}]
        )
    return out


def token_lengths(tokenizer, messages: list[dict]) -> tuple[int, int, int]:
    """(trajectory tokens, prompt tokens, loss tokens) of one row through the SFT data path."""
    from jaxrl_post.data.sft import SFTKeys, row_ids_and_mask

    ids, mask = row_ids_and_mask(tokenizer, {"messages": messages}, "messages", SFTKeys())
    return len(ids), mask.index(1), sum(mask)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--n-train", type=int, default=512)
    p.add_argument("--n-val", type=int, default=64)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="reasoning-gym seed of the drawn items")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the GRPO tools config (path[:variant])")
    a = p.parse_args(argv)
    if a.n_train < 1 or a.n_val < 0:
        raise SystemExit(f"--n-train={a.n_train} must be >= 1 and --n-val={a.n_val} >= 0")
    from jaxrl_post.api import load_config
    from jaxrl_post.rl.builders import load_tokenizer
    from jaxrl_post.rl.reward_builders import build_agent_loop

    cfg = load_config(a.config)
    mt = cfg.rollout.multi_turn
    if not mt.enable or mt.env != "tools" or "calculator" not in str(mt.tools):
        raise SystemExit(f"--config={a.config}: not a multi-turn run with the calculator tool")
    exclude = rl_val_prompts(cfg)
    rows, stats = select_prompts(cfg, a.seed, a.n_train + a.n_val, exclude)
    for name, (lo, hi) in item_ranges(cfg).items():
        if a.seed < hi and lo < a.seed + stats["drawn"]:
            raise SystemExit(
                f"--seed={a.seed}: items {a.seed}..{a.seed + stats['drawn'] - 1} overlap the config's {name} items "
                f"{lo}..{hi - 1}; pick a seed outside"
            )
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    loop = build_agent_loop(cfg, None, tokenizer)
    try:
        if not loop.inject_tools:
            raise SystemExit(
                "the chat template renders tools= itself; the SFT data path renders no tools, so its prompts would "
                "differ from the rollout's"
            )
        trajs = build_trajectories(loop, rows)
    finally:
        loop.close()
    lens = [token_lengths(tokenizer, m) for m in trajs]
    total = [t for t, _, _ in lens]
    stats.update(
        train=a.n_train,
        val=a.n_val,
        tokens_min=min(total),
        tokens_median=int(statistics.median(total)),
        tokens_max=max(total),
        prompt_tokens_max=max(q for _, q, _ in lens),
        response_tokens_max=max(t - q for t, q, _ in lens),
        loss_tokens_mean=round(statistics.mean(k for _, _, k in lens), 1),
    )
    if stats["prompt_tokens_max"] > cfg.data.max_prompt_length:
        raise SystemExit(f"a prompt has {stats['prompt_tokens_max']} tokens > data.max_prompt_length")
    if stats["response_tokens_max"] > cfg.data.max_response_length:
        raise SystemExit(f"a trajectory has {stats['response_tokens_max']} response tokens > data.max_response_length")
    os.makedirs(a.out_dir, exist_ok=True)
    for name, part in (("train", trajs[: a.n_train]), ("val", trajs[a.n_train :])):
        with open(os.path.join(a.out_dir, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for messages in part:
                f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    print("| " + " | ".join(stats) + " |")
    print("|" + "---|" * len(stats))
    print("| " + " | ".join(str(v) for v in stats.values()) + " |")
    print(json.dumps(stats))
    print(f"wrote {a.out_dir}/train.jsonl and {a.out_dir}/val.jsonl", file=sys.stderr)
    return stats


if __name__ == "__main__":
    main()
