"""Handing the validated settings from deepy.py to every rank, through the rank's argv.

deepy validates once and puts the result (values, sources, notices) into one argv flag, so a rank
never re-reads YAML and every rank of every node gets the very same settings. The payload is
JSON, zlib-compressed, urlsafe base64: plain shell-safe characters that survive pdsh/ssh/mpirun.
"""

from __future__ import annotations

import base64
import json
import sys
import zlib

from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.errors import ConfigError

HANDOVER_FLAG = "--neox_args"
# Linux refuses a single argv string longer than 128 KiB (MAX_ARG_STRLEN)
MAX_PAYLOAD_CHARS = 120_000


def encode_args(args: NeoXArgs) -> str:
    payload = {"values": args.to_dict(), "sources": args.sources, "notices": args.notices, "given": args.given,
               "require_run_settings": args.requires_run_settings}
    text = base64.urlsafe_b64encode(zlib.compress(json.dumps(payload).encode(), 9)).decode("ascii")
    if len(text) > MAX_PAYLOAD_CHARS:
        raise ConfigError(
            f"the settings encode to {len(text)} characters, more than one command-line argument may hold "
            f"({MAX_PAYLOAD_CHARS}); the config files are too large (config_files keeps their text)"
        )
    return text


def decode_args(text: str) -> NeoXArgs:
    try:
        payload = json.loads(zlib.decompress(base64.urlsafe_b64decode(text.encode("ascii"))))
    except (ValueError, zlib.error) as err:
        raise ConfigError(f"{HANDOVER_FLAG}: not a settings payload written by deepy.py ({err})") from None
    return NeoXArgs._restore(payload["values"], payload["sources"], payload["notices"], payload["given"],
                             payload["require_run_settings"])


def handover_argv(args: NeoXArgs) -> list[str]:
    return [f"{HANDOVER_FLAG}={encode_args(args)}"]


def load_args_on_rank(argv: list[str] | None = None) -> NeoXArgs:
    """The settings deepy.py validated, from this rank's argv; other flags (--local_rank=N) are ignored."""
    argv = sys.argv[1:] if argv is None else argv
    for position, arg in enumerate(argv):
        if arg.startswith(HANDOVER_FLAG + "="):
            return decode_args(arg[len(HANDOVER_FLAG) + 1:])
        if arg == HANDOVER_FLAG and position + 1 < len(argv):
            return decode_args(argv[position + 1])
    raise ConfigError(
        f"no {HANDOVER_FLAG} argument: start this script through deepy.py "
        "(python deepy.py train.py CONFIG [CONFIG ...]), which validates the configs and hands them to every rank"
    )
