"""Where the native decode step's time goes, phase by phase, at 1 and 16 streams, with int8 activations plus their
residual (AVX-512 VNNI, the default where the CPU has it), int8 alone (TAILGUARD_INT8_ACTIVATIONS=1) and float32
activations (TAILGUARD_INT8_ACTIVATIONS=0).

    .venv/bin/python benchmarks/profile_native_step.py                    # ~2 min, all three
    .venv/bin/python benchmarks/profile_native_step.py --activations int8

The C step accumulates wall time per phase (tg_profile); the rest of a step (scheduling, batch building, sampling,
detokenization) is the step's time minus the C call's.
"""

from __future__ import annotations

import argparse
import os
import time

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--activations", choices=("int8", "int8-1pass", "float32", "all"), default="all",
                        help="int8: int8 plus its residual (the default); int8-1pass: int8 alone; float32")
    args = parser.parse_args()
    for activations in ("int8", "int8-1pass", "float32") if args.activations == "all" else (args.activations,):
        os.environ[kernels.INT8_ACTIVATIONS_ENV] = {"int8": "2", "int8-1pass": "1", "float32": "0"}[activations]
        engine = LLMEngine(EngineArgs(num_threads=2, kv_cache_memory="256MiB", runner="torch"))
        layer = engine.model.layers[0]
        print(f"\n## {activations} activations: layer matrices {kernels.NATIVE_FORMATS[layer[1].packed.fmt]}, "
              f"LM head {kernels.NATIVE_FORMATS[engine.model.lm_head.packed.fmt]}")
        profile(engine)
        del engine


def profile(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story about a dragon."}])
    for streams in (1, 16):
        for _ in range(2):  # the first run warms up; the second is reported
            for _ in range(streams):
                engine.add_request(list(prompt), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
            engine.step()  # the prefill, not profiled
            kernels.profile_decode(True)
            steps, start = 0, time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            wall = time.perf_counter() - start
            phases = kernels.profile_read()
            kernels.profile_decode(False)
        print(f"\n{streams} stream(s): {wall / steps * 1e3:.2f} ms a step")
        print("| phase | ms a step | share |")
        print("| --- | ---: | ---: |")
        for name, total in phases.items():
            print(f"| {name} | {total / steps * 1e3:.2f} | {100 * total / wall:.0f}% |")
        rest = wall - sum(phases.values())
        print(f"| everything else (Python, OpenMP start-up, final norm) | {rest / steps * 1e3:.2f} | {100 * rest / wall:.0f}% |")


if __name__ == "__main__":
    main()
