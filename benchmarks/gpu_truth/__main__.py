"""``python3 -m benchmarks.gpu_truth``: see :mod:`benchmarks.gpu_truth.run`."""

import sys

from benchmarks.gpu_truth.run import main

sys.exit(main())
