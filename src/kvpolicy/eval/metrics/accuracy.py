"""``accuracy``: pass@1 on reasoning-gym tasks, each answer scored by the task's own scorer.

Every question is answered ``samples`` times; sample ``s`` of question ``i`` draws its tokens
from its own counter-based stream (``sample_key(seed, task, i, s)``), as the lm metric's samples do.
"""

from __future__ import annotations

from ..data import check_task, task_prompts
from ..sampling import SamplingParams, sample_key
from .base import Column, Metric, MetricResult, mean


class Accuracy(Metric):
    """pass@1 over ``samples`` samples per question, scored by the task's own reasoning-gym scorer."""

    name = "accuracy"
    help = "task accuracy (pass@1, reasoning-gym scorer) on e.g. gsm_symbolic, chain_sum"
    columns = [Column("accuracy", "pass@1", "{:.3f}", "higher", ranked=True)]

    def prepare(self, tokenizer, text, policies):
        s = self.config.accuracy
        for task in s.tasks:
            check_task(task)
        self.tasks = [task_prompts(tokenizer, t, s.questions, self.config.seed) for t in s.tasks]

    def run(self, ctx, policy, reference):
        from reasoning_gym.utils import extract_answer

        s = self.config.accuracy
        params = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
        preds = []
        per_task: dict[str, list[float]] = {}
        for prompts, dataset in self.tasks:
            for prompt in prompts:
                for sample in range(s.samples):
                    stream = ctx.stream(policy)
                    key = sample_key(self.config.seed, prompt.task, prompt.index, sample)
                    tokens, _ = stream.generate(stream.feed(prompt.ids), params, ctx.stop_ids, key=key)
                    text = ctx.decode(tokens)
                    answer = extract_answer(text)
                    score = float(dataset.score_answer(answer, prompt.entry)) if answer is not None else 0.0
                    per_task.setdefault(prompt.task, []).append(float(score >= 1.0))
                    preds.append(
                        {"task": prompt.task, "index": prompt.index, "sample": sample, "answer": answer,
                         "expected": prompt.answer, "score": score, "output": text}
                    )
        values = {"accuracy": mean([x for v in per_task.values() for x in v])}
        values.update({f"accuracy/{t}": mean(v) for t, v in per_task.items()})
        return MetricResult(values, preds)
