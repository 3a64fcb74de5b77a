"""Build (once, cached) the embedded corpus from the Python standard library and print its paths.

    python tools/datasets/build_embedded_corpus.py [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

from megatron.data.embedded_corpus import ensure_embedded_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None,
                        help="default: $NEOX_CACHE_DIR/embedded_corpus or ~/.cache/neox-warmstart/embedded_corpus")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    corpus = ensure_embedded_corpus(args.cache_dir)
    print(f"data_path: {corpus.data_prefix}")
    print(f"vocab_file: {corpus.vocab_file}")
    print(f"ready in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
