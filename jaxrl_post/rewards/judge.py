"""Generative judge (LLM-as-judge, verl's generative reward model): a frozen model reads a judge prompt and
writes a verdict; the score is parsed from the text.

For each trajectory the judge prompt is `prompt_template.format(question=..., response=..., ground_truth=...)`
(rendered with the tokenizer's chat template as one user turn when `use_chat_template`), generated greedily
by our own sampler (`rollout.generate.Generator`, `temperature=0`) for at most `max_new_tokens` tokens, and
parsed by `parse_judge_score`. A verdict with no score in `[min_score, max_score]` is *unparseable*: it gets
`default_score` and is counted in `judge/num_unparseable` (it is a judgement, not a failed call). A judge
prompt longer than `max_prompt_length` tokens is a failed call (counted in `reward/num_errors`, subject to
the reward manager's `max_error_fraction`). The reward is the parsed score divided by `max_score` when
`normalize` (so a 0-10 judge gives rewards in [0, 1]).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_post.rewards.pool import CallResult

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "GenerativeJudge", "parse_judge_score"]

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n"
    "Question: {question}\n"
    "Reference answer: {ground_truth}\n"
    "Answer to grade: {response}\n"
    "Rate the answer from 0 (wrong) to 10 (fully correct). Reply with 'Score: <number>'."
)

_NUMBER = r"([-+]?\d+(?:\.\d+)?)"
_SCORE_RE = re.compile(r"score\s*(?:is|[:=])?\s*\**\s*" + _NUMBER, re.IGNORECASE)
_FRACTION_RE = re.compile(_NUMBER + r"\s*/\s*10\b")
_ONLY_NUMBER_RE = re.compile(r"^\s*" + _NUMBER + r"\s*[.!]?\s*$")


def parse_judge_score(text: str, min_score: float = 0.0, max_score: float = 10.0) -> float | None:
    """The score in a judge's verdict, or None when there is none in range.

    Rules, first that matches wins: the LAST 'Score: X' ('score = X', 'score is X', '**Score:** X', any
    case); else the last 'X/10'; else a verdict that is only a number. X outside [min_score, max_score]
    -> None (an out-of-range number is not a score on this scale)."""
    for regex in (_SCORE_RE, _FRACTION_RE):
        found = regex.findall(text)
        if found:
            value = float(found[-1])
            return value if min_score <= value <= max_score else None
    m = _ONLY_NUMBER_RE.match(text)
    if m:
        value = float(m.group(1))
        return value if min_score <= value <= max_score else None
    return None


class GenerativeJudge:
    """A frozen LM that scores trajectories by writing a verdict; a batch scorer for `RewardManager`
    (its `compute_score`: the manager calls `score_batch` with the whole batch and the decoded prompts).

    Args:
      model: a `jaxrl_post.models.Transformer` (any model.path we load; its params are not trained).
      tokenizer: HF-style tokenizer of that model (`__call__` / `batch_decode`, `apply_chat_template` when
        `use_chat_template`).
      prompt_template: str with `{question}`, `{response}`, `{ground_truth}` fields.
      max_new_tokens: verdict length limit (tokens).
      max_prompt_length: longer judge prompts are failed calls (tokens).
      min_score: bottom of the verdict's scale.
      max_score: top of the verdict's scale.
      default_score: the reward of an unparseable verdict (on the reward scale, not normalised).
      normalize: divide the parsed score by `max_score`.
      use_chat_template: render the judge prompt as one user turn with the generation prompt.
      batch_size: judge prompts per `Generator` call.
      generator: a `Generator` to reuse (default: one built for `model`, with `mesh`).
      mesh: device mesh of the model's params (None: single device).
    Raises:
      ValueError: the template lacks `{response}`, or a bad scale / length.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        prompt_template: str = DEFAULT_JUDGE_TEMPLATE,
        *,
        max_new_tokens: int = 32,
        max_prompt_length: int = 1024,
        min_score: float = 0.0,
        max_score: float = 10.0,
        default_score: float = 0.0,
        normalize: bool = True,
        use_chat_template: bool = True,
        batch_size: int = 64,
        generator: Any = None,
        mesh: Any = None,
    ):
        if "{response}" not in prompt_template:
            raise ValueError(f"judge prompt_template must contain '{{response}}', got {prompt_template!r}")
        try:
            prompt_template.format(question="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"judge prompt_template may only use {{question}}, {{response}}, {{ground_truth}} "
                f"(double other braces): {type(e).__name__}: {e}"
            ) from e
        if not max_score > min_score:
            raise ValueError(f"judge max_score ({max_score}) must be > min_score ({min_score})")
        if normalize and max_score <= 0:
            raise ValueError(f"judge normalize needs max_score > 0, got {max_score}")
        if max_new_tokens < 1 or max_prompt_length < 1 or batch_size < 1:
            raise ValueError("judge max_new_tokens, max_prompt_length and batch_size must be >= 1")
        # here, not at the top: jaxrl_post.rewards imports without jax (reward worker processes)
        from jaxrl_post.rollout.generate import Generator

        self.model, self.tokenizer, self.prompt_template = model, tokenizer, prompt_template
        self.max_new_tokens, self.max_prompt_length = int(max_new_tokens), int(max_prompt_length)
        self.min_score, self.max_score = float(min_score), float(max_score)
        self.default_score, self.normalize = float(default_score), bool(normalize)
        self.use_chat_template, self.batch_size = bool(use_chat_template), int(batch_size)
        self.generator = generator or Generator(model, mesh=mesh)
        self.reward_label = f"generative judge ({type(model).__name__})"
        self.last_metrics: dict[str, float] = {}
        self.last_verdicts: list[str] = []

    # ---------------------------------------------------------------------------------------------------
    def render(self, question: str, response: str, ground_truth: Any) -> str:
        """The judge prompt text for one trajectory (chat template applied when `use_chat_template`)."""
        text = self.prompt_template.format(
            question=question, response=response, ground_truth="" if ground_truth is None else ground_truth
        )
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return text

    def _sampling_params(self):
        # here, not at the top: jaxrl_post.rewards imports without jax (reward worker processes)
        from jaxrl_post.rollout.sampling import SamplingParams

        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=0.0,
            do_sample=False,
            eos_token_ids=() if eos is None else (int(eos),),
            pad_token_id=int(pad or 0),
        )

    def judge(self, texts: Sequence[str]) -> list[str]:
        """Greedy verdicts (decoded, special tokens skipped) for judge prompt texts, in order.

        Raises: ValueError: a prompt is empty or longer than `max_prompt_length` tokens."""
        # here, not at the top: jaxrl_post.rewards imports without jax (reward worker processes)
        from jaxrl_post.batch.protocol import DataProto

        ids = [list(x) for x in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
        for i, row in enumerate(ids):
            if not row or len(row) > self.max_prompt_length:
                raise ValueError(f"judge prompt {i} has {len(row)} tokens (limit {self.max_prompt_length})")
        params = self._sampling_params()
        verdicts: list[str] = []
        for s in range(0, len(ids), self.batch_size):
            rows = ids[s : s + self.batch_size]
            p = max(len(r) for r in rows)
            input_ids = np.full((len(rows), p), params.pad_token_id, np.int32)
            mask = np.zeros((len(rows), p), np.int32)
            for i, r in enumerate(rows):  # left padding
                input_ids[i, p - len(r) :], mask[i, p - len(r) :] = r, 1
            out = self.generator.generate(DataProto({"input_ids": input_ids, "attention_mask": mask}), params)
            resp = np.asarray(out.batch["responses"])
            exists = np.asarray(out.batch["response_attention_mask"]).astype(bool)
            seqs = [resp[i][exists[i]].tolist() for i in range(len(rows))]
            verdicts += list(self.tokenizer.batch_decode(seqs, skip_special_tokens=True))
        return verdicts

    def score_batch(self, args: Sequence[tuple], prompts: Sequence[str] | None = None) -> list[CallResult]:
        """[(data_source, response, ground_truth, extra_info), ...] and the decoded prompts (the question;
        None -> "") -> one CallResult per item: 'ok' with {'score', 'judge_parsed'} or 'error' (prompt too
        long). Sets `last_metrics` ('judge/num_unparseable', 'judge/num_judged') and `last_verdicts`."""
        questions = list(prompts) if prompts is not None else [""] * len(args)
        texts, keep, results = [], [], [None] * len(args)
        for i, a in enumerate(args):
            text = self.render(questions[i], a[1], a[2])
            n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if n > self.max_prompt_length:
                msg = f"judge prompt has {n} tokens, over the judge's max_prompt_length={self.max_prompt_length}"
                results[i] = CallResult("error", message=msg)
            else:
                texts.append(text)
                keep.append(i)
        verdicts = self.judge(texts) if texts else []
        n_bad = 0
        self.last_verdicts = [""] * len(args)
        for i, verdict in zip(keep, verdicts, strict=True):
            self.last_verdicts[i] = verdict
            value = parse_judge_score(verdict, self.min_score, self.max_score)
            if value is None:
                n_bad += 1
                score = self.default_score
            else:
                score = value / self.max_score if self.normalize else value
            results[i] = CallResult("ok", value={"score": float(score), "judge_parsed": float(value is not None)})
        self.last_metrics = {"judge/num_unparseable": float(n_bad), "judge/num_judged": float(len(keep))}
        return results  # type: ignore[return-value]
