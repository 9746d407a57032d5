"""``KVPolicyLM``: the ``kvpolicy`` model of lm-evaluation-harness.

Generation (``generate_until``) decodes each batch through one fresh ``KVPolicyCache`` (or the
full cache when no policy is given) with :func:`kvpolicy.eval.decoding.generate_batch`: left
padding, seeded per-sample draws, finished rows leaving the batch, stop strings, ``max_gen_toks``.
A kvpolicy row evicts exactly as it would alone, so batching changes no result: a
deterministic policy gives each problem the same tokens at batch size 16 as at 1.

Samples of one problem (a task's ``repeats``) are told apart by their index ``s`` = 0, 1, ...:
sample ``s`` draws its tokens from its own counter-based stream and evicts with the cache seed
``policy seed + s``; batches hold samples of one index, so no two samples of a problem share
eviction randomness, and a sample's tokens never depend on which batch it ran in.

``loglikelihood`` and ``loglikelihood_rolling`` also run through the cache, one sequence at a
time, with the scored tokens fed in chunks that end exactly where token-by-token decoding would
evict (:class:`kvpolicy.eval.decoding.Stream`). They are exact, but a multiple-choice answer is
usually too short to trigger an eviction: measure eviction with generative tasks.

Every generated sample can be written to a JSONL file (``records=PATH``) as soon as it finishes;
samples already in that file are not generated again (``--resume`` of ``kvpolicy eval``, or the
same ``lm_eval`` command after an interruption) when they were made under the same ``settings``
(the model's weights, tokenizer, dtype and device, the seeds, the resolved policy): a record made
under others is not reused, and a line says how they differ. Progress is printed as lines on stderr.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import lm_eval.models  # noqa: F401  (fills lm-eval's model registry first: see below)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ...loading import load_policy
from ...policy import Policy
from ..cost import CostTracker, cache_tier_stats
from ..decoding import Generation, Prompt, Stream, generate_batch, input_device, new_cache, stop_token_ids
from ..progress import LineProgress, format_bytes, format_duration
from ..reasoning import find_loop, repeated_ngram_share, strip_thinking
from ..records import SampleStore, prompt_hash, settings_key
from ..sampling import SamplingParams, sample_key

log = logging.getLogger("kvpolicy.eval.lmeval")

FULL_CACHE = ("full", "none", "", None)
THINK_END = "</think>"


@dataclass
class _Item:
    """One requested generation: where its answer goes, its prompt, how to decode, its record key."""

    index: int
    task: str
    doc_id: str
    sample: int
    context: str
    gen_kwargs: dict[str, Any]
    params: SamplingParams
    ids: list[int]
    thinking: bool
    hash: str


def _to_int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


@torch.no_grad()
def model_fingerprint(model: Any) -> str:
    """A short hash of a model's weights: each parameter's name, shape and 256 of its values, spread
    over it. It tells two checkpoints apart (another folder, a fine-tune saved over the same one)
    without reading every byte of a large model."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(f"{name}{tuple(param.shape)}".encode())
        if param.device.type != "meta":  # offloaded by a device map: its name and shape only
            flat = param.detach().reshape(-1)
            h.update(flat[:: max(1, flat.numel() // 256)][:256].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _differences(records: list[dict[str, Any]], now: dict[str, Any]) -> str:
    """How the settings of ``records`` differ from ``now``: ``seed 0 there, 1 now; ...``."""
    if any(r.get("settings") is None for r in records):
        return "their settings were not recorded (an older kvpolicy)"
    fields = {k: sorted({str(r["settings"].get(k)) for r in records} - {str(now.get(k))})
              for k in {k for r in records for k in r["settings"]} | set(now)}
    return "; ".join(f"{k} {', '.join(v)} there, {now.get(k)} now" for k, v in sorted(fields.items()) if v)


def _unknown_args_message(unknown: Sequence[str], accepted: Sequence[str]) -> str:
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"kvpolicy model: unknown model_args {', '.join(hints)}; accepted: {', '.join(accepted)} "
            "(batch_size, max_batch_size and device are also what lm-eval's --batch_size, "
            "--max_batch_size and --device pass)")


# lm-eval 0.4.13 fills its model registry lazily: get_model() imports lm_eval.models (which
# registers "hf", "vllm", ... as placeholders) only while the registry is empty. Registering
# "kvpolicy" into an empty registry would make it look filled and hide every other model, so
# lm_eval.models is imported above, before the decorator runs. In the other order (lm_eval.models
# imported later) its registration keeps names already present, so both orders work.
@register_model("kvpolicy")
class KVPolicyLM(TemplateLM):
    """An lm-evaluation-harness model that decodes through a kvpolicy eviction policy.

    Args (``--model_args key=value,...`` on the lm-eval command line):
        pretrained: ``bundled``, a model folder, a ``.gguf`` file or a Hugging Face id.
        policy: a policy name (``snapkv``, ``vase-attnv``, ...) or YAML file; ``full`` (default)
            for the full cache.
        budget: the policy's budget in slots (default: the policy file's).
        policy_seed: overrides the policy's seed.
        dtype: ``auto`` (bfloat16 on a GPU, else float32), ``float32``, ``float16``, ``bfloat16``.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        device_map: e.g. ``auto`` to spread the model over every GPU (then ``device`` is ignored).
        batch_size: rows decoded together (lm-eval's ``--batch_size``).
        max_gen_toks: the default generation limit (a task's ``max_gen_toks`` wins).
        max_length: the longest prompt + generation (default: the model's context).
        seed: the sampling seed (each sample's draws derive from it).
        think_end_token: the marker that closes a reasoning trace; ``auto`` (default) uses
            ``</think>`` when the tokenizer knows it, ``none`` disables. Stop strings apply only
            after it, and answers returned to the task are what follows it.
        enable_thinking: passed to the chat template (Qwen3: ``false`` for non-thinking mode).
        records: a JSONL file of per-sample records (also the resume point).
        key: the label of this run in the records (default ``policy@budget`` or ``full``).
        progress_every: print a progress line every N finished samples (0: only at the end, -1: none).
        add_bos_token: prepend BOS when encoding (Gemma-style models).
        model, tokenizer: an already loaded model and tokenizer (Python use; ``pretrained`` is
            then only a name).
        max_batch_size: accepted because lm-eval passes it to every model; unused (no
            ``batch_size=auto``).

    Any other argument is a ``ValueError`` that lists the accepted ones: a misspelled
    ``budgte=80`` must not run the policy at its default budget.
    """

    backend = "causal"

    def __init__(
        self,
        pretrained: str = "bundled",
        policy: str | Policy | None = None,
        budget: int | None = None,
        *,
        policy_seed: int | None = None,
        dtype: str = "auto",
        device: str | None = "cpu",
        device_map: str | None = None,
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        seed: int = 0,
        think_end_token: str | None = "auto",
        enable_thinking: bool | None = None,
        records: str | None = None,
        key: str | None = None,
        progress_every: int = 10,
        add_bos_token: bool = False,
        model: Any = None,
        tokenizer: Any = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(_unknown_args_message(sorted(unknown), self.accepted_args()))
        super().__init__()
        from ..models import load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model

        if model is None:
            source = resolve_model(str(pretrained))
            device = str(device or "cpu")
            if device.startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's command line passes cuda:0 unless told otherwise.
                log.warning("kvpolicy model: %s requested but CUDA is not available; running on the CPU", device)
                device = "cpu"
            device_name = resolve_device(device) if not device_map else "cuda"
            dtype_name = resolve_dtype(str(dtype), device_name)
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
            model = load_model(source, dtype_name, device_name, device_map=device_map)
            self.model_name = source.name
        else:
            if tokenizer is None:
                raise ValueError("KVPolicyLM(model=...) needs the model's tokenizer too")
            self.tokenizer = tokenizer
            self.model_name = str(pretrained)
        self.model = model
        self._device = input_device(model)
        self._model_id = model_fingerprint(model)
        self._tokenizer_id = _digest(sorted(self.tokenizer.get_vocab().items()))
        self.base_attn = str(model.config._attn_implementation)
        if self.base_attn == "kvpolicy":
            self.base_attn = "sdpa"
        if batch_size in (None, ""):
            batch_size = 1
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            raise ValueError("kvpolicy model: batch_size=auto is not supported; give a number (e.g. 16)")
        self._batch_size = _to_int(batch_size, "batch_size")
        if self._batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self._batch_size}")
        self._max_gen_toks = _to_int(max_gen_toks, "max_gen_toks")
        self._max_length = None if max_length is None else _to_int(max_length, "max_length")
        self.seed = _to_int(seed, "seed")
        self.add_bos_token = bool(add_bos_token)
        self.enable_thinking = enable_thinking
        self.think_end = self._think_end(think_end_token)
        self.progress_every = _to_int(progress_every, "progress_every")
        self.policy = self._load_policy(policy, budget)
        self.policy_seed = None if self.policy is None else self.policy.resolve_seed(
            None if policy_seed is None else _to_int(policy_seed, "policy_seed"))
        self._fresh_seed = self.policy is not None and policy_seed is None and self.policy.config.seed is None
        self.key = key or ("full" if self.policy is None else f"{self.policy.name}@{self.policy.budget}")
        self.store = SampleStore(records)
        self.eos_ids = stop_token_ids(self.tokenizer, model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self.cost = CostTracker(self._device)
        self.cost.reset()

    # -- configuration -------------------------------------------------------------------------
    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> KVPolicyLM:
        """lm-eval's constructor: ``arg_dict`` (``--model_args``) and ``additional_config`` (its own
        ``--batch_size``, ``--max_batch_size`` and ``--device``, passed to every model). A name in
        both is the model's own setting, so ``model_args`` wins (``--device`` defaults to cuda:0)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None) -> KVPolicyLM:
        """``create_from_arg_obj`` of ``key=value,...`` (lm-eval's ``--model_args``)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def accepted_args(cls) -> list[str]:
        """The ``model_args`` names this model takes, sorted."""
        params = inspect.signature(cls.__init__).parameters.values()
        return sorted(p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD)

    @staticmethod
    def _load_policy(policy: str | Policy | None, budget: int | None) -> Policy | None:
        if isinstance(policy, Policy):
            return policy if budget is None else policy.with_overrides(budget=_to_int(budget, "budget"))
        if policy in FULL_CACHE or str(policy).lower() in FULL_CACHE:
            return None
        overrides = {} if budget is None else {"budget": _to_int(budget, "budget")}
        return load_policy(str(policy), **overrides)

    def _think_end(self, token: str | None) -> str | None:
        if token is None or str(token).lower() in ("none", "false", ""):
            return None
        if str(token).lower() != "auto":
            return str(token)
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        return THINK_END if THINK_END in vocab else None

    @property
    def settings(self) -> dict[str, Any]:
        """What a sample depends on besides its record key (task, problem, index, prompt and
        decoding parameters): a recorded sample is reused only under equal settings."""
        policy = None if self.policy is None else (
            f"{self.policy.name}@{self.policy.budget}#{_digest(self.policy.config.to_dict())}")
        # seed: null asks for a fresh policy seed each session: any session's draw is as good
        policy_seed = "fresh" if self._fresh_seed else self.policy_seed
        return {"model": self._model_id, "tokenizer": self._tokenizer_id, "dtype": str(self.model.dtype),
                "device": self._device.type, "seed": self.seed, "policy": policy, "policy_seed": policy_seed,
                "max_length": self.max_length, "add_bos_token": self.add_bos_token}

    def recorded(self) -> list[dict[str, Any]]:
        """The records of this run (its key) made under its settings."""
        return [r for r in self.store.for_run(self.key) if r.get("settings") == self.settings]

    def set_policy(self, policy: Policy | None, key: str | None = None) -> None:
        """Evaluate another policy with the same loaded model (``None``: the full cache)."""
        self.policy = policy
        self.policy_seed = None if policy is None else policy.resolve_seed(None)
        self._fresh_seed = policy is not None and policy.config.seed is None
        self.key = key or ("full" if policy is None else f"{policy.name}@{policy.budget}")

    # -- what lm-eval asks of a model ----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.eot_token_id)

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        for attr in ("max_position_embeddings", "n_positions", "seq_length"):
            value = getattr(self.model.config, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        return 2048

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", self.model_name)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer.encode(string, add_special_tokens=special))

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        extra = {} if self.enable_thinking is None else {"enable_thinking": bool(self.enable_thinking)}
        return str(self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt, **extra,
        ))

    def get_model_info(self) -> dict[str, Any]:
        """Recorded by lm-eval in its results' ``config``: the policy and what the run cost."""
        from ..models import attention_kernels

        return {"kvpolicy_key": self.key, "kvpolicy_policy": None if self.policy is None else self.policy.name,
                "kvpolicy_budget": None if self.policy is None else self.policy.budget,
                "kvpolicy_cost": self.cost.summary(), "kvpolicy_attention": attention_kernels(self.model, self.base_attn)}

    # -- generation ------------------------------------------------------------------------------
    def _params(self, gen_kwargs: dict[str, Any]) -> SamplingParams:
        kw = dict(gen_kwargs)
        until = kw.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        max_new = next((kw.pop(k) for k in ("max_gen_toks", "max_new_tokens", "max_tokens") if k in kw), None)
        max_new = self.max_gen_toks if max_new is None else _to_int(max_new, "max_gen_toks")
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        do_sample = kw.pop("do_sample", None)
        if do_sample is False:
            temperature = 0.0
        top_p = float(kw.pop("top_p", 1.0) or 1.0)
        top_k = int(kw.pop("top_k", 0) or 0)
        for ignored in ("max_length",):
            kw.pop(ignored, None)
        if kw:
            log.warning("kvpolicy model: ignoring generation arguments %s", sorted(kw))
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new,
                              stop=tuple(str(s) for s in until), think_end=self.think_end)

    def _prompt_ids(self, context: str, max_new: int) -> list[int]:
        room = self.max_length - max_new
        if room <= 0:
            raise ValueError(f"max_gen_toks ({max_new}) leaves no room for a prompt within max_length "
                             f"({self.max_length}); pass max_length=...")
        ids = self.tok_encode(context)
        return ids[-room:] if len(ids) > room else ids

    def _opens_thinking(self, context: str) -> bool:
        """Whether the answer starts inside a reasoning trace (no closed think block at the prompt's end)."""
        if self.think_end is None:
            return False
        return self.think_end not in context[-(len(self.think_end) + 24) :]

    def _new_cache(self, sample: int) -> Any:
        if self.policy is None:
            return new_cache(self.model, None, self.base_attn)
        assert self.policy_seed is not None
        return new_cache(self.model, self.policy, seed=(self.policy_seed + sample) % (1 << 63))

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        items: list[_Item] = []
        counts: Counter[tuple[str, str, str]] = Counter()
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            params = self._params(gen_kwargs)
            h = prompt_hash(context, {"params": params.__dict__})
            task = str(getattr(req, "task_name", None) or "-")
            doc = getattr(req, "doc_id", None)
            doc_id = h if doc is None else str(doc)
            ident = (task, doc_id, h)
            sample = counts[ident]
            counts[ident] += 1
            items.append(_Item(i, task, doc_id, sample, context, gen_kwargs, params,
                               self._prompt_ids(context, params.max_new_tokens), self._opens_thinking(context), h))
        results: list[str | None] = [None] * len(items)
        pending = []
        settings = self.settings
        made_under = settings_key(settings)
        for it in items:
            record = self.store.get((self.key, it.task, it.doc_id, it.sample, it.hash, made_under))
            if record is not None:
                results[it.index] = str(record["response"])
            else:
                pending.append(it)
        tasks = {it.task for it in items}
        label = f"{self.key} {','.join(sorted(tasks))}"
        progress = LineProgress(label, len(items), every=self.progress_every, done=len(items) - len(pending))
        if len(pending) < len(items):
            progress.print(f"kvpolicy: {self.key}: {len(items) - len(pending)} of {len(items)} samples already "
                           "recorded; generating the rest")
        others = [r for r in self.store.for_run(self.key) if r["task"] in tasks and r.get("settings") != settings]
        if pending and others:
            progress.print(f"kvpolicy: {self.key}: not reusing {len(others)} sample(s) recorded in {self.store.path} "
                           f"under other settings ({_differences(others, settings)})")
        for _, same_params in groupby(sorted(pending, key=lambda it: repr(it.params)), key=lambda it: repr(it.params)):
            group = sorted(same_params, key=lambda it: (it.sample, -len(it.ids), it.index))
            for sample, same_sample in groupby(group, key=lambda it: it.sample):
                rows = list(same_sample)
                for start in range(0, len(rows), self.batch_size):
                    self._run_batch(rows[start : start + self.batch_size], sample, results, progress)
        if not pending:
            progress.print()
        progress.print(self._cost_line())
        return [r if r is not None else "" for r in results]

    def _run_batch(self, batch: list[_Item], sample: int, results: list[str | None], progress: LineProgress) -> None:
        params = batch[0].params
        prompts = [Prompt(it.ids, sample_key(self.seed, it.task, it.doc_id, it.sample, it.hash), it.thinking)
                   for it in batch]

        cache = self._new_cache(sample)
        moved = [0]  # bytes the cache had moved (slow tier -> fast) at the last finished row

        def finish(gen: Generation) -> None:
            it = batch[gen.index]
            record = self._record(it, gen)
            self.store.add(record)
            results[it.index] = record["response"]
            self.cache_hook.add_partial("generate_until", (it.context, it.gen_kwargs), record["response"])
            tiers = cache_tier_stats(cache)  # a two-tier policy's: the progress line shows the bytes moved
            if tiers is not None:
                tiers_moved, moved[0] = tiers.moved_bytes - moved[0], tiers.moved_bytes
            progress.update(1, tokens=len(gen.tokens), moved=None if tiers is None else tiers_moved)

        _, stats = generate_batch(self.model, cache, self.tokenizer, prompts, params, self.eos_ids,
                                  pad_id=self.pad_id, on_finish=finish)
        self.cost.add(stats)

    def _record(self, it: _Item, gen: Generation) -> dict[str, Any]:
        text = self.tok_decode(gen.tokens)
        response = strip_thinking(text, self.think_end)
        for stop in it.params.stop:
            if stop:
                response = response.split(stop)[0]
        loop = find_loop(gen.tokens)
        return {
            "key": self.key, "task": it.task, "doc_id": it.doc_id, "sample": it.sample, "prompt_hash": it.hash,
            "settings": self.settings,
            "policy": "full" if self.policy is None else self.policy.name,
            "budget": None if self.policy is None else self.policy.budget,
            "prompt_tokens": len(it.ids), "tokens": len(gen.tokens), "finish": gen.finish, "ended": gen.ended,
            "thought_closed": None if not it.thinking else (self.think_end is not None and self.think_end in text),
            "rep4": repeated_ngram_share(gen.tokens, 4), "loop": loop is not None,
            "loop_period": None if loop is None else loop.period, "loop_span": None if loop is None else loop.span,
            "seconds": round(gen.seconds, 3), "response": response, "output": text,
        }

    def _cost_line(self) -> str:
        c = self.cost.summary()
        if not c["new_tokens"]:
            return f"kvpolicy: {self.key}: nothing generated (every sample was already recorded)"
        evict = c["evict_share"]
        line = (f"kvpolicy: {self.key}: {c['new_tokens']} new tokens in {format_duration(float(c['seconds'] or 0))} "
                f"({c['tokens_per_s']:.1f} tok/s at batch {self.batch_size}), peak {c['peak_mib']:.0f} MiB, "
                f"KV cache {c['kv_mib']:.2f} MiB" + ("" if evict is None else f", evicting {evict:.1%} of the time"))
        tiers = self.cost.total.tiers
        if tiers is not None:  # a two-tier policy
            per = "" if not tiers.decode_tokens else f" ({format_bytes(tiers.moved_per_token)}/tok)"
            hits = "" if not tiers.pages_recalled else f", recall hits {tiers.hit_rate:.0%}"
            line += (f"; fast tier {format_bytes(tiers.fast_bytes)}, slow tier {format_bytes(tiers.slow_bytes)}, "
                     f"moved {format_bytes(tiers.moved_bytes)}{per}{hits}")
        return line

    # -- scoring ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Log-probability of ``continuation`` after ``context``, and whether it is the greedy one."""
        whole = (context + continuation)[-(self.max_length + 1) :]
        ctx, cont = whole[: len(whole) - len(continuation)], whole[len(whole) - len(continuation) :]
        if not ctx:
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length {self.max_length}")
        stream = Stream(self.model, self.policy, self.base_attn)
        logits = [stream.feed(ctx)[None]]
        if len(cont) > 1:
            stream.feed(cont[:-1], lambda offset, lg: logits.append(lg))
        all_logits = torch.cat(logits)[: len(cont)].float()
        target = torch.tensor(cont, device=all_logits.device)
        logprobs = torch.log_softmax(all_logits, dim=-1)
        total = float(logprobs.gather(-1, target[:, None]).sum())
        return total, bool((all_logits.argmax(-1) == target).all())

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        out = []
        progress = LineProgress(f"{self.key} loglikelihood", len(requests), every=max(self.progress_every, 0) * 10,
                                unit="requests")
        for (context, continuation), context_enc, continuation_enc in requests:
            result = self._score(list(context_enc), list(continuation_enc))
            out.append(result)
            if context is not None:
                self.cache_hook.add_partial("loglikelihood", (context, continuation), result)
            progress.update(1)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(self._score(list(ctx), list(cont))[0] for ctx, cont in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out
