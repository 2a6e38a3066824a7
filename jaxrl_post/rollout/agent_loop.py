"""Multi-turn rollouts: a batch of trajectories advances turn by turn (verl's `ToolAgentLoop`, token in, token out).

Each trajectory has an environment (`environments.Environment`; a tool set is `ToolEnv`). Per turn, every
trajectory still running is continued by the rollout `Generator`'s model until the model's end-of-turn token
(the chat template's, in `SamplingParams.eos_token_ids`); its text goes to the environment, whose answer
(tool results, user feedback) is appended as the chat template renders it; trajectories that are done leave
the batch. The model's sampled token ids are kept exactly as sampled (never decoded and re-encoded); only the
environment's messages are tokenized.

Append-only suffix: after an assistant turn, the observation tokens are the tokens of
``render(messages + [assistant] + observations, add_generation_prompt=True)`` after the end of the model's turn:
the text after the last occurrence of the stop token the model emitted in ``render(messages + [assistant])``
(e.g. ChatML's ``\\n`` after ``<|im_end|>``) followed by the new messages' text. Before using it, the loop checks
that the template is append-only on this conversation: ``render(messages + [assistant])`` starts with the text
rendered so far, and the new render starts with ``render(messages + [assistant])``. A template that rewrites
earlier turns (Qwen3 dropping or reformatting earlier ``<think>`` blocks, a template that trims the content
differently once a turn is not the last) raises `TemplateNotAppendOnlyError` instead of training on
tokens the model would never see.

Output: the keys of `Generator.generate` (``responses [B, R]`` = model and observation tokens in order,
right-padded; ``loss_mask`` 1 on the model's tokens only; ``rollout_log_probs`` 0 on observation tokens;
``response_attention_mask`` 1 on every existing token), plus non-tensor ``num_turns`` (assistant + environment
turns, verl's count without the prompt), ``tool_calls``, ``tool_errors`` and the reward inputs ``turn_scores``
/ ``tool_rewards`` (also put into each row's ``extra_info`` dict, where the reward function sees them, as verl
does). The budget ``R`` (``data.max_response_length``) covers all turns.

Prefix caching (`enable_prefix_caching=True`, the default; vLLM's / verl's name): the batch's KV cache is kept
between turns (`turn_cache.TurnCache`) and each turn prefills only what was appended since the row's last turn
(the environment's tokens and the next assistant header) onto it, rows at different lengths each at their own
cache slot; rows that are done leave the batch. With a fixed seed the trajectories equal those of
`enable_prefix_caching=False`, which re-prefills the prompt and the trajectory so far at every turn (one
`Generator.generate` call over the running rows at the batch bucket of the whole call; turn ``k`` pays a prefill
of ``P + (tokens so far)``); a sharded dense generator (with a mesh) always takes that path. With the paged engine
(`rollout.paged.PagedGenerator`, on one device or as data-parallel replicas of a tensor-parallel engine) prefix
caching runs in the engine's page pools (`rollout/paged/session.py`: a trajectory's pages stay on its replica
between turns), with the same trajectories for a fixed seed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.data.pipeline import compute_position_ids, left_pad
from jaxrl_post.errors import ConfigError
from jaxrl_post.models.tokenizer import tokenizer_adds_bos
from jaxrl_post.rollout.chat_suffix import _render, observation_suffix
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.rollout.paged.session import PagedSession
from jaxrl_post.rollout.tool_parser import get_tool_parser
from jaxrl_post.rollout.trajectory import _Traj, assemble, rollout_metrics
from jaxrl_post.rollout.turn_cache import TurnCache

__all__ = ["AgentLoop", "MultiTurnLimits", "add_tool_prompt", "rollout_metrics"]

log = logging.getLogger(__name__)


def add_tool_prompt(messages: Sequence[dict], tool_prompt: str) -> list[dict]:
    """`messages` with `tool_prompt` (a parser's `system_prompt(tools)`) after the system message's content and a
    blank line, or as a new first system message when there is none (copies; `messages` is not changed). What
    the agent loop sends for a template that ignores `tools=` (SmolLM2's)."""
    messages = list(messages)
    if messages and messages[0].get("role") == "system":
        return [dict(messages[0], content=messages[0]["content"] + "\n\n" + tool_prompt), *messages[1:]]
    return [{"role": "system", "content": tool_prompt}, *messages]


@dataclasses.dataclass(frozen=True)
class MultiTurnLimits:
    """verl's `actor_rollout_ref.rollout.multi_turn.*` limits (same names and meanings).

    max_assistant_turns: model turns per trajectory (None = until the budget or the environment ends it).
    max_user_turns: environment turns (tool / user messages) per trajectory (None = no limit).
    max_parallel_calls: tool calls run per turn; later ones are dropped.
    max_tool_response_length: characters of a tool response kept; tool_response_truncate_side: left | middle |
      right. format: the tool-call format (`tool_parser.get_tool_parser`)."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"

    def __post_init__(self):
        for k in ("max_assistant_turns", "max_user_turns"):
            v = getattr(self, k)
            if v is not None and int(v) < 1:
                raise ValueError(f"rollout.multi_turn.{k} must be >= 1 or None, got {v}")
        if int(self.max_parallel_calls) < 1:
            raise ValueError(f"rollout.multi_turn.max_parallel_calls must be >= 1, got {self.max_parallel_calls}")
        if self.tool_response_truncate_side not in ("left", "middle", "right"):
            raise ValueError(
                "rollout.multi_turn.tool_response_truncate_side must be left, middle or right, "
                f"got {self.tool_response_truncate_side!r}"
            )


class AgentLoop:
    """Multi-turn rollout over environments with the single-turn `Generator` or the paged `PagedGenerator`.

    Args:
      generator: the rollout `Generator` or `PagedGenerator`.
      tokenizer: the model's `transformers` tokenizer (with a chat template).
      env_factory: `row -> Environment` (row: a dict of one prompt's non-tensor fields); called once per
        trajectory (each of the n samples of a prompt gets its own).
      limits: `MultiTurnLimits`.
      tools: OpenAI tool specs passed to the chat template as `tools=` (None: no tools). When the template
        ignores `tools` (SmolLM2's renders nothing for them), the parser's tool prompt (`system_prompt(tools)`)
        is added to the system message instead.
      parser: the tool-call parser (for its tool prompt); None: `limits.format`'s.
      template_kwargs: extra chat-template arguments (e.g. `enable_thinking=False`).
      error_budget: a `tools.ToolErrorBudget` fed with the executed tool calls (checked once per call to
        `generate`); None = none.
      enable_prefix_caching: keep the batch's KV cache between turns and prefill only the appended tokens
        (`turn_cache.TurnCache`; vLLM's / verl's name; a `PagedGenerator`: `paged.session.PagedSession`, and
        `last_stats` gains its counts as `paged/*`). False, or a dense generator with a mesh or without a model:
        every turn re-prefills the prompt and the trajectory so far through the generator's `generate`.
    """

    def __init__(
        self,
        generator,
        tokenizer,
        env_factory: Callable[[Mapping[str, Any]], Any],
        limits: MultiTurnLimits | None = None,
        tools: list[dict] | None = None,
        parser=None,
        template_kwargs: Mapping[str, Any] | None = None,
        error_budget=None,
        enable_prefix_caching: bool = True,
    ):

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template")
        self.generator, self.tokenizer, self.env_factory = generator, tokenizer, env_factory
        self.limits = limits or MultiTurnLimits()
        self.tools = list(tools) if tools else None
        self.parser = parser or get_tool_parser(self.limits.format)
        self.template_kwargs = dict(template_kwargs or {})
        self.error_budget = error_budget
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.inject_tools = bool(self.tools) and self._template_ignores_tools()
        self.last_stats: dict[str, float] = {}
        self.closers: list[Callable[[], None]] = []  # called by close() (e.g. the tool executor's)
        self._turn_end: dict[tuple[int, ...], set[int]] = {}
        self._pinned: dict[int, Any] = {}

    def _generator(self, rows: int):
        """The generator with its batch bucket pinned to `rows` (every turn of a call, whatever number of rows
        still runs, compiles as one batch shape: the finished rows' slots are filler rows, marked done, that
        decode compaction drops), so the compiled shapes vary only with the context length's bucket. A generator
        without `batch_buckets` (a stand-in) is used as it is."""
        if not dataclasses.is_dataclass(self.generator) or not hasattr(self.generator, "batch_buckets"):
            return self.generator
        if rows not in self._pinned:
            self._pinned[rows] = dataclasses.replace(self.generator, batch_buckets=(rows,))
        return self._pinned[rows]

    def _turn_cache(self, p: int, r: int):
        """A fresh turn cache for one `generate` call: a `PagedSession` on a `PagedGenerator` (any mesh), a
        `TurnCache` on a one-device `Generator`; None (prefix caching off, or a generator neither can drive: a
        stand-in without a model, or a sharded dense one)."""

        g = self.generator
        if not self.enable_prefix_caching:
            return None
        if isinstance(g, PagedGenerator):
            return PagedSession(g, p, r)
        if not hasattr(g, "model") or getattr(g, "mesh", None) is not None:
            return None
        return TurnCache(g, p, r)

    def close(self) -> None:
        """Stop what the loop owns (tool worker processes)."""
        for fn in self.closers:
            fn()
        self.closers = []

    def turn_end_ids(self, eos_token_ids: Sequence[int]) -> set[int]:
        """Those of `eos_token_ids` that the chat template writes right after an assistant message's content (the
        end-of-turn token, e.g. ChatML's `<|im_end|>`); another stop token (`<|endoftext|>`) ends the trajectory.

        Raises ValueError when none of them is (the template's end of turn is not a stop token)."""
        key = tuple(int(i) for i in eos_token_ids)
        if key not in self._turn_end:
            content = "MARKER_7c1"
            m = [{"role": "user", "content": "x"}, {"role": "assistant", "content": content}]
            text = _render(self.tokenizer, m, False, self.tools, self.template_kwargs)
            ids = {i for i in key if content + self.tokenizer.decode([i], skip_special_tokens=False) in text}
            if not ids:
                raise ValueError(
                    f"none of the stop tokens {list(key)} ends an assistant turn in the chat template; the multi-turn "
                    "rollout needs the template's end-of-turn token in SamplingParams.eos_token_ids"
                )
            self._turn_end[key] = ids
        return self._turn_end[key]

    def _template_ignores_tools(self) -> bool:
        m = [{"role": "user", "content": "x"}]
        kw = self.template_kwargs
        return _render(self.tokenizer, m, True, self.tools, kw) == _render(self.tokenizer, m, True, None, kw)

    def initial_messages(self, messages: list[dict]) -> list[dict]:
        """The conversation a trajectory starts from: `messages` (`env.reset(row)`'s), with the parser's tool prompt
        added to the system message (`add_tool_prompt`) when the template ignores `tools=` (`inject_tools`), else
        as they are. SFT data for a tools run (scripts/make_tool_sft_data.py) builds its system message here."""
        if not self.inject_tools:
            return list(messages)
        return add_tool_prompt(messages, self.parser.system_prompt(self.tools))

    def _encode(self, text: str, first: bool) -> list[int]:

        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        bos = self.tokenizer.bos_token_id
        if first and bos is not None:
            if tokenizer_adds_bos(self.tokenizer) and (not ids or ids[0] != bos):
                ids = [int(bos), *ids]
            while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]
        return ids

    def generate(
        self, prompts: DataProto, params, *, n: int = 1, seed: int | None = None, process_local: bool = False
    ) -> DataProto:
        """Roll out `n` trajectories per prompt.

        Args:
          prompts: DataProto whose non-tensor batch holds what the environments read (`raw_prompt`, ...) and
            whose `input_ids [B, P]` give P (the prompt columns of the output); the prompt is re-rendered from
            `env.reset(row)` (with the tools) and left-padded to P.
          params: `SamplingParams`; `max_new_tokens` is the response budget R over all turns.
          n: trajectories per prompt (rows `i * n + j`, as `Generator.generate`).
          seed: overrides `params.seed`; turn k samples with a seed derived from (seed, k).
          process_local: multi-process rollouts are not supported (ValueError when True).
        Returns: DataProto with the keys of `Generator.generate` (shapes `[B * n, P]`, `[B * n, R]`, ...),
          non-tensor fields repeated plus `num_turns`, `tool_calls`, `tool_errors` ([B * n] int),
          `turn_scores`, `tool_rewards` (per-row lists), and `extra_info` dicts (copies) holding those too.
          `self.last_stats` gets the step's counts (see `rollout_metrics`).
        Raises:
          ConfigError (a ValueError) naming data.max_prompt_length: a re-rendered prompt is longer than P.
          TemplateNotAppendOnlyError: see the module doc.
          tools.ToolError: the error budget is exceeded.
        """
        if process_local:
            raise ValueError("multi-turn rollouts run in one process (process_local rollouts are not supported)")
        if params.truncated_log_probs:
            raise ValueError("multi-turn rollouts do not record sampling thresholds (rollout.sampling_mask_replay)")
        n = int(n)
        rows = prompts.repeat(n, interleave=True) if n > 1 else prompts
        b = len(rows)
        p = int(np.asarray(prompts.batch["input_ids"]).shape[1])
        r = int(params.max_new_tokens)
        eos = set(params.eos_token_ids)
        turn_end = self.turn_end_ids(params.eos_token_ids)
        if self.error_budget is not None:
            self.error_budget.reset()
        nt = {k: np.asarray(v) for k, v in rows.non_tensor_batch.items()}
        trajs = []
        for i in range(b):
            row = {k: v[i] for k, v in nt.items()}
            env = self.env_factory(row)
            msgs = self.initial_messages(list(env.reset(row)))
            text = _render(self.tokenizer, msgs, True, self.tools, self.template_kwargs)
            ids = self._encode(text, first=True)
            if len(ids) > p:  # a config error (main prints it as one `error:` line), not a crash
                raise ConfigError(
                    f"row {i}: the prompt (env.reset's messages rendered with the chat template and the tools) has "
                    f"{len(ids)} tokens > data.max_prompt_length={p}; raise --config.data.max_prompt_length (the "
                    "tools' schemas add hundreds of tokens, thousands with the character tokenizer)"
                )
            trajs.append(_Traj(env, msgs, text, ids))

        base_seed = int(params.seed if seed is None else seed)
        tc = self._turn_cache(p, r)
        stats = {"tool_calls": 0, "tool_errors": 0, "tool_format_errors": 0, "tool_timeouts": 0, "turns_run": 0}
        gen_calls = gen_tokens_in = 0
        turn = 0
        while True:
            active = [t for t in trajs if not t.done]
            if not active:
                break
            budget = [r - len(t.ids) for t in active]
            turn_seed = (base_seed * 1000003 + turn * 7919) % (2**31 - 1)
            if tc is not None:
                rows_ = [id(t) for t in active]
                appended = [(t.prompt_ids + t.ids)[t.cached :] for t in active]
                before = tc.prefill_tokens
                toks, exists, lps = tc.turn(rows_, appended, budget, params, turn_seed)
                gen_tokens_in += tc.prefill_tokens - before
            else:
                toks, exists, lps, n_in = self._reprefill_turn(active, b, params, turn_seed)
                gen_tokens_in += n_in
            gen_calls += 1
            stepping, actions = [], []
            for j, t in enumerate(active):
                k = int(exists[j].sum())
                new, new_lp = toks[j, :k].tolist()[: budget[j]], lps[j, :k].tolist()[: budget[j]]
                t.ids += new
                t.cached = len(t.prompt_ids) + len(t.ids)  # the turn cache holds the model's tokens
                t.loss += [1] * len(new)
                t.logp += new_lp
                t.assistant_turns += 1
                if not new or new[-1] not in eos:
                    t.done = t.truncated = True  # the budget ended the model's turn
                    continue
                lim = self.limits.max_assistant_turns
                ended = new[-1] not in turn_end  # e.g. <|endoftext|>: the model ended the conversation
                if ended or len(t.ids) >= r or (lim is not None and t.assistant_turns >= lim):
                    t.done = True
                    continue
                stepping.append(t)
                actions.append(self.tokenizer.decode(new[:-1], skip_special_tokens=False))
            if stepping:
                results = type(stepping[0].env).step_batch([t.env for t in stepping], actions)
            else:
                results = []
            for t, action, res in zip(stepping, actions, results):
                self._after_step(t, action, res, r, stats)
            stats["turns_run"] += 1
            turn += 1
        engine_stats = tc.close() if isinstance(tc, PagedSession) else {}  # the trajectories' pages freed
        if self.error_budget is not None:
            self.error_budget.check()
        self.last_stats = dict(stats, generate_calls=gen_calls, prefill_tokens=gen_tokens_in)
        self.last_stats.update({f"paged/{k}": v for k, v in engine_stats.items()})
        return assemble(rows, trajs, p, r, params)

    def _reprefill_turn(self, active: list[_Traj], b: int, params, seed: int):
        """One turn without prefix caching: prompt + trajectory so far of every running row, left-padded, through
        `Generator.generate` (batch bucket pinned to `b`). Returns (tokens, exists, log_probs, prefilled tokens)."""

        # one max_new_tokens (one compiled decode per shape); rows stop at EOS, extra tokens are cut
        ctx = [t.prompt_ids + t.ids for t in active]
        ids, mask = left_pad(ctx, max(len(c) for c in ctx), params.pad_token_id)
        batch = DataProto({"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)})
        out = self._generator(b).generate(batch, params, seed=seed)
        exists = np.asarray(out.batch["response_attention_mask"]).astype(bool)
        return np.asarray(out.batch["responses"]), exists, np.asarray(out.batch["rollout_log_probs"]), int(mask.sum())

    def _after_step(self, t: _Traj, action: str, res, r: int, stats: dict) -> None:
        info = res.info or {}
        for k in ("tool_calls", "tool_errors", "tool_format_errors", "tool_timeouts"):
            stats[k] += int(info.get(k, 0))
        t.tool_calls += int(info.get("tool_calls", 0))
        t.tool_errors += int(info.get("tool_errors", 0))
        if self.error_budget is not None:
            for status, text in info.get("tool_statuses", ()):
                self.error_budget.add(status, text)
        if "tool_calls" in info:  # a tool environment: one reward per turn that called tools
            if info["tool_calls"]:
                t.tool_rewards.append(float(res.reward))
        else:
            t.turn_scores.append(float(res.reward))
        lim = self.limits.max_user_turns
        if res.done or not res.messages or (lim is not None and t.user_turns >= lim):
            t.done = True
            return
        assistant = {"role": "assistant", "content": action}
        stop_text = self.tokenizer.decode([t.ids[-1]], skip_special_tokens=False)
        suffix, new_text = observation_suffix(
            self.tokenizer, t.text, t.messages, assistant, res.messages, stop_text, self.tools, self.template_kwargs
        )
        obs = self._encode(suffix, first=False)
        room = r - len(t.ids)
        if len(obs) >= room:  # no room left for a model token after the observation
            obs = obs[:room]
            t.done = t.truncated = True
        t.ids += obs
        t.loss += [0] * len(obs)
        t.logp += [0.0] * len(obs)
        t.messages = [*t.messages, assistant, *res.messages]
        t.text = new_text
        t.user_turns += 1
