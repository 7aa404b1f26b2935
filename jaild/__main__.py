import sys

from jaild.cli import main

sys.exit(main())
