"""The prompt rows of `configs/grpo_tools.py` for the TRL peer (`grpo_tools_trl.py`), in our training order.

    PYTHONPATH=$REPO python scripts/peers/grpo_tools_rows.py --out $PERF/grpo_tools_rows.jsonl --prompts 24

Rows: `jaxrl_post.rl.builders.load_split_rows(cfg, val=False)` of the config (reasoning-gym
basic_arithmetic, 2 terms of 2-3 digits, `*`, prompt format answer_tag, the config's system prompt), taken in the
order our dataloader draws them (grain `MapDataset.range(n).shuffle(seed=data.seed)`, as `PromptDataLoader`;
no prompt is filtered at this length). The system message gets the tool prompt exactly as our agent loop writes
it for a template that ignores `tools=` (SmolLM2's): `system + "\\n\\n" + HermesToolParser.system_prompt(schemas)`
(`AgentLoop.initial_messages`), so TRL renders the same prompt text without a template that knows tools.

Each jsonl line: `{"prompt": [system, user] messages, "ground_truth": str, "data_source": str, "index": int,
"extra_info_json": str}` (extra_info as JSON text: its nested task config does not fit an Arrow schema).
This module imports jax (through the row builders); the TRL script runs it in a separate process so the TRL
process's peak RSS holds no jax.
"""

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def tool_system_content(system_prompt: str | None, tools_spec: str = "calculator", fmt: str = "hermes") -> str:
    """The system message our agent loop sends with tools on a template that ignores `tools=`: the config's
    system prompt, a blank line, then the parser's tool prompt (OpenAI specs of `tools_spec`, one per line)."""
    from jaxrl_post.rollout.agent_loop import add_tool_prompt
    from jaxrl_post.rollout.tool_parser import get_tool_parser
    from jaxrl_post.rollout.tools import resolve_tools

    prompt = get_tool_parser(fmt).system_prompt([t.schema for t in resolve_tools(tools_spec)])
    return add_tool_prompt([{"role": "system", "content": system_prompt}] if system_prompt else [], prompt)[0][
        "content"
    ]


def training_order(n: int, seed: int) -> list[int]:
    """Row indices in the order `PromptDataLoader(shuffle=True, seed=seed)` batches them (one epoch)."""
    import grain

    return [int(i) for i in grain.MapDataset.range(n).shuffle(seed=int(seed))]


def build_rows(n_prompts: int, variant: str | None = None) -> list[dict]:
    """The first `n_prompts` training prompts of `configs/grpo_tools.py[:variant]`, in training order, as TRL rows.

    Raises ValueError when the config is not a tools run or has fewer rows than asked for."""
    from configs import grpo_tools
    from jaxrl_post.rl.data_rows import load_split_rows

    cfg = grpo_tools.get_config(variant)
    mt = cfg.rollout.multi_turn
    if not mt.enable or mt.env != "tools":
        raise ValueError(f"configs/grpo_tools.py:{variant} is not a tools run (env {mt.env!r})")
    rows = load_split_rows(cfg, val=False).rows
    if n_prompts > len(rows):
        raise ValueError(f"asked for {n_prompts} prompts; the config has {len(rows)}")
    system = tool_system_content(cfg.data.system_prompt, mt.tools, mt.format)
    out = []
    for i in training_order(len(rows), cfg.data.seed)[:n_prompts]:
        r = rows[i]
        msgs = [dict(m) for m in r["prompt"]]
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = system
        else:
            msgs.insert(0, {"role": "system", "content": system})
        out.append(
            {
                "prompt": msgs,
                "ground_truth": r["reward_model"]["ground_truth"],
                "data_source": r["data_source"],
                "index": i,
                "extra_info_json": json.dumps(r["extra_info"], default=_json_default),
            }
        )
    return out


def _json_default(o):
    from jaxrl_post.rewards.reasoning_gym_reward import _json_default as f

    return f(o)


def write_rows(path: str, n_prompts: int, variant: str | None = None) -> str:
    """Writes `build_rows(n_prompts, variant)` as jsonl at `path` (folders made); returns `path`."""
    rows = build_rows(n_prompts, variant)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--variant", default=None)
    a = ap.parse_args()
    print(write_rows(a.out, a.prompts, a.variant))


if __name__ == "__main__":
    main()
