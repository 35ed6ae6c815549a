import sys

from pycoll.cli import main

sys.exit(main())
