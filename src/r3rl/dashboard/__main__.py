import sys

from r3rl.dashboard.cli import main

sys.exit(main())
