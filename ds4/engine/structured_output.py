"""Strict output with xgrammar: JSON (response_format) and DSv4 DSML tool calls (strict tool calling).

Three pieces:
- `grammar_tokenizer_info`: the vocabulary as xgrammar sees it. Every added control token
  (`<｜User｜>`, `<think>`, `</think>`, ...) is blanked, so no grammar can ever emit one; only `｜DSML｜`
  stays, because the tool-call markup is spelled with it.
- `GrammarCache`: compiles a `GrammarSpec` in a thread pool the moment a request arrives and keeps
  the result (LRU), so the engine's step never waits on a compiler.
- `StructuredOutput`: one request's matcher. With reasoning on it stays inactive until the model
  ends its reasoning with `</think>`, then masks every step. In chat mode it masks from the first token,
  but lets through one `</think>` before the grammar's first token (DSv4 sometimes opens a chat-mode
  answer with a stray one; the output parser drops it): that token is skipped, never fed to the grammar.
  A token the grammar rejects does not raise: the request is steered to EOS.

The engine's hook is `apply_structured_output(logits, requests)` in the sampler: it catches each
matcher up with the tokens its request kept (`request.output_token_ids`) and masks the rows.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from ds4.engine.detokenizer import TokenBytes

THINK_END_TEXT = "</think>"
DSML_TEXT = "｜DSML｜"
# Blanks a grammar may put between JSON elements; bounded so a weak model cannot run away in whitespace.
DEFAULT_MAX_WHITESPACE = 8


def grammar_tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_token_id: int) -> xgr.TokenizerInfo:
    """xgrammar's view of a byte-level BPE vocabulary padded or cut to the model's `vocab_size` (logits width)."""
    bytes_of = list(TokenBytes(tokenizer).bytes_of)
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if added.content != DSML_TEXT and token_id < len(bytes_of):
            bytes_of[token_id] = b""  # empty: xgrammar treats it as a special token that text never matches
    bytes_of = (bytes_of + [b""] * vocab_size)[:vocab_size]
    return xgr.TokenizerInfo(bytes_of, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos_token_id])


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain, in a hashable canonical form (the cache key)."""

    kind: str  # "json_object", "json_schema" or "tool_calls"
    payload: str = ""  # compact JSON

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        return cls("json_schema", _canonical(schema))

    @classmethod
    def tool_calls(
        cls, tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel_tool_calls: bool = True
    ) -> GrammarSpec:
        """OpenAI `tools` + `tool_choice` ("auto", "required" or {"type": "function", "function": {"name"}}).

        With "auto" only tools marked `strict: true` get their arguments constrained (OpenAI semantics);
        with "required" or a named tool every tool's arguments follow its schema.
        """
        if tool_choice == "auto":
            tools = [_with_strict(tool, _function(tool).get("strict") is True) for tool in tools]
        else:
            tools = [_with_strict(tool, True) for tool in tools]
        return cls(
            "tool_calls",
            _canonical({"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": bool(parallel_tool_calls)}),
        )


class GrammarError(ValueError):
    """A schema or tool definition xgrammar cannot compile (a client error)."""


class GrammarCache:
    """Compiles grammars in a small thread pool; the same spec compiles once, concurrent askers share the result."""

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        max_whitespace: int = DEFAULT_MAX_WHITESPACE,
        max_threads: int = 2,
        max_entries: int = 256,
    ):
        if max_whitespace < 1:
            raise ValueError(f"max_whitespace must be >= 1, got {max_whitespace}")
        self.tokenizer_info = tokenizer_info
        self.max_whitespace = max_whitespace
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="ds4-grammar")
        self._entries: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the CompiledGrammar (raises GrammarError when the spec is invalid)."""
        with self._lock:
            future = self._entries.get(spec)
            if future is not None:
                self._entries.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._entries[spec] = future
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(spec, f))
        return future

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return self.submit(spec).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget(self, spec: GrammarSpec, future: Future) -> None:
        with self._lock:
            if self._entries.get(spec) is future:
                del self._entries[spec]

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema(
                    {"type": "object"}, strict_mode=False, max_whitespace_cnt=self.max_whitespace
                )
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(
                    spec.payload, strict_mode=True, max_whitespace_cnt=self.max_whitespace
                )
            if spec.kind == "tool_calls":
                return self._compiler.compile_structural_tag(self._tool_call_tag(json.loads(spec.payload)))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses for bad schemas
            raise GrammarError(f"cannot build a grammar for this {spec.kind}: {e}") from e
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def _tool_call_tag(self, payload: dict[str, Any]):
        # Reasoning is left out of the grammar: StructuredOutput itself waits for </think>.
        return xgr.get_model_structural_tag(
            "deepseek_v4",
            tools=payload["tools"],
            tool_choice=payload["tool_choice"],
            reasoning="disabled",
            parallel_tool_calls=payload["parallel_tool_calls"],
            max_whitespace_cnt=self.max_whitespace,
        )


# What one accepted token did, so rollback can undo it.
_REASONING, _THINK_END, _STRAY, _GRAMMAR = range(4)


class StructuredOutput:
    """One request's grammar state over its output tokens.

    `reasoning=True`: the prompt ended with `<think>`; tokens before the first `</think>` are free.
    `accept`/`rollback` move the state token by token (speculative decoding: accept the draft, roll back
    the rejected tail); `sync` catches up with a request's kept output tokens; `fill_bitmask` writes the
    allowed next tokens into one bitmask row.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, *, reasoning: bool, think_end_token_id: int, eos_token_id: int):
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos_token_id])
        self._reasoning = reasoning
        self._think_end = think_end_token_id
        self._eos = eos_token_id
        self._history: list[int] = []
        self._grammar_tokens = 0
        # Index in _history of the </think> that ended the reasoning (0 without reasoning).
        self._active_from: int | None = None if reasoning else 0
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.rejected_token: int | None = None

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (reasoning is over)."""
        return self._active_from is not None

    @property
    def num_tokens(self) -> int:
        """Output tokens accepted so far (reasoning, skipped and grammar tokens alike)."""
        return len(self._history)

    @property
    def failed(self) -> bool:
        return self.rejected_token is not None

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance over one output token; False (and the request is steered to EOS) if the grammar rejects it."""
        if self.failed:
            return False
        if not self.active:
            if token_id == self._think_end:
                self._active_from = len(self._history) + 1
                self._history.append(_THINK_END)
            else:
                self._history.append(_REASONING)
            return True
        if token_id == self._think_end and self._stray_allowed():
            self._history.append(_STRAY)
            return True
        if not self._matcher.accept_token(token_id):
            self.rejected_token = token_id  # not logged: drafts pass here too; the engine logs a request ended so
            return False
        self._history.append(_GRAMMAR)
        self._grammar_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} tokens")
        undone = self._history[len(self._history) - num_tokens :]
        del self._history[len(self._history) - num_tokens :]
        grammar = undone.count(_GRAMMAR)
        if grammar:
            self._matcher.rollback(grammar)
            self._grammar_tokens -= grammar
        if self._reasoning and self._active_from is not None and self._active_from > len(self._history):
            self._active_from = None
        # A rejected token was never accepted: rolling back drafts also forgets that it was proposed.
        self.rejected_token = None

    def _stray_allowed(self) -> bool:
        return not self._reasoning and not self._history

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Accept the output tokens this state has not seen yet."""
        for token_id in output_token_ids[self.num_tokens :]:
            if not self.accept(token_id):
                return

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False if the row needs no masking."""
        if self.failed:
            bitmask[row].zero_()
            bitmask[row, self._eos // 32] = _bit(self._eos % 32)
            return True
        if not self.active or self._matcher.is_terminated():
            return False
        if not self._matcher.fill_next_token_bitmask(bitmask, row):
            return False
        if self._stray_allowed():
            bitmask[row, self._think_end // 32] |= _bit(self._think_end % 32)
        return True


def apply_structured_output(logits: torch.Tensor, requests: Sequence[Any]) -> torch.Tensor:
    """The sampler's hook: logits [B, vocab] with grammar-forbidden tokens at -inf (a new tensor when any
    row is masked; the input stays untouched for raw logprobs).

    Each request (a RequestSampling) may carry `params.structured_output`; it is first caught up with
    `request.output_token_ids`, the tokens the request kept.
    """
    states = [
        (row, getattr(request.params, "structured_output", None), request) for row, request in enumerate(requests)
    ]
    states = [(row, state, request) for row, state, request in states if state is not None]
    if not states:
        return logits
    vocab_size = states[0][1].vocab_size
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    rows = []
    for row, state, request in states:
        state.sync(request.output_token_ids)
        if state.fill_bitmask(bitmask, row):
            rows.append(row)
    if not rows:
        return logits
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(
        masked, bitmask.to(logits.device), vocab_size=min(vocab_size, logits.shape[1]), indices=rows
    )
    if logits.shape[1] > vocab_size:
        masked[rows, vocab_size:] = float("-inf")
    return masked


def _bit(index: int) -> int:
    # The bitmask is int32: bit 31 is the sign bit.
    return (1 << index) - (1 << 32) * (index == 31)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function") or {}


def _with_strict(tool: dict[str, Any], strict: bool) -> dict[str, Any]:
    return {**tool, "function": {**_function(tool), "strict": strict}}


def _canonical(value: Any) -> str:
    # Key order is kept: the grammar writes object properties in the order the schema declares them.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
