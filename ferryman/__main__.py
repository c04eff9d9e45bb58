import sys

from ferryman.cli import main

sys.exit(main())
