"""What a seeded draw costs over greedy: `ringserve.kernels.sampling.sample` on float32 logits of SmolLM2's vocabulary,
greedy rows against sampled ones (temperature 1, no filters; the Gumbel noise is hashed per row and token on
the device), timed in turn in one process.

    python bench/sampling_cost.py [--rows 1 8 32] [--vocab 49152] [--threads 2]

Prints the best ms per call of each and the sampled call's time over the greedy one's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ringserve.kernels.cpu.host import cpu_info, time_interleaved  # noqa: E402
from ringserve.kernels.sampling import SamplingRow, sample  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"host: {cpu_info()['model']}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
          f"vocab {args.vocab}")
    print(f"{'rows':>5} {'greedy ms':>10} {'sampled ms':>11} {'sampled/greedy':>15}")
    for n in args.rows:
        logits = torch.randn(n, args.vocab)
        greedy = [SamplingRow(0.0) for _ in range(n)]
        sampled = [SamplingRow(1.0, seed=i, position=7) for i in range(n)]
        times = time_interleaved({"greedy": lambda: sample(logits, greedy),
                                  "sampled": lambda: sample(logits, sampled)}, args.rounds)
        print(f"{n:>5} {times['greedy'] * 1e3:>10.3f} {times['sampled'] * 1e3:>11.3f} "
              f"{times['sampled'] / times['greedy']:>14.1f}×")


if __name__ == "__main__":
    main()
