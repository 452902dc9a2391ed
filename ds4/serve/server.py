"""`ds4 serve`: load a model, start the engine, serve the OpenAI API with uvicorn until SIGINT/SIGTERM.

With --tensor-parallel-size N the process of host 0 (rank 0) serves; on other hosts (--node-rank > 0) the process
runs its ranks only and exits when rank 0 stops. When the engine dies (a rank failed, or the engine thread
stopped on an error) /health answers 503 at once, the server shuts down FAULT_LINGER_S later (health checks see
why) and the process exits with status 1; if the shutdown itself hangs (a thread stuck in a collective), the
process is ended FAULT_EXIT_S after the fault.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from pathlib import Path

import uvicorn

from ds4.engine.config import (
    add_engine_args,
    add_launch_args,
    add_model_args,
    engine_flags_from_args,
    launch_from_args,
    model_flags_from_args,
)
from ds4.engine.structured_output import DEFAULT_MAX_WHITESPACE, GrammarCache, grammar_tokenizer_info
from ds4.serve.state import _backend

logger = logging.getLogger("ds4.serve")

FAULT_LINGER_S = 1.0
FAULT_EXIT_S = 15.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4 serve", description="Serve a DeepSeek-V4 model over the OpenAI API.")
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("DS4_API_KEY"),
        help="require `Authorization: Bearer KEY` on the API (default: $DS4_API_KEY; none: open)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients send (default: the model directory's name)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for requests that bring none")
    parser.add_argument(
        "--max-grammar-whitespace",
        type=int,
        default=DEFAULT_MAX_WHITESPACE,
        help="most consecutive blanks a JSON / tool-call grammar allows",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds a shutdown waits for running requests"
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_engine_args(parser)
    add_launch_args(parser)
    return parser


class _Server(uvicorn.Server):
    """Marks the app as shutting down the moment a signal arrives, so late requests get 503, not a hang."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig, frame) -> None:
        self._state.shutting_down = True
        super().handle_exit(sig, frame)

    def engine_died(self, error: BaseException) -> None:
        """From any thread: shut down soon, and end the process if the shutdown does not finish in time."""
        logger.error("the engine stopped (%s); the server exits", error)
        threading.Thread(target=self._exit_after_fault, name="ds4-fault-exit", daemon=True).start()

    def _exit_after_fault(self) -> None:
        time.sleep(FAULT_LINGER_S)
        self.should_exit = True
        time.sleep(FAULT_EXIT_S - FAULT_LINGER_S)
        logger.error("the shutdown did not finish within %.0f s of the fault; exiting now", FAULT_EXIT_S)
        os._exit(1)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ds4.engine.async_engine import AsyncEngine
    from ds4.engine.engine import LLMEngine
    from ds4.serve.app import create_app

    engine = LLMEngine.from_pretrained(
        args.model,
        seed=args.seed,
        launch=launch_from_args(args),
        **model_flags_from_args(args),
        **engine_flags_from_args(args),
    )
    if engine is None:  # this host's ranks ran rank 0's steps until it stopped
        logger.info("rank 0 stopped; this host's ranks are done")
        return 0
    tokenizer = engine.tokenizer
    grammars = GrammarCache(
        grammar_tokenizer_info(_backend(tokenizer), engine.model.cfg.vocab_size, tokenizer.special.eos),
        max_whitespace=args.max_grammar_whitespace,
    )
    names = args.served_model_name or [Path(args.model).name if args.model else "ds4-tiny"]
    async_engine = AsyncEngine(engine)
    app = create_app(
        async_engine,
        served_model_names=names,
        api_key=args.api_key,
        grammar_cache=grammars,
        drain_timeout_s=args.drain_timeout,
    )
    stats = engine.stats()
    logger.info(
        "serving %s on http://%s:%d/v1 (max_model_len %d, cache %d tokens)",
        names[0],
        args.host,
        args.port,
        engine.max_model_len,
        stats.capacity_tokens,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=int(args.drain_timeout)
    )
    server = _Server(config, app.state.ds4)
    async_engine.on_dead(server.engine_died)
    try:
        server.run()
    finally:
        grammars.close()
        engine.close()
    return 1 if async_engine.error is not None else 0
