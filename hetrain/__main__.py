import sys

from hetrain.cli import main

sys.exit(main())
