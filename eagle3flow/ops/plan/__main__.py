"""``python -m eagle3flow.ops.plan``: the plan's command line (eagle3flow/ops/plan/)."""
import sys

from eagle3flow.ops.plan import main

sys.exit(main())
