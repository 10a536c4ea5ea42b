"""The `lily` command line: generate, chat, cache, serve, convert, bench, eval.

Each subcommand is a thin layer over the Python API (lily.Model, lily.Chat) or over one
module (lily.server, lily.convert, lily.bench, lily.evaluate); heavy imports happen inside
the subcommand so `lily --help` is instant. Errors the user can fix (bad paths, bad flags,
bad checkpoints) print one line `lily: error: ...` and exit with status 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")


class UsageError(Exception):
    """A mistake the user can fix: printed as one `lily: error:` line, exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already states its default or
    there is none worth stating (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or "default:" in text or action.default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def c_unescape(text: str) -> str:
    """C-style escapes in a command-line string (``\\n``, ``\\t``, ``\\\\``, ``\\xHH``, ``\\uXXXX``, ...)
    turned into the characters they name, so ``--stop "\\n\\n"`` stops at a blank line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an unknown escape (\q) is an error, not kept as is
            return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except (UnicodeDecodeError, DeprecationWarning, SyntaxWarning) as e:
        reason = str(e).split(": ", 1)[-1].removeprefix("decoding with 'unicode_escape' codec failed (")
        raise argparse.ArgumentTypeError(f"bad escape in {text!r}: {reason.rstrip(')')}") from None


def json_object(text: str) -> dict:
    """A JSON object given on the command line (``--chat-template-kwargs '{"preserve_thinking": true}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{\"name\": value, ...}}, got "
                                         f"{type(value).__name__} {text!r}")
    return value


# -- shared flags ------------------------------------------------------------------------------


def _add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--model", "-m", required=required, default=None,
                   help="checkpoint folder or Hugging Face repo id (default: the built-in demo model)"
                   if not required else "checkpoint folder or Hugging Face repo id")
    p.add_argument("--revision", default=None, help="Hugging Face revision (branch, tag or commit)")
    p.add_argument("--backend", default="auto",
                   help="compute backend: auto (Metal where its known-answer check passed on this Mac, "
                        "else the CPU; `lily doctor` says which and why), cpu, or metal (macOS; unverified "
                        "on Apple hardware)")
    p.add_argument("--threads", type=int, default=None, help="CPU worker threads (default: all cores)")
    p.add_argument("--cpu-matmul", choices=("auto", "f32", "int8"), default=None,
                   help="CPU products with quantized weights: int8 activations with integer dot products "
                        "(fast, ~1%% logits error), f32 (the reference), or auto: int8 where the CPU has the "
                        "integer kernels (default: Model.load's, auto)")
    p.add_argument("--max-context", type=int, default=None,
                   help="context length of new sequences (default: the model's)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json, else greedy)")
    g.add_argument("--max-tokens", "-n", type=int, default=None,
                   help="tokens to generate at most (default: the checkpoint's max_new_tokens, else 256)")
    g.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="random seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=None, type=c_unescape,
                   help="stop string (repeatable); C-style escapes such as \\n and \\t are unescaped")


def _add_template_kwargs(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="a JSON object whose every key becomes a chat template variable" + what + ", e.g. "
                        "'{\"preserve_thinking\": true}' (as chat_template_kwargs in the Python API and the server)")


def _sampling(args) -> dict:
    kw = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.max_tokens is not None:
        kw["max_tokens"] = args.max_tokens
    if args.stop:
        kw["stop"] = args.stop
    return kw


def _load(args):
    import lily

    extra = {"cpu_matmul": args.cpu_matmul} if args.cpu_matmul else {}
    return lily.Model.load(args.model, revision=args.revision, backend=args.backend, threads=args.threads,
                           max_context=args.max_context, **extra)


def _model_id(args, model) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    if args.model is None:
        return "lily-demo"
    return str(args.model).rstrip("/")


# -- generate ----------------------------------------------------------------------------------


def cmd_generate(args) -> int:
    if args.prompt is not None and args.prompt_flag is not None:
        raise UsageError("give the prompt once: as an argument or with -p/--prompt")
    prompt = args.prompt if args.prompt is not None else args.prompt_flag
    chat_only = [flag for flag, value in (("--system", args.system), ("--think", args.think),
                                          ("--chat-template-kwargs", args.chat_template_kwargs)) if value is not None]
    if not args.chat and chat_only:
        raise UsageError(f"{chat_only[0]} needs --chat (the prompt is used as plain text otherwise)")
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            print("lily: reading the prompt from stdin (end with Ctrl-D)", file=sys.stderr)
        prompt = sys.stdin.read()
    if not prompt:
        raise UsageError("the prompt is empty")
    model = _load(args)
    cache = _prompt_cache(model, args.prompt_cache, args.chat)
    system = args.system
    if cache is not None and args.chat:
        system = _cached_system(cache, args)
    if args.chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        target = messages
    elif cache is not None:  # the prompt continues the cached text, as with mlx_lm.generate
        target = cache.tokens + model.encode_prompt(prompt).tolist()
    else:
        target = prompt
    kw = _sampling(args)
    bar = PrefillProgress()
    stream = model.generate(target, stream=True, enable_thinking=args.think,
                            chat_template_kwargs=args.chat_template_kwargs, on_prefill_progress=bar,
                            prompt_cache=cache, **kw)
    printer = AnswerPrinter(stream.reasoning_started)
    with stream:
        for chunk in stream:
            bar.close()
            printer.write(chunk.text)
    bar.close()
    printer.end()
    if args.verbose and stream.result is not None:
        r = stream.result
        cached = f" ({r.cached_tokens} from the prompt cache)" if cache is not None else ""
        print(f"[{r.prompt_tokens} prompt tokens{cached}, {r.completion_tokens} generated, ttft {r.ttft_s * 1e3:.0f} ms, "
              f"prefill {r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.1f} tok/s, "
              f"finish {r.finish_reason}]", file=sys.stderr)
    return 0


class AnswerPrinter:
    """Writes a streamed answer to stdout, its ``<think>`` block (reasoning) apart from it: on
    stderr, under a "thinking:" line and dimmed on a terminal, so the answer alone goes to
    stdout. The text starts as reasoning when the prompt opened the block (``reasoning_started``)
    or when it opens with ``<think>``; it ends at ``</think>``. A tag split across chunks is held
    back until it is whole."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, reasoning_started: bool, out=None, err=None):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.state = "thinking" if reasoning_started else "start"  # start | thinking | answer
        self.pending = ""
        self.wrote_reasoning = False
        self.last = ""  # the last character written to stdout

    def _style(self, on: bool) -> str:
        return ("\033[2m" if on else "\033[0m") if self.err.isatty() else ""

    def _reason(self, text: str) -> None:
        if not self.wrote_reasoning:
            text = text.lstrip()
            if not text:
                return
            self.err.write(self._style(True) + "thinking: ")
            self.wrote_reasoning = True
        self.err.write(text)
        self.err.flush()

    def _answer(self, text: str) -> None:
        if self.wrote_reasoning and not self.last:
            text = text.lstrip()  # the blank line after </think>
        if text:
            self.out.write(text)
            self.out.flush()
            self.last = text[-1]

    def write(self, text: str) -> None:
        self.pending += text
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if self.OPEN.startswith(stripped):  # could still become "<think>": wait
                    return
                if stripped.startswith(self.OPEN):
                    self.pending, self.state = stripped[len(self.OPEN):], "thinking"
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                at = self.pending.find(self.CLOSE)
                if at >= 0:
                    self._reason(self.pending[:at])
                    self._close_reasoning()
                    self.pending, self.state = self.pending[at + len(self.CLOSE):], "answer"
                    continue
                keep = next((n for n in range(len(self.CLOSE) - 1, 0, -1) if self.CLOSE.startswith(self.pending[-n:])), 0)
                self._reason(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return
            else:
                self._answer(self.pending)
                self.pending = ""

    def _close_reasoning(self) -> None:
        if self.wrote_reasoning:
            self.err.write(self._style(False) + "\n\n")
            self.err.flush()

    def end(self) -> None:
        """Flushes what was held back and ends the answer's line."""
        if self.state == "thinking":
            self._reason(self.pending)
            self._close_reasoning()
        else:
            self._answer(self.pending)
        self.pending = ""
        if self.last != "\n":
            self.out.write("\n")
            self.out.flush()


class PrefillProgress:
    """A prefill progress bar on stderr, for prompts of several chunks when stderr is a terminal."""

    def __init__(self, min_tokens: int = 2048):
        self.min_tokens = min_tokens
        self.shown = False
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if total < self.min_tokens or not sys.stderr.isatty():
            return
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        width = 30
        fill = width * done // total
        sys.stderr.write(f"\rprefill [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tokens {rate:.0f} tok/s")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False


# -- prompt caches -----------------------------------------------------------------------------

CHAT_SYSTEM_KEY = "lily.chat_system"  # saved-session metadata: the system prompt `lily cache --chat` rendered


def _prompt_cache(model, path: str | None, chat: bool):
    """The session in ``path`` (a ``lily cache`` file), checked to fit the mode (chat or text)."""
    if path is None:
        return None
    cache = model.load_session(path)
    if chat and CHAT_SYSTEM_KEY not in cache.metadata:
        raise UsageError(f"{path} caches a plain-text prompt (made without --chat); use it without --chat")
    if not chat and CHAT_SYSTEM_KEY in cache.metadata:
        raise UsageError(f"{path} caches a chat system prompt (made with lily cache --chat); use it with --chat")
    return cache


def _cached_system(cache, args) -> str:
    """The system prompt of a chat prompt cache; --system may repeat it, not change it."""
    system = cache.metadata[CHAT_SYSTEM_KEY]
    if args.system is not None and args.system != system:
        raise UsageError(f"--system differs from the system prompt cached in {args.prompt_cache}")
    return system


def cmd_cache(args) -> int:
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {args.prompt_file}: {e.strerror}") from None
    if not text:
        raise UsageError(f"{args.prompt_file} is empty")
    model = _load(args)
    metadata = {}
    if args.chat:  # the system message as the chat template renders it, without a generation prompt
        rendered = model.render_chat([{"role": "system", "content": text}], add_generation_prompt=False)
        ids = model.tokenizer.encode(rendered)
        metadata[CHAT_SYSTEM_KEY] = text
    else:
        ids = model.encode_prompt(text)
    t0 = time.perf_counter()
    session = model.session()
    session.prefill(ids)
    seconds = time.perf_counter() - t0
    size = session.save(args.out, metadata=metadata)
    print(f"lily: cached {len(ids)} tokens (prefill {seconds:.2f} s) in {args.out} ({size / 2**20:.1f} MiB)",
          file=sys.stderr)
    return 0


# -- chat --------------------------------------------------------------------------------------

CHAT_HELP = """commands:
  /reset            start a new conversation (keeps the system prompt)
  /undo             forget your last message and the answer to it
  /system TEXT      set the system prompt and start over
  /think on|off     toggle the model's thinking (reasoning) block
  /help             this help
  /quit             leave (or Ctrl-D)"""


def history_path() -> Path:
    """The chat's line history: $XDG_CACHE_HOME/lily/chat_history (~/.cache/lily/...)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lily" / "chat_history"


def _line_editing():
    """readline (arrow keys, Ctrl-R, history across sessions) where Python has it; None else.
    Returns a function that saves the history."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input()
        return None
    path = history_path()
    try:
        readline.read_history_file(path)
    except OSError:
        pass  # no history yet
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError as e:
            print(f"lily: could not save the chat history to {path}: {e}", file=sys.stderr)

    return save


def cmd_chat(args) -> int:
    model = _load(args)
    interactive = sys.stdin.isatty()
    cache = _prompt_cache(model, args.prompt_cache, chat=True)
    system = _cached_system(cache, args) if cache is not None else args.system
    chat = model.chat(system, enable_thinking=args.think, chat_template_kwargs=args.chat_template_kwargs,
                      prompt_cache=cache, **_sampling(args))
    save_history = _line_editing() if interactive else None
    if interactive:
        print(f"lily chat - {model.config.family} ({_model_id(args, model)}). /help for commands, Ctrl-D to quit.",
              file=sys.stderr)
    try:
        return _chat_loop(chat, system, interactive)
    finally:
        if save_history is not None:
            save_history()


def _chat_loop(chat, system: str | None, interactive: bool) -> int:
    while True:
        if interactive:
            try:
                line = input(">>> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
        else:
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith("/"):
            cmd, _, rest = line.partition(" ")
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/help":
                print(CHAT_HELP, file=sys.stderr)
            elif cmd == "/reset":
                chat.reset(system)
                print("[conversation reset]", file=sys.stderr)
            elif cmd == "/undo":
                try:
                    chat.undo()
                    print("[last exchange forgotten]", file=sys.stderr)
                except Exception as e:
                    print(f"[{e}]", file=sys.stderr)
            elif cmd == "/system":
                system = rest.strip() or None
                chat.reset(system)
                print("[system prompt set; conversation reset]", file=sys.stderr)
            elif cmd == "/think":
                if rest.strip() not in ("on", "off"):
                    print("[usage: /think on|off]", file=sys.stderr)
                else:
                    chat.enable_thinking = rest.strip() == "on"
                    print(f"[thinking {rest.strip()}]", file=sys.stderr)
            else:
                print(f"[unknown command {cmd}; /help lists them]", file=sys.stderr)
            continue
        try:
            stream = chat.send(line, stream=True)
            printer = AnswerPrinter(stream.reasoning_started)
            with stream:
                for chunk in stream:
                    printer.write(chunk.text)
        except KeyboardInterrupt:
            if not interactive:
                raise
            # The turn is rolled back (lily.Chat's rule): the conversation is as before it.
            print("\n[interrupted; that message and its partial answer are forgotten]", file=sys.stderr)
            continue
        printer.end()


# -- serve -------------------------------------------------------------------------------------


def cmd_serve(args) -> int:
    try:
        from lily.server import serve
    except ImportError as e:
        raise UsageError(str(e)) from None
    model = _load(args)
    api_key = args.api_key or os.environ.get("LILY_API_KEY") or None
    model_id = _model_id(args, model)
    print(f"lily: serving {model_id!r} ({model.config.family}, context {model.max_context}) on "
          f"http://{args.host}:{args.port}/v1" + (" (API key required)" if api_key else ""), file=sys.stderr)
    from lily.server_limits import ServerLimits, default_max_connections

    limits = ServerLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                          max_connections=args.max_connections or default_max_connections(),
                          stream_timeout_s=args.stream_timeout)
    serve(model, model_id=model_id, host=args.host, port=args.port, api_key=api_key, max_queue=args.max_queue,
          cache_bytes=int(args.cache_mb * (1 << 20)), log_level=args.log_level,
          default_max_tokens=args.default_max_tokens, limits=limits, cache_dir=args.prompt_cache_dir,
          cache_disk_bytes=int(args.prompt_cache_disk_mb * (1 << 20)), max_batch=args.max_batch,
          kv_budget_bytes=None if args.kv_budget_mb is None else int(args.kv_budget_mb * (1 << 20)))
    return 0


# -- convert / bench / eval ---------------------------------------------------------------------


def cmd_convert(args) -> int:
    from lily.convert import convert

    convert(args.hf_path, args.out, bits=args.q_bits, group_size=args.q_group_size, mode=args.mode, dtype=args.dtype,
            quantize_weights=not args.no_quantize, progress=not args.quiet)
    return 0


def cmd_bench(args) -> int:
    from lily.bench import bench, print_table

    try:
        lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--prompt-lengths must be comma-separated integers, not {args.prompt_lengths!r}") from None
    model = _load(args)
    rows = bench(model, lengths, decode_tokens=args.decode_tokens, repeats=args.repeats)
    # With --json -, stdout carries the JSON alone (for jq and friends); the table goes to stderr.
    print_table(model, rows, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        _write_json({"model": _model_id(args, model), "backend": model._engine.backend,
                     "threads": model._engine.threads,
                     "cpu_matmul": model._engine.cpu_matmul, "rows": rows}, args.json)
    return 0


def cmd_doctor(args) -> int:
    from lily.doctor import main as doctor

    return doctor(args)


def _write_json(payload: dict, where: str) -> None:
    import json

    text = json.dumps(payload, indent=2)
    if where == "-":
        print(text)
    else:
        with open(where, "w") as f:
            f.write(text + "\n")


def cmd_eval(args) -> int:
    from lily.evaluate import evaluate, print_report

    model = _load(args)
    text = None
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    report = evaluate(model, reference=args.reference, positions=args.positions, text=text,
                      reference_model=args.reference_model, reference_dtype=args.reference_dtype)
    print_report(report, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        _write_json(report, args.json)
    return 0


# -- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from lily import __version__

    parser = argparse.ArgumentParser(
        prog="lily",
        description="Fast inference for the Qwen3.5 / Qwen3.6 hybrid models (Gated DeltaNet + attention, MoE).",
        epilog="Run `lily COMMAND --help` for a command's options. Without --model, generate/chat/serve/bench "
               "use the small demo model built into the package.",
    )
    parser.add_argument("--version", action="version", version=f"lily {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    fmt = HelpFormatter

    p = sub.add_parser("generate", help="generate a continuation of a prompt (streams to the terminal)",
                       formatter_class=fmt,
                       description="Generate text from a prompt given as an argument, with -p/--prompt, or on "
                                   "stdin. With --chat and thinking on, the reasoning goes to stderr, marked.")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt ('-' or omitted: read stdin)")
    p.add_argument("--prompt", "-p", dest="prompt_flag", default=None, metavar="PROMPT",
                   help="the prompt, as mlx_lm.generate takes it (instead of the argument)")
    _add_model(p)
    _add_sampling(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    p.add_argument("--system", default=None, help="system prompt (with --chat)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="enable or disable thinking (with --chat)")
    _add_template_kwargs(p, " (with --chat)")
    p.add_argument("--verbose", "-v", action="store_true", help="print token counts and speeds to stderr")
    p.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="continue from a `lily cache` file: the prompt continues the cached text (with --chat: "
                        "the cached system prompt is the conversation's)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat (also works with a pipe on stdin)", formatter_class=fmt,
                       description="Chat with a model. Each line you type is a user message; the conversation "
                                   "state is kept between turns; line editing and history (kept in "
                                   "~/.cache/lily/chat_history) where Python has readline. With thinking on, the "
                                   "reasoning goes to stderr, marked. " + CHAT_HELP.replace("\n", " "))
    _add_model(p)
    _add_sampling(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="enable or disable thinking (default: the chat template's)")
    _add_template_kwargs(p, "")
    p.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="start each conversation from a `lily cache --chat` file (its system prompt, prefilled)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("cache", help="prefill a long prompt once and save the state to a file", formatter_class=fmt,
                       description="Prefill the text of PROMPT_FILE and save the sequence state (token ids, KV cache, "
                                   "DeltaNet and conv state) to --out, as mlx_lm.cache_prompt does; `lily generate "
                                   "--prompt-cache FILE` then prefills only what follows it. The file is tied to "
                                   "this checkpoint and engine settings (backend, cpu matmul mode, KV dtype).")
    p.add_argument("prompt_file", help="text file holding the prompt")
    p.add_argument("--out", "-o", required=True, help="session file to write (safetensors)")
    p.add_argument("--chat", action="store_true",
                   help="the file is a system prompt: cache it as the chat template renders it, for "
                        "`lily chat --prompt-cache` and `lily generate --chat --prompt-cache`")
    _add_model(p)
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=fmt,
                       description="Serve a model over an OpenAI-compatible API (/v1/chat/completions, "
                                   "/v1/completions, /v1/models, /health).")
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this bearer key (default: $LILY_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model, or lily-demo)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond this get HTTP 503")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests generating at once, sharing each engine pass (continuous batching; default 8 "
                        "on the CPU backend, 7 on GPU backends: the rows of one pass there)")
    p.add_argument("--kv-budget-mb", type=float, default=None, metavar="MIB",
                   help="KV cache and state the running requests may reserve; a request waits for room, and one "
                        "that could never fit is refused (default: half the memory available at start)")
    p.add_argument("--cache-mb", type=float, default=1024, help="prompt cache budget in MiB (0 disables it)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="keep the prompt cache on disk too: sequences evicted from memory, and all of them at "
                        "shutdown, are written here and found again at the next start (files of another model "
                        "or engine setting, and damaged ones, are skipped with a warning)")
    p.add_argument("--prompt-cache-disk-mb", type=float, default=10240, metavar="MIB",
                   help="disk budget of --prompt-cache-dir in MiB (least recently used files deleted first)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens when a chat request gives none (default: generation_config, else 512)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request headers take longer (408)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="close a connection whose request body takes longer after the headers (408)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections beyond this get HTTP 503 (default: 256, or half the open-file limit)")
    p.add_argument("--stream-timeout", type=float, default=30.0, metavar="S",
                   help="drop a streamed request whose client has not read for this long")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("convert", help="Hugging Face checkpoint -> MLX affine 4/8-bit, mxfp4, mxfp8, nvfp4",
                       formatter_class=fmt,
                       description="Convert a Hugging Face bf16/fp32 checkpoint to the MLX format with "
                                   "MLX quantization, making the same per-tensor choices as mlx_lm.convert.")
    p.add_argument("hf_path", help="Hugging Face checkpoint folder (or repo id)")
    p.add_argument("--out", "-o", required=True, help="output folder (must not exist)")
    p.add_argument("--q-bits", "-b", type=int, default=None, choices=[2, 3, 4, 5, 6, 8],
                   help="bits per weight (affine; default 4)")
    p.add_argument("--q-group-size", "-g", type=int, default=None, choices=[32, 64, 128],
                   help="elements per scale (affine; default 64)")
    p.add_argument("--mode", default="affine", choices=["affine", "mxfp4", "mxfp8", "nvfp4"],
                   help="MLX quantization mode (mlx_lm.convert --q-mode); mxfp4 / mxfp8 / nvfp4 fix bits and group")
    p.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="dtype of unquantized tensors and scales (default: the checkpoint's)")
    p.add_argument("--no-quantize", action="store_true", help="only re-lay out the tensors (no quantization)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("bench", help="prefill / decode tokens per second across prompt lengths", formatter_class=fmt,
                       description="Prefill and decode speed of fresh sequences over pseudo-random prompts. With "
                                   "--json -, stdout carries the JSON alone and the table goes to stderr.")
    _add_model(p)
    p.add_argument("--prompt-lengths", "-p", default="128,512,2048", help="comma-separated prompt lengths")
    p.add_argument("--decode-tokens", "-d", type=int, default=64, help="tokens decoded after each prompt")
    p.add_argument("--repeats", "-r", type=int, default=1, help="runs per length (best is reported)")
    p.add_argument("--json", nargs="?", const="-", default=None, help="also write JSON (to a file, or '-')")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="teacher-forced perplexity and top-1 agreement against a reference",
                       formatter_class=fmt,
                       description="Run the same text through lily and a reference implementation, teacher-forced, "
                                   "and report perplexity of both and how often their top-1 tokens agree.")
    _add_model(p)
    p.add_argument("--reference", default="mlx-lm",
                   help="mlx-lm (also: mlx), or lily:BACKEND (another lily backend)")
    p.add_argument("--reference-dtype", default="float32", choices=["float32", "native"],
                   help="the reference's compute dtype: float32 (lily computes in float32), or native (the "
                        "checkpoint's own, e.g. bfloat16 for mlx-lm; top-1 then differs where bf16 rounding "
                        "flips near-ties)")
    p.add_argument("--reference-model", default=None, help="checkpoint for the reference (default: --model)")
    p.add_argument("--positions", "-N", type=int, default=256, help="token positions compared")
    p.add_argument("--text-file", default=None, help="text to evaluate on (default: a built-in passage)")
    p.add_argument("--json", nargs="?", const="-", default=None, help="also write JSON (to a file, or '-')")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("doctor", help="what lily finds here: device, kernels, the Metal check, a benchmark",
                       formatter_class=fmt,
                       description="Report the platform, the Metal device (GPU family, Metal and MSL versions) or "
                                   "why there is none, what backend='auto' chooses and why, and, on the demo model "
                                   "with the backend examined: the kernel paths chosen and why, each kernel "
                                   "library's compile result, the known-answer check against the CPU backend and "
                                   "a short benchmark. Exits 1, listing the problems, when backend='auto' passed over a "
                                   "Metal GPU it found, a needed kernel library did not compile or the check failed.")
    p.add_argument("--backend", default="auto",
                   help="backend to examine: auto (what backend='auto' chooses), cpu, metal, msl-cpu, msl-cuda")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the demo-model benchmark")
    p.add_argument("--recheck", action="store_true",
                   help="run the Metal known-answer check again instead of reading its cached result")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    import lily

    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except (UsageError, lily.LilyError, FileNotFoundError, ValueError, OSError) as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
