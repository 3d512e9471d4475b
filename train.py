"""Train a GPT (dense or MoE) with megatron-core.

    torchrun --nproc-per-node N train.py --recipe recipes/tiny_dense.yaml [--any-megatron-flag value]

The run itself is megatron_ext/training/run.py (Run: parse, build, load, the loop, teardown); its
flags are arguments.py's, beside this file (where a flag of your own goes).
"""
from __future__ import annotations

import os
import sys
import time

PROGRAM_START = time.time()  # --exit-duration-in-mins counts from here, as pretrain_gpt.py's

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    from megatron_ext import helptext  # a cached text: --help imports neither torch nor megatron-core

    def _render_help() -> str:
        from megatron_ext import platform

        platform.setup()  # before megatron-core is imported
        import arguments

        return arguments.build_parser().format_help()

    here = os.path.dirname(os.path.abspath(__file__))
    helptext.show("train", [__file__, os.path.join(here, "arguments.py")], _render_help)

from megatron_ext import platform  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    platform.setup()  # CPU shims or this rank's GPU, before megatron-core is imported
    import arguments
    from megatron_ext.training import run

    if "--plan" in (sys.argv[1:] if argv is None else argv):  # predict memory and step time instead
        from megatron_ext import planner

        return planner.main(argv, prefix="--plan-", parse=arguments.parse)
    return run.main(argv, arguments.parse)  # the bring-up parses with this repository's argument layer


if __name__ == "__main__":
    from megatron_ext import errors

    errors.quiet()  # third-party warnings that tell the user nothing (--verbose shows them)
    platform.dump_native_crashes()  # a native crash prints every thread's Python stack, prefixed [rank<R>]:
    platform.setup()
    from megatron.training.training import set_startup_timestamps

    import arguments

    set_startup_timestamps(program_start=PROGRAM_START)
    errors.run(main, explain=arguments.explain)  # a refused flag: one line on rank 0, exit 1
