import sys

from rlrun_runtime.cli import main

sys.exit(main())
