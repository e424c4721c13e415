"""Flags of ``fxcompiler serve`` (importable without FastAPI, so ``fxcompiler --help`` works without the extra)."""
from __future__ import annotations

import argparse

from ..engine_args import EngineArgs


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='parse tool calls out of the output when tool_choice is "auto"')
    parser.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                        help="how tool calls are written by the model (with --enable-auto-tool-choice)")
    parser.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                        help="the Jinja chat template for /v1/chat/completions (a file, or the template itself), "
                             "used when a request gives none; default: the model's")
    return parser
