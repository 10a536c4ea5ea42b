"""`lily serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn + sse-starlette).

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
GET /health, GET /metrics (Prometheus, lily.server_metrics). Requests are validated here, turned into token ids and native sampling parameters,
and queued on the Scheduler (one engine, arrival order, bounded queue, prompt-prefix cache).

Design choices:
- Validation happens before anything is queued, so a bad request costs no engine time and gets
  an OpenAI-style error body {"error": {"message", "type", "param", "code"}} with the right
  status: 400 (malformed JSON, wrong types, out-of-range values, prompt longer than the
  context), 401 (API key), 404 (unknown model or route), 405, 413 (body too large), 503 (queue
  full). No field is silently ignored, as OpenAI does it: a field that is not part of the
  OpenAI API (nor one of lily's documented extensions, REQUEST_FIELDS) is a 400 "Unrecognized
  request argument supplied" (so is a key of a message or content part that OpenAI's message
  types lack, named by its path); an OpenAI field that would change the output and that lily does
  not implement is a 400 "Unsupported parameter" naming it; metadata that cannot change the
  output (user, metadata, store, ...) is accepted. Known fields are type-checked strictly.
- Streaming uses Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``.
  Reasoning (``<think>`` ... ``</think>``) and content are split as they stream with the
  same rules as the non-streamed parse (lily.tool_calls.parse_output), so the streamed pieces
  concatenate to the non-streamed message; tool calls are sent once complete.
- A client that disconnects cancels its job (checked before every engine step): a stream when
  its response ends early, a non-streamed request through the ASGI server's http.disconnect,
  awaited beside the job's events; a queued job whose client left is dropped without running.
- Nothing a client sends or fails to read costs unbounded time or memory: bodies are parsed
  into 400s whatever they hold, prompts are tokenized off the event loop (GIL released) and
  refused as soon as they cannot fit, a job buffers at most `stream_buffer_chunks` chunks its
  client has not taken, and the connection layer (lily.server_limits) enforces header and body
  deadlines and a connection cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import queue
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from lily._core import LilyError
from lily.chat_template import template_kwargs
from lily.generation import logit_bias_pairs, sampling_params, stop_token_list
from lily.prefix_cache import DiskCache
from lily.scheduler import Job, Scheduler
from lily.server_limits import ServerLimits, accept_batch, limited_protocol
from lily.structured import Grammar, compile_constraint, grammar_for, tool_call_grammar
from lily.tokenizer import PromptTooLong
from lily.tool_calls import CALL_OPEN, THINK_CLOSE, THINK_OPEN, _split_reasoning, parse_output

try:
    import jsonschema
    from sse_starlette.sse import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from lily.server_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
    from lily.server_metrics import PrometheusMetrics
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "lily serve needs the server extra: pip install \".[server]\" in a lily checkout (the distribution "
        "lily-llm; or pip install starlette uvicorn sse-starlette jsonschema prometheus-client)"
    ) from e

MAX_BODY_BYTES = 16 << 20
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # a stop string holds back that much streamed text
MAX_TOP_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # fields the native sampler holds as C ints
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_CHOICES = 16  # n: choices run one after another (lily.scheduler), so each costs its decode
MAX_STOP_TOKEN_IDS = 64

# Every request field each endpoint takes, by what lily does with it (docs/server.md lists them).
# "used": OpenAI fields lily implements; "extension": lily's own (as vLLM's and llama.cpp's
# servers take them); "metadata": OpenAI fields that cannot change the output, accepted and
# not used; "unsupported": OpenAI fields that change the output and that lily does not implement,
# each refused by name with the reason (a value equal to OpenAI's default is accepted).
# Anything else is refused as OpenAI refuses it: "Unrecognized request argument supplied".
_SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed",
                    "stop", "stream", "stream_options", "logprobs", "logit_bias", "n"}
_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "stop_token_ids"}
REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    "chat": {
        "used": _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                    "response_format"},
        "extension": _EXTENSIONS | {"chat_template_kwargs", "enable_thinking"},
        "metadata": {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_retention", "prompt_cache_options", "prediction"},
        "unsupported": {
            "audio": ("lily generates text only", (None,)),
            "modalities": ("lily generates text only", (None, ["text"])),
            "parallel_tool_calls": ("the model decides how many calls it makes", (None, True)),
            "reasoning_effort": ("use chat_template_kwargs.enable_thinking", (None,)),
            "verbosity": ("lily has no verbosity control", (None,)),
            "web_search_options": ("lily has no web search", (None,)),
            "moderation": ("lily runs no moderation", (None,)),
            "functions": ("use tools", (None,)),
            "function_call": ("use tool_choice", (None,)),
        },
    },
    "completions": {
        "used": _SAMPLING_FIELDS | {"prompt"},
        "extension": _EXTENSIONS,
        "metadata": {"user"},
        "unsupported": {
            "echo": ("the answer never repeats the prompt", (None, False)),
            "suffix": ("lily has no fill-in-the-middle", (None, "")),
            "best_of": ("use n", (None, 1)),
        },
    },
}


# The keys of each chat message type in OpenAI's API (the official client's
# ChatCompletion*MessageParam types), plus lily's ``reasoning_content`` on assistant turns (the
# <think> block, as lily's answers return it; vLLM's and DeepSeek's name). Any other key is
# refused by its path, as a top-level field is; ``audio`` and ``function_call`` unless null.
MESSAGE_KEYS: dict[str, set[str]] = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "tool_calls", "audio", "function_call", "reasoning_content"},
    "tool": {"role", "content", "tool_call_id"},
}
# Content parts OpenAI's user messages take besides text, which lily (text only) refuses by name.
OTHER_MEDIA_PARTS = ("image_url", "input_audio", "file")


def _check_keys(obj: dict, allowed: set[str], where: str = "") -> None:
    """Refuses keys of ``obj`` outside ``allowed``, naming each by its path (``messages[2].foo``)."""
    unknown = [f"{where}.{k}" if where else k for k in obj if k not in allowed]
    if unknown:
        raise APIError(400, f"Unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                            f"{', '.join(unknown)}", param=unknown[0], code="unrecognized_argument")


def _unsupported(path: str, why: str) -> NoReturn:
    raise APIError(400, f"Unsupported parameter: '{path}' is not supported by lily ({why})", param=path,
                   code="unsupported_parameter")


def check_fields(body: dict, endpoint: str) -> None:
    """Refuses any field of ``body`` that ``endpoint`` does not take (see REQUEST_FIELDS)."""
    fields = REQUEST_FIELDS[endpoint]
    _check_keys(body, fields["used"] | fields["extension"] | fields["metadata"] | set(fields["unsupported"]))
    if isinstance(body.get("stream_options"), dict):
        # include_obfuscation (padding against length side channels) is accepted, not used
        _check_keys(body["stream_options"], {"include_usage", "include_obfuscation"}, "stream_options")
    for name, (why, accepted) in fields["unsupported"].items():
        if name in body and body[name] not in accepted:
            _unsupported(name, why)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code)


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# -- request field checks ------------------------------------------------------------------


def _get(body: dict, key: str, kinds, default=None, *, lo=None, hi=None, allow_none=True):
    """body[key] checked against ``kinds`` (bool is never an int here) and an inclusive range."""
    if key not in body or (body[key] is None and allow_none):
        return default
    v = body[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if not ok and float in kinds and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if ok and isinstance(v, float) and not math.isfinite(v):
        ok = False
    if not ok:
        names = " or ".join(k.__name__ for k in kinds).replace("str", "string").replace("float", "number")
        names = names.replace("int", "integer").replace("bool", "boolean").replace("dict", "object")
        names = names.replace("list", "array")
        raise APIError(400, f"'{key}' must be {names}, got {json.dumps(v)[:80]}", param=key,
                       code="invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if lo is not None and hi is not None else (
            f">= {lo}" if lo is not None else f"<= {hi}")
        raise APIError(400, f"'{key}' must be {rng}, got {v}", param=key, code="invalid_value")
    return v


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"'stop' takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
                       param="stop", code="invalid_value")
    return [s for s in stop if s] or None


def _parse_json(raw: bytes) -> Any:
    """A request body as JSON; anything that does not parse is a 400, never a 500.

    Beyond malformed JSON and invalid UTF-8 that means: nesting past Python's recursion limit
    (RecursionError), integers past Python's 4,300-digit conversion limit (a plain ValueError,
    not a JSONDecodeError: it was a 500), and the non-standard NaN / Infinity literals or
    numbers that overflow to infinity (1e999), which no field takes and which passed range
    checks (every comparison with NaN is false)."""

    def refuse(what: str):
        raise APIError(400, f"could not parse the JSON body of the request ({what})", code="invalid_json")

    def finite(text: str) -> float:
        v = float(text)
        return v if math.isfinite(v) else refuse(f"the number {text[:32]} is out of range")

    try:
        return json.loads(raw.decode("utf-8"), parse_float=finite,
                          parse_constant=lambda name: refuse(f"{name} is not a JSON number"))
    except json.JSONDecodeError as e:
        refuse(e.msg)
    except (UnicodeDecodeError, RecursionError) as e:
        refuse(type(e).__name__)
    except ValueError as e:  # int('1' * 5000): "Exceeds the limit (4300 digits) ..."
        refuse(str(e).split(";")[0])


def _check_schema(schema: Any, where: str) -> None:
    """A JSON Schema object, checked against the JSON Schema meta-schema by the jsonschema
    library: a tool's parameters (the tool-call parser reads each argument's type from it, and a
    type of 5, true or 1.5 made it raise, a 500 once the model wrote a call) and response_format's
    schema."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise APIError(400, f"'{where}' must be a JSON Schema object", param=where, code="invalid_type")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise APIError(400, f"'{where}{at}' is not a valid JSON Schema: {e.message[:200]}", param=where,
                       code="invalid_value") from None
    except RecursionError:
        raise APIError(400, f"'{where}' is nested too deeply", param=where, code="invalid_value") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (after the body was read, the next ASGI message is
    http.disconnect, which uvicorn sends when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The served model, its scheduler and the request handlers."""

    def __init__(self, model, *, model_id: str, api_key: str | None = None, max_queue: int = 64,
                 cache_bytes: int = 1 << 30, default_max_tokens: int | None = None,
                 limits: ServerLimits | None = None, cache_dir: str | None = None,
                 cache_disk_bytes: int = 10 << 30, kv_budget_bytes: int | None = None):
        self.model = model
        self.model_id = model_id
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self.limits = limits or ServerLimits()
        self.open_connections: Callable[[], int | None] = lambda: None  # set by serve()
        self.created = int(time.time())
        # Its own registry (not prometheus_client's global one): one per server.
        self.metrics = PrometheusMetrics(queue_depth=lambda: self.scheduler.queued)
        self.scheduler = Scheduler(model, max_queue=max_queue, cache_bytes=cache_bytes, metrics=self.metrics,
                                   kv_budget_bytes=kv_budget_bytes)
        if cache_dir is not None:  # the prompt cache's disk tier (lily.prefix_cache.DiskCache)
            self.scheduler.cache.disk = DiskCache(model, cache_dir, cache_disk_bytes)

    # -- shared request handling -------------------------------------------------------------

    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "Incorrect API key provided.", type="invalid_request_error",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> dict:
        raw = bytearray()
        try:
            async for part in request.stream():
                raw += part
                if len(raw) > MAX_BODY_BYTES:
                    raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes",
                                   code="request_too_large")
        except ClientDisconnect:  # gone, or dropped by the body deadline (lily.server_limits)
            raise APIError(499, "client disconnected while sending the request") from None
        body = _parse_json(bytes(raw))
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            # JSON's \ud800-style escapes can smuggle unpaired surrogates into strings, which
            # nothing downstream can encode (the tokenizer, or an error message echoing the value
            # as UTF-8): refuse them here (found by the tests/fuzz server target).
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body has an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                                "strings must be valid Unicode", code="invalid_json") from None
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
        if model not in (None, self.model_id):
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                                f"'{self.model_id}')", param="model", code="model_not_found")
        return body

    def _sampling(self, body: dict, *, chat: bool):
        want_lp: bool | int
        if chat:
            lp = _get(body, "logprobs", bool, False)
            top = _get(body, "top_logprobs", int, 0, lo=0, hi=MAX_TOP_LOGPROBS)
            if top and not lp:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            want_lp = (top or True) if lp else False
        else:
            top = _get(body, "logprobs", int, None, lo=0, hi=MAX_TOP_LOGPROBS)
            want_lp = False if top is None else (top or True)
        max_tokens = _get(body, "max_completion_tokens", int, None, lo=0) if chat else None
        if max_tokens is None:
            max_tokens = _get(body, "max_tokens", int, None, lo=0)
        if max_tokens is None:
            max_tokens = self.default_max_tokens or self.model.generation_defaults.max_new_tokens or 512
        overrides = dict(
            temperature=_get(body, "temperature", float, None, lo=0.0, hi=2.0),
            top_p=_get(body, "top_p", float, None, lo=0.0, hi=1.0),
            top_k=_get(body, "top_k", int, None, lo=-1, hi=INT32_MAX),
            min_p=_get(body, "min_p", float, None, lo=0.0, hi=1.0),
            repetition_penalty=_get(body, "repetition_penalty", float, None, lo=0.0),
            presence_penalty=_get(body, "presence_penalty", float, None, lo=-2.0, hi=2.0),
            frequency_penalty=_get(body, "frequency_penalty", float, None, lo=-2.0, hi=2.0),
            seed=_get(body, "seed", int, None),
        )
        if overrides["top_k"] is not None and overrides["top_k"] <= 0:
            overrides["top_k"] = 0  # OpenAI-compatible servers use -1 / 0 for "off"
        if overrides["seed"] is not None:
            overrides["seed"] = overrides["seed"] % (1 << 63)
        try:
            params = sampling_params(self.model.generation_defaults.sampling_kwargs(), overrides, want_lp)
        except LilyError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return params, int(max_tokens), _stop(body), want_lp

    def _token_rules(self, body: dict) -> dict:
        """Job arguments from ``n`` (choices), ``logit_bias`` (OpenAI's: {"token id": bias in [-100, 100]}) and
        ``stop_token_ids`` (lily's extension, as vLLM's: ids that end generation as EOS does)."""
        vocab = self.model.tokenizer.vocab_size if self.model.tokenizer is not None else self.model.config.vocab_size
        bias = _get(body, "logit_bias", dict, {}) or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries", param="logit_bias",
                           code="invalid_value")
        parsed: dict[int, float] = {}
        for key, value in bias.items():
            if not re.fullmatch(r"[0-9]{1,10}", key) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -100 <= value <= 100:
                raise APIError(400, f"'logit_bias' maps token ids to numbers between -100 and 100, got "
                                    f"{json.dumps(key)[:40]}: {json.dumps(value)[:40]}", param="logit_bias",
                               code="invalid_value")
            parsed[int(key)] = float(value)
        ids = _get(body, "stop_token_ids", list, []) or []
        if len(ids) > MAX_STOP_TOKEN_IDS or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise APIError(400, f"'stop_token_ids' must be an array of at most {MAX_STOP_TOKEN_IDS} token ids",
                           param="stop_token_ids", code="invalid_value")
        n = _get(body, "n", int, 1, lo=1, hi=MAX_CHOICES)
        try:
            return dict(n=n, logit_bias=logit_bias_pairs(parsed, vocab), stop_token_ids=stop_token_list(ids, vocab))
        except LilyError as e:
            param = "logit_bias" if "logit_bias" in str(e) else "stop_token_ids"
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    def _strict_tools(self, tools: list[dict] | None, tool_choice: str) -> Grammar | None:
        """The grammar of the assistant turn when a tool is ``strict``: every call's arguments
        follow its tool's schema (lily.structured.tool_call_grammar). A forced call (tool_choice
        "required" or a named function) is opened by the grammar, not a prompt prefix; under
        "auto" the turn is free text that may end in calls, and text never opens a call."""
        strict = [bool(t["function"].get("strict")) for t in tools or ()]
        if not any(strict) or tool_choice == "none":
            return None
        if self.model.tokenizer is None:
            raise APIError(400, "strict tools need a tokenizer, and this model has none", param="tools")
        try:
            return tool_call_grammar(self.model.tokenizer, tools, strict=strict, tool_choice=tool_choice)
        except LilyError as e:
            raise APIError(400, str(e), param="tools", code="invalid_value") from None

    @staticmethod
    def _response_format(body: dict) -> Grammar | None:
        """The llguidance grammar ``response_format`` asks for: None for text (or none given),
        any JSON object for ``json_object``, the schema for ``json_schema`` (constrained whether or
        not ``strict`` is set)."""
        rf = body.get("response_format")
        if rf is None:
            return None
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                           param="response_format", code="invalid_value")
        allowed = {"type", "json_schema"} if rf["type"] == "json_schema" else {"type"}
        spec = rf.get("json_schema")
        if rf["type"] == "json_schema" and not isinstance(spec, dict):
            raise APIError(400, "'response_format.json_schema' must be an object with a 'schema'",
                           param="response_format.json_schema", code="invalid_value")
        _check_keys(rf, allowed, "response_format")
        _check_keys(spec or {}, {"name", "description", "schema", "strict"}, "response_format.json_schema")
        if rf["type"] == "text":
            return None
        schema: Any = True
        if spec is not None:
            if not isinstance(spec.get("schema"), dict):
                raise APIError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                               param="response_format.json_schema.schema", code="invalid_value")
            schema = spec["schema"]
            _check_schema(schema, "response_format.json_schema.schema")
        try:
            return grammar_for(json_schema=schema, where="response_format")
        except LilyError as e:
            raise APIError(400, str(e), param="response_format", code="invalid_value") from None

    async def _constraint(self, grammar: Grammar | None, thinking: bool):
        """The token constraint for ``grammar`` (compiled off the event loop: the first one
        indexes the tokenizer); a schema llguidance rejects is a 400 naming the problem."""
        if grammar is None:
            return None
        param = "tools" if grammar.source == "tool schema" else "response_format"
        if self.model.tokenizer is None:
            raise APIError(400, f"'{param}' needs a tokenizer, and this model has none", param=param)
        try:  # on the model's EOS ids, as Model._token_rules does (one tokenizer index per model)
            return await run_in_threadpool(compile_constraint, self.model.tokenizer, grammar,
                                           self.model.eos_token_ids, thinking=thinking, where=param)
        except LilyError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    def _too_long(self, tokens: str, param: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.model.max_context} tokens; the "
                             f"prompt has {tokens} tokens", param=param, code="context_length_exceeded")

    def _fit(self, ids: np.ndarray, max_tokens: int, param: str) -> int:
        if ids.size >= self.model.max_context:
            raise self._too_long(str(ids.size), param)
        return min(max_tokens, self.model.max_context - int(ids.size))

    async def _encode(self, text: str, param: str) -> np.ndarray:
        """Tokenizes off the event loop (the tokenizer releases the GIL, so other requests and
        /health keep being served), refusing a prompt as soon as it is known not to fit."""
        try:
            ids = await run_in_threadpool(self.model.tokenizer.encode, text, max_tokens=self.model.max_context - 1)
        except PromptTooLong as e:
            raise self._too_long(f"at least {e.at_least}", param) from None
        return np.asarray(ids, dtype=np.int32)

    async def _run(self, request: Request, job_args: dict):
        """Queues a job; returns (job, asyncio.Queue of events)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the event loop is gone (shutdown): stop generating
                job.cancel("shutdown")

        job = Job(emit=emit, buffer_chunks=self.limits.stream_buffer_chunks,
                  stall_timeout_s=self.limits.stream_timeout_s, **job_args)
        try:
            self.scheduler.submit(job)
        except queue.Full:
            raise APIError(503, "The server is busy: too many requests are queued; retry later",
                           type="server_error", code="queue_full") from None
        return job, events

    async def _collect(self, request: Request, job: Job, events: asyncio.Queue) -> list:
        """Waits for a non-streamed job; returns its results, one per choice. The client's
        disconnect (the ASGI server's http.disconnect, awaited beside the job's events) cancels
        the job at once, so the engine stops within the step it is running."""
        results = []
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                event = asyncio.ensure_future(events.get())
                await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()
                    job.cancel("client_disconnected")
                    raise APIError(499, "client disconnected")
                kind, value = event.result()
                if kind == "chunk":
                    job.took_chunk()
                elif kind == "done":
                    results.append(value)
                    if len(results) == job.n:
                        return results
                else:
                    raise value
        finally:
            gone.cancel()
            job.cancel("client_disconnected")  # no-op once finished; frees the engine if we leave early

    # -- endpoints ------------------------------------------------------------------------------

    async def health(self, request: Request):
        s = self.scheduler
        st = s.stats
        return JSONResponse({
            "status": "ok", "model": self.model_id, "running": bool(s.running), "running_requests": len(s.running), "queued": s.queued,
            "completed": st.completed, "cancelled": st.cancelled, "failed": st.failed,
            "rejected": st.rejected, "last_cancel_steps": st.last_cancel_steps,
            "last_cancel_release_s": st.last_cancel_release_s, "last_cancel_reason": st.last_cancel_reason,
            "last_cancel_tokens": st.last_cancel_tokens,
            "connections": self.open_connections(),
            "cache": {"sequences": len(s.cache), "bytes": s.cache.nbytes, "budget_bytes": s.cache.budget_bytes,
                      "hits": s.cache.hits, "misses": s.cache.misses, "evictions": s.cache.evictions,
                      "disk": None if (d := s.cache.disk) is None else {
                          "sequences": len(d), "bytes": d.nbytes, "budget_bytes": d.budget_bytes,
                          "loads": d.loads, "writes": d.writes, "skipped_files": d.skipped}},
        })

    async def prometheus(self, request: Request):
        """GET /metrics: Prometheus's text exposition (version 0.0.4); no key needed, as /health."""
        return Response(self.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request):
        self._check_auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: Request):
        # (Named model_card, not model: the attribute `model` is the served Model, and a method
        # of that name was shadowed by it, so this route answered 500 and skipped the key check.)
        self._check_auth(request)
        name = request.path_params["name"]
        if name != self.model_id:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lily",
                "max_model_len": self.model.max_context}

    async def chat_completions(self, request: Request):
        self._check_auth(request)
        body = await self._body(request)
        check_fields(body, "chat")
        messages = self._messages(body)
        tools, tool_choice = self._tools(body)
        stream = _get(body, "stream", bool, False)
        include_usage = bool(_get(_get(body, "stream_options", dict, {}) or {}, "include_usage", bool, False))
        # Every chat_template_kwargs key reaches the template (Qwen3.6's preserve_thinking, ...);
        # enable_thinking may also come top-level, as vLLM and SGLang accept it.
        try:
            template_vars = template_kwargs(_get(body, "chat_template_kwargs", dict, {}) or {},
                                            body.get("enable_thinking"))
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        params, max_tokens, stop, want_lp = self._sampling(body, chat=True)
        rules = self._token_rules(body)
        grammar = self._response_format(body)
        if grammar is not None and tools and tool_choice in ("required", "function"):
            raise APIError(400, "'response_format' cannot be combined with a forced tool call ('tool_choice')",
                           param="response_format")
        call_grammar = self._strict_tools(tools, tool_choice)
        if grammar is not None and call_grammar is not None:  # one grammar per turn: the answer's or the calls'
            raise APIError(400, "'response_format' cannot be combined with strict tools ('tools[].function.strict') "
                                "under 'tool_choice' auto", param="response_format")
        if self.model.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids to /v1/completions", param="messages")

        def render() -> str:
            try:
                return self.model.render_chat(messages, tools=tools if tool_choice != "none" else None,
                                              chat_template_kwargs=template_vars)
            except Exception as e:  # template errors (raise_exception, bad message structure)
                raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None

        # Rendering a long conversation takes a while: off the event loop. (The sandbox's size
        # budgets grow with the messages, so a long message gets context_length_exceeded from
        # the tokenizer below, not a template error.)
        text = await run_in_threadpool(render)
        ids = await self._encode(text, "messages")
        if ids.size == 0:
            raise APIError(400, "the rendered prompt is empty", param="messages")
        reasoning_started = text.rstrip().endswith(THINK_OPEN)
        # tool_choice "required" / a named function: the assistant turn is started with the
        # opening of a call in the model's own format, so what it generates is that call's body.
        # (Prefix forcing, not constrained decoding; with thinking on, the model reasons first.)
        forced = _forced_call_prefix(tool_choice, tools) if not reasoning_started and call_grammar is None else ""
        if forced:
            ids = np.concatenate([ids, np.asarray(self.model.tokenizer.encode(forced), dtype=np.int32)])
        max_tokens = self._fit(ids, max_tokens, "messages")
        constraint = await self._constraint(grammar or call_grammar, reasoning_started)
        job, events = await self._run(request, dict(ids=ids, params=params, max_tokens=max_tokens, stop=stop,
                                                    want_logprobs=bool(want_lp), constraint=constraint, **rules))
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        call_tools = tools if tool_choice != "none" else None
        if stream:
            return EventSourceResponse(
                self._chat_stream(job, events, rid, created, call_tools, reasoning_started, include_usage, forced),
                ping=15, sep="\n", send_timeout=self.limits.stream_timeout_s)
        results = await self._collect(request, job, events)
        choices = []
        for index, result in enumerate(results):
            parsed = parse_output(forced + result.text, tools=call_tools, reasoning_started=reasoning_started)
            msg = parsed.to_message()
            if msg.get("content") is None and not parsed.tool_calls:
                msg["content"] = ""
            finish = "tool_calls" if parsed.tool_calls else result.finish_reason
            choices.append({"index": index, "message": msg, "finish_reason": finish,
                            "logprobs": {"content": self._chat_logprobs(result.logprobs)} if want_lp else None})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_id,
                             "choices": choices, "usage": self._usage(results), "system_fingerprint": "lily"})

    async def completions(self, request: Request):
        self._check_auth(request)
        body = await self._body(request)
        check_fields(body, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "'prompt' is empty", param="prompt")
            if self.model.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            ids = await self._encode(prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in prompt):
            vocab = self.model.config.vocab_size
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise APIError(400, f"token ids in 'prompt' must be in [0, {vocab})", param="prompt")
            ids = np.asarray(prompt, dtype=np.int32)
        else:
            raise APIError(400, "'prompt' must be a non-empty string or array of token ids (one prompt)",
                           param="prompt", code="invalid_type")
        if ids.size == 0:
            raise APIError(400, "the prompt has no tokens", param="prompt")
        stream = _get(body, "stream", bool, False)
        include_usage = bool(_get(_get(body, "stream_options", dict, {}) or {}, "include_usage", bool, False))
        params, max_tokens, stop, want_lp = self._sampling(body, chat=False)
        rules = self._token_rules(body)
        if "max_tokens" not in body:
            max_tokens = min(max_tokens, 16)  # OpenAI's default for completions
        max_tokens = self._fit(ids, max_tokens, "prompt")
        job, events = await self._run(request, dict(ids=ids, params=params, max_tokens=max_tokens, stop=stop,
                                                    want_logprobs=bool(want_lp), **rules))
        rid = "cmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        if stream:
            return EventSourceResponse(self._completion_stream(job, events, rid, created, want_lp, include_usage),
                                       ping=15, sep="\n", send_timeout=self.limits.stream_timeout_s)
        results = await self._collect(request, job, events)
        choices = [{"index": index, "text": r.text, "finish_reason": r.finish_reason,
                    "logprobs": self._completion_logprobs(r.logprobs) if want_lp else None}
                   for index, r in enumerate(results)]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_id,
                             "choices": choices, "usage": self._usage(results), "system_fingerprint": "lily"})

    # -- request pieces --------------------------------------------------------------------------

    def _messages(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty array", param="messages",
                           code="invalid_type" if messages is not None else "missing_required_parameter")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise APIError(400, f"'{where}' must be an object", param=where, code="invalid_type")
            role = m.get("role")
            if not isinstance(role, str) or role not in MESSAGE_KEYS:
                raise APIError(400, f"'{where}.role' must be one of system, developer, user, assistant, tool; "
                                    f"got {json.dumps(role)[:40]}", param=f"{where}.role", code="invalid_value")
            _check_keys(m, MESSAGE_KEYS[role], where)
            for name, why in (("audio", "lily generates text only"), ("function_call", "use tool_calls")):
                if m.get(name) is not None:
                    _unsupported(f"{where}.{name}", why)
            for name in ("name", "tool_call_id", "refusal", "reasoning_content"):
                if m.get(name) is not None and not isinstance(m[name], str):
                    raise APIError(400, f"'{where}.{name}' must be a string", param=f"{where}.{name}",
                                   code="invalid_type")
            msg = {k: m[k] for k in ("name", "tool_call_id", "reasoning_content") if m.get(k) is not None}
            msg["role"] = "system" if role == "developer" else role
            content = self._content(m.get("content"), where, role=role)
            if m.get("refusal"):  # an earlier refusal is what the assistant said
                content = (content or "") + m["refusal"]
            msg["content"] = content
            if role == "assistant" and m.get("tool_calls") is not None:
                msg["tool_calls"] = self._history_tool_calls(m["tool_calls"], where)
            out.append(msg)
        return out

    @staticmethod
    def _content(content, where: str, *, role: str) -> str | None:
        if content is None:
            if role == "assistant":  # a turn of tool calls (or a refusal) only
                return None
            raise APIError(400, f"'{where}.content' is required", param=f"{where}.content")
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise APIError(400, f"'{where}.content' must be a string or an array of text parts",
                           param=f"{where}.content", code="invalid_type")
        texts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            kind = kind if isinstance(kind, str) else None  # (a list or an object is no part type)
            if kind in OTHER_MEDIA_PARTS:
                _unsupported(at, f"a content part of type {kind!r}: lily reads text only")
            # The key holding the part's text: text parts (and the Responses API's input_text) for
            # every role, an assistant's earlier refusal parts too.
            field = ({"text": "text", "input_text": "text"} | ({"refusal": "refusal"} if role == "assistant" else {})
                     ).get(kind)
            if field is None:
                raise APIError(400, f"'{at}.type' must be 'text'{' or refusal' if role == 'assistant' else ''}, "
                                    f"got {json.dumps(kind)[:40]}", param=f"{at}.type", code="invalid_value")
            # prompt_cache_breakpoint: OpenAI's cache hint, metadata here (lily caches every prefix).
            _check_keys(part, {"type", field, "prompt_cache_breakpoint"} if kind == "text" else {"type", field}, at)
            if not isinstance(part.get(field), str):
                raise APIError(400, f"'{at}.{field}' must be a string", param=f"{at}.{field}", code="invalid_type")
            texts.append(part[field])
        return "".join(texts)

    @staticmethod
    def _history_tool_calls(calls, where: str) -> list[dict]:
        if not isinstance(calls, list):
            raise APIError(400, f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
        out = []
        for j, c in enumerate(calls):
            at = f"{where}.tool_calls[{j}]"
            if isinstance(c, dict) and c.get("type") == "custom":
                _unsupported(f"{at}.type", "custom tools: lily calls functions")
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, f"'{at}' needs function.name", param=at)
            _check_keys(c, {"id", "type", "function"}, at)
            _check_keys(fn, {"name", "arguments"}, f"{at}.function")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise APIError(400, f"'{at}.function.arguments' is not valid JSON",
                                   param=f"{at}.function.arguments") from None
            out.append({"id": c.get("id"), "type": "function",
                        "function": {"name": fn["name"], "arguments": args}})
        return out

    @staticmethod
    def _tools(body: dict) -> tuple[list[dict] | None, Any]:
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list):
                raise APIError(400, "'tools' must be an array", param="tools", code="invalid_type")
            for i, t in enumerate(tools):
                fn = t.get("function") if isinstance(t, dict) else None
                if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                        or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise APIError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                                        f"{{\"name\": ...}}}}", param=f"tools[{i}]")
                _check_schema(fn.get("parameters"), f"tools[{i}].function.parameters")
                if not isinstance(fn.get("strict", False), (bool, type(None))):
                    raise APIError(400, f"'tools[{i}].function.strict' must be a boolean",
                                   param=f"tools[{i}].function.strict", code="invalid_type")
            tools = tools or None
        choice = body.get("tool_choice")
        if choice is None:
            return tools, "auto"
        if choice in ("none", "auto"):
            return tools, choice
        if choice == "required":
            if not tools:
                raise APIError(400, "'tool_choice' is 'required' but the request has no 'tools'", param="tool_choice")
            return tools, choice
        if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            chosen = [t for t in tools or [] if t["function"]["name"] == name]
            if not chosen:
                raise APIError(400, f"'tool_choice' names function {name!r}, which is not in 'tools'",
                               param="tool_choice")
            return chosen, "function"
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")

    # -- responses -------------------------------------------------------------------------------

    @staticmethod
    def _usage(results: list) -> dict:
        """Usage of a request's choices: the prompt counted once (the first choice prefilled it;
        the others reused it), completion tokens summed."""
        first = results[0]
        completion = sum(r.completion_tokens for r in results)
        return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
                "total_tokens": first.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}

    # The formatters below take logprob entries as GenerationResult.logprobs holds them, each
    # token's text already decoded by the GenerationStream: nothing is decoded again here.

    @staticmethod
    def _token_entry(e: dict) -> dict:
        return {"token": e["text"], "logprob": float(e["logprob"]), "bytes": list(e["text"].encode("utf-8"))}

    def _chat_logprobs(self, lps) -> list[dict]:
        """OpenAI's chat logprobs."""
        return [self._token_entry(e) | {"top_logprobs": [self._token_entry(t) for t in e["top_logprobs"] or ()]}
                for e in lps or []]

    def _completion_logprobs(self, lps) -> dict:
        """OpenAI's (legacy) completion logprobs."""
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = 0
        for e in lps or []:
            tokens.append(e["text"])
            token_lps.append(float(e["logprob"]))
            tops.append({t["text"]: float(t["logprob"]) for t in e["top_logprobs"] or ()})
            offsets.append(pos)
            pos += len(e["text"])
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _events(self, job: Job, events: asyncio.Queue):
        """Yields ("chunk"|"done", value), each choice's chunks then its "done", until the last
        choice's; cancels the job if the consumer stops early.

        A chunk counts as taken (room for the engine to generate one more, see Job) when the
        consumer asks for the next one, i.e. once the previous one was handed to the socket: a
        client that stops reading blocks the send, so the engine stops after
        ``stream_buffer_chunks`` chunks and the job is dropped after ``stream_timeout_s``."""
        resumed = time.monotonic()
        done = 0
        try:
            while True:
                kind, value = await events.get()
                if kind == "error":
                    raise value
                if kind == "chunk":
                    job.took_chunk()
                yield kind, value
                resumed = time.monotonic()
                done += kind == "done"
                if done == job.n:
                    return
        finally:
            # Closed while suspended in a send for the whole stream timeout: the response's send
            # timed out (the client stopped reading), else the client went away.
            stalled = time.monotonic() - resumed >= 0.9 * self.limits.stream_timeout_s
            job.cancel("slow_reader" if stalled else "client_disconnected")

    def _stream_error(self, e: Exception) -> str:
        kind = "invalid_request_error" if isinstance(e, LilyError) else "server_error"
        return self._sse({"error": {"message": f"{type(e).__name__}: {e}", "type": kind, "param": None,
                                    "code": None}})

    def _sse(self, obj: dict) -> str:
        return json.dumps(obj, ensure_ascii=False)

    async def _chat_stream(self, job, events, rid, created, tools, reasoning_started, include_usage, forced=""):
        index = 0  # the choice being streamed (choices run one after another)

        def chunk(delta: dict, finish=None, logprobs=None):
            c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return self._sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                              "model": self.model_id, "system_fingerprint": "lily", "choices": [c]})

        def start() -> list[str]:  # a choice's first chunks; resets the splitter
            nonlocal splitter
            splitter = StreamSplitter(reasoning_started)
            # the forced start of a tool call (tool_choice) after the role
            return [chunk({"role": "assistant", "content": ""})] + [chunk(d) for d in splitter.feed(forced)]

        splitter = StreamSplitter(reasoning_started)
        results = []
        for c in start():
            yield c
        try:
            async for kind, value in self._events(job, events):
                if kind == "chunk":
                    lp = None
                    if job.want_logprobs and value.token is not None:
                        lp = {"content": self._chat_logprobs([value.logprob_entry])}
                    deltas = splitter.feed(value.text)
                    for d in deltas:
                        yield chunk(d, logprobs=lp)
                        lp = None
                    if lp is not None:
                        yield chunk({}, logprobs=lp)
                else:
                    result = value
                    parsed = parse_output(forced + result.text, tools=tools, reasoning_started=reasoning_started)
                    for d in splitter.finish(parsed):
                        yield chunk(d)
                    if parsed.tool_calls:
                        calls = [{"index": i, **c} for i, c in enumerate(parsed.tool_calls)]
                        yield chunk({"tool_calls": calls})
                    yield chunk({}, "tool_calls" if parsed.tool_calls else result.finish_reason)
                    results.append(result)
                    if len(results) < job.n:
                        index += 1
                        for c in start():
                            yield c
                    elif include_usage:
                        yield self._sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                         "model": self.model_id, "choices": [], "usage": self._usage(results)})
        except Exception as e:  # the response has started: report in-stream, then end it
            yield self._stream_error(e)
        yield "[DONE]"

    async def _completion_stream(self, job, events, rid, created, want_lp, include_usage):
        results = []  # one per finished choice; the chunks streamed belong to choice len(results)

        def chunk(text: str, finish=None, logprobs=None):
            c = {"index": len(results), "text": text, "finish_reason": finish, "logprobs": logprobs}
            return self._sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_id,
                              "system_fingerprint": "lily", "choices": [c]})

        try:
            async for kind, value in self._events(job, events):
                if kind == "chunk":
                    lp = None
                    if want_lp and value.token is not None:
                        lp = self._completion_logprobs([value.logprob_entry])
                    if value.finish_reason is None:
                        if value.text or lp:
                            yield chunk(value.text, logprobs=lp)
                    else:
                        yield chunk(value.text, value.finish_reason, lp)
                else:
                    results.append(value)
                    if include_usage and len(results) == job.n:
                        yield self._sse({"id": rid, "object": "text_completion", "created": created,
                                         "model": self.model_id, "choices": [], "usage": self._usage(results)})
        except Exception as e:  # the response has started: report in-stream, then end it
            yield self._stream_error(e)
        yield "[DONE]"


def _forced_call_prefix(tool_choice: str, tools: list | None) -> str:
    """The text that opens the assistant turn for tool_choice "required" (a call) or a named
    function (a call to it), in the Qwen3.5 / Qwen3.6 tool-call format."""
    if not tools or tool_choice not in ("required", "function"):
        return ""
    if tool_choice == "function":
        return f"{CALL_OPEN}\n<function={tools[0]['function']['name']}>\n"
    return f"{CALL_OPEN}\n"


class StreamSplitter:
    """Splits streamed text into reasoning and content deltas as it arrives.

    At every step the text so far is split with parse_output's rules, holding back what could
    still change: a partial ``<think>`` / ``</think>`` / ``<tool_call>`` tag at the end,
    trailing whitespace (the final parse strips it), and everything from the first
    ``<tool_call>`` on (sent when the call is complete). The deltas are what extends the
    pieces already sent, so the stream concatenates to the non-streamed message.
    """

    _TAGS = (THINK_OPEN, THINK_CLOSE, CALL_OPEN)

    def __init__(self, reasoning_started: bool):
        self.reasoning_started = reasoning_started
        self.text = ""
        self.sent = {"reasoning_content": "", "content": ""}

    def _held(self, text: str) -> str:
        for n in range(min(len(text), max(len(t) for t in self._TAGS) - 1), 0, -1):
            tail = text[-n:]
            if any(t.startswith(tail) for t in self._TAGS):
                return text[:-n]
        return text

    def _deltas(self, reasoning: str | None, content: str) -> list[dict]:
        out = []
        for key, value in (("reasoning_content", reasoning or ""), ("content", content)):
            if value.startswith(self.sent[key]) and len(value) > len(self.sent[key]):
                out.append({key: value[len(self.sent[key]):]})
                self.sent[key] = value
        return out

    def feed(self, piece: str) -> list[dict]:
        if not piece:
            return []
        self.text += piece
        visible = self._held(self.text)
        reasoning, rest = _split_reasoning(visible, self.reasoning_started)
        if reasoning is not None and THINK_CLOSE not in visible:
            # still thinking: _split_reasoning already stripped; the start is fixed once sent
            return self._deltas(reasoning, "")
        call = rest.find(CALL_OPEN)
        content = (rest if call < 0 else rest[:call]).strip()
        return self._deltas(reasoning, content)

    def finish(self, parsed) -> list[dict]:
        return self._deltas(parsed.reasoning, parsed.content)


def build_app(server: Server) -> Starlette:
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), code=code)

    async def on_error(request: Request, exc: Exception):
        if isinstance(exc, LilyError):
            return error_response(400, str(exc))
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model_card, methods=["GET"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.scheduler.shutdown()
        server.scheduler.cache.spill()  # the disk tier, if any, keeps the prompt cache for the next start

    app = Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                       Exception: on_error}, lifespan=lifespan)
    app.state.server = server
    return app


def serve(model, *, model_id: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 64, cache_bytes: int = 1 << 30, log_level: str = "info",
          default_max_tokens: int | None = None, limits: ServerLimits | None = None, cache_dir: str | None = None,
          cache_disk_bytes: int = 10 << 30, max_batch: int | None = None,
          kv_budget_bytes: int | None = None) -> None:
    """Runs the server until interrupted. ``max_batch``: requests generating at once, sharing
    engine passes (default: the model's own, lily.model.default_max_batch unless it was loaded
    with one: 8 on the CPU backend, 7 on a GPU backend); ``kv_budget_bytes``: the KV cache and
    state the running requests may reserve (default: half the memory available at start)."""
    import uvicorn

    limits = limits or ServerLimits()
    if max_batch is not None:
        model.max_batch = max_batch
    server = Server(model, model_id=model_id, api_key=api_key, max_queue=max_queue, cache_bytes=cache_bytes,
                    default_max_tokens=default_max_tokens, limits=limits, cache_dir=cache_dir,
                    cache_disk_bytes=cache_disk_bytes, kv_budget_bytes=kv_budget_bytes)
    # uvicorn's h11 protocol with read deadlines, a connection cap and small send buffers
    # (lily.server_limits: uvicorn has no deadline for reading a request).
    protocol = limited_protocol(limits)
    server.open_connections = protocol.open_connections
    uvicorn.run(build_app(server), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                http=protocol, backlog=accept_batch(limits))
