"""`python -m titan_k3.eval`: see titan_k3/eval/offline.py."""

import sys

from titan_k3.eval.offline import main

sys.exit(main())
