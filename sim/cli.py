"""`floodgate sim`: run the emulated vLLM server."""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

from floodgate.sim.engine import SCHEDULING_POLICIES, EngineConfig

_D = EngineConfig()


# argparse `type=` checks, shared with `floodgate load` (sim/load_cli.py): a bad value is an
# argparse error naming the option ("argument --port: expected ..."), exit 2, not a traceback
# (or a silently different value) from whatever receives it later.


def _number(text: str, convert: type[int] | type[float], want: str) -> int | float:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return value


def port(text: str) -> int:
    value = int(_number(text, int, "a port number 1-65535"))
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(_number(text, int, "an integer >= 1"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(_number(text, int, "an integer >= 0"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative(text: str) -> float:
    value = float(_number(text, float, "a number >= 0"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def positive(text: str) -> float:
    value = float(_number(text, float, "a number > 0"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="run an emulated vLLM server (OpenAI API, vLLM metrics, sleep mode)",
        description=(
            "Emulated vLLM server: OpenAI-compatible /v1/completions and /v1/chat/completions "
            "(streaming and not), /v1/models, /health, /metrics with vLLM metric names, and the "
            "vLLM sleep API. A continuous-batching model (max_num_seqs, KV-block budget, FIFO "
            "waiting queue, prefill and batch-dependent decode time) makes TTFT climb with "
            "queueing and TPOT with batch size. Per request, the header x-sim-output-tokens: N "
            "sets the output length and x-sim-prompt-tokens: N the prompt length. Defaults "
            "resemble a 7-8B model on one modern GPU; see docs/emulator.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=port, default=8000, help="port to listen on (vLLM's default)")
    srv.add_argument("--model", default="floodgate-sim-8b",
                     help="served model name; requests naming another model get 404, like vLLM")
    srv.add_argument("--cold-start", type=non_negative, default=10.0, metavar="SECONDS",
                     help="delay from process spawn until /health turns 200 and completions are "
                          "served (503 until then), emulating weight loading and warm-up")
    srv.add_argument("--enable-sleep-mode", action="store_true",
                     help="serve POST /sleep, POST /wake_up and GET /is_sleeping (404 without "
                          "it, like vLLM without sleep mode / VLLM_SERVER_DEV_MODE)")
    srv.add_argument("--default-output-tokens", type=positive_int, default=256,
                     help="output length of chat requests with neither max_tokens nor "
                          "x-sim-output-tokens (completions default to 16, like vLLM)")
    srv.add_argument("--log-level", default="info",
                     choices=("debug", "info", "warning", "error"), help="log verbosity on stderr")

    eng = p.add_argument_group("engine model")
    eng.add_argument("--max-num-seqs", type=positive_int, default=_D.max_num_seqs,
                     help="maximum sequences in a batch; further requests wait")
    eng.add_argument("--kv-blocks", type=positive_int, default=_D.num_kv_blocks,
                     help="KV-cache blocks (capacity = kv-blocks * block-size tokens)")
    eng.add_argument("--block-size", type=positive_int, default=_D.block_size,
                     help="tokens per KV-cache block")
    eng.add_argument("--max-num-batched-tokens", type=positive_int,
                     default=_D.max_num_batched_tokens,
                     help="tokens computed per step (chunked-prefill budget)")
    eng.add_argument("--max-model-len", type=positive_int, default=_D.max_model_len,
                     help="context window; longer prompt+output requests get 400")
    eng.add_argument("--prefill-ms-per-token", type=non_negative,
                     default=round(_D.prefill_per_token_s * 1000, 6),
                     help="prefill time per prompt token, milliseconds")
    eng.add_argument("--decode-base-ms", type=non_negative, default=_D.decode_base_s * 1000,
                     help="fixed time per engine step, milliseconds")
    eng.add_argument("--decode-per-seq-ms", type=non_negative,
                     default=_D.decode_per_seq_s * 1000,
                     help="extra step time per decoding sequence in the batch, milliseconds")
    eng.add_argument("--sleep-delay", type=non_negative, default=_D.sleep_s,
                     metavar="SECONDS", help="time POST /sleep takes once the engine is idle")
    eng.add_argument("--wake-delay-level1", type=non_negative, default=_D.wake_level1_s,
                     metavar="SECONDS",
                     help="time POST /wake_up takes after sleep level 1 (weights in CPU RAM)")
    eng.add_argument("--wake-delay-level2", type=non_negative, default=_D.wake_level2_s,
                     metavar="SECONDS",
                     help="time POST /wake_up takes after sleep level 2 (weights discarded)")
    eng.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=_D.scheduling_policy,
                     help="vLLM's --scheduling-policy: fcfs (a request with a non-zero `priority` gets "
                          "400, as from vLLM) or priority (the waiting queue in order of the body's "
                          "`priority`, lower first, then arrival; a full KV cache preempts the lowest "
                          "priority)")
    eng.add_argument("--time-scale", type=positive, default=1.0,
                     help="multiply every emulated duration (step times, cold start, sleep and "
                          "wake delays); 0.1 runs the model ten times faster")
    p.add_argument("--check-config", action="store_true",
                   help="validate the arguments, print the emulator's configuration and exit")
    p.set_defaults(handler=run)


def config_from_args(args: argparse.Namespace) -> Any:
    from floodgate.sim.emulator import EmulatorConfig

    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        prefill_per_token_s=args.prefill_ms_per_token / 1000,
        decode_base_s=args.decode_base_ms / 1000,
        decode_per_seq_s=args.decode_per_seq_ms / 1000,
        wake_level1_s=args.wake_delay_level1,
        wake_level2_s=args.wake_delay_level2,
        sleep_s=args.sleep_delay,
        scheduling_policy=args.scheduling_policy,
    ).scaled(args.time_scale)
    return EmulatorConfig(
        model=args.model,
        engine=engine,
        cold_start_s=args.cold_start * args.time_scale,
        enable_sleep_mode=args.enable_sleep_mode,
        default_output_tokens=args.default_output_tokens,
    )


def run(args: argparse.Namespace) -> int:
    from floodgate.sim.emulator import serve

    from floodgate.runtime import run_until_signalled

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    if args.check_config:
        import dataclasses
        import json

        import floodgate.sim.emulator  # noqa: F401  (the server's imports, without serving)

        print(json.dumps({"host": args.host, "port": args.port, **dataclasses.asdict(config)}, indent=2, default=str))
        return 0

    run_until_signalled(lambda stop: serve(config, args.host, args.port, stop))
    return 0
